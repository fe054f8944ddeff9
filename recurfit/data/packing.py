"""How a block of documents becomes tokens: tokenised, framed with special tokens, split into train and val.

Two packings (`data prepare --packing`):

- `bos-eos` (the default): each document stripped of surrounding whitespace and tokenised with the
  tokenizer's own special tokens, then EOS appended. For tokenizers that add a BOS (Llama, TinyLlama,
  Gemma) every document starts with BOS, as the parents were pretrained and as evaluation prompts them; for
  tokenizers that add none (SmolLM2, Qwen) it is the document and EOS. This is the paper authors' packing
  (`preprocess_data_packing.py` at their release commit e21042a tokenises `text.strip() + eos_token` with
  `add_special_tokens=True`).
- `eos`: the document as it is, tokenised without special tokens, then EOS (recurfit's packing before BOS
  packing existed; stores made then were packed this way).

A conversation (instruction data, `chat.py`) is its chat template's rendering, tokens and all, whatever the
packing (the template writes its own BOS and turn markers), then EOS. A store with conversations keeps a mask
beside its tokens: 1 for the assistant's tokens, 0 for the rest of a conversation and for the EOS after it, and 1
for every token of a plain-text document in it (trained on whole, as without a mask).

`BlockEncoder` is what worker processes run: it holds the tokenizer, and turns a list of documents into two
arrays of token ids (the training and the held-out documents, each followed by EOS), and with conversations
their two masks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..defaults import DEFAULT_PACKING, PACKINGS
from ..errors import RecurfitError
from .chat import ChatRenderer, is_conversation
from .store import SPLITS

__all__ = ["DEFAULT_PACKING", "PACKINGS", "BlockEncoder", "split_of", "token_dtype"]


def split_of(text: str, val_fraction: float) -> str:
    """`val` for a document whose text hashes into the held-out share: independent of order and of sharding."""
    bucket = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64
    return "val" if bucket < val_fraction else "train"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def _plain_copy(backend):
    """A private copy of a Rust tokenizer that neither pads nor truncates. transformers leaves the shared one
    padding after any call with `padding=True` (a padded batch for generation, say), and its batch call would
    then pad every document to the block's longest with pad tokens, or cut documents short."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


class BlockEncoder:
    """Documents → (train ids, val ids), each a flat array of whole documents followed by EOS. With `chat`, a
    document may be a conversation, and the assistant masks of both arrays come with them."""

    def __init__(self, tokenizer, packing: str, val_fraction: float, screen=None, chat: bool = False):
        if packing not in PACKINGS:
            raise RecurfitError(f"--packing must be one of {', '.join(PACKINGS)}, got {packing!r}.")
        if tokenizer.eos_token_id is None:
            raise RecurfitError("The tokenizer has no EOS token, which separates packed documents.")
        self.packing, self.val_fraction = packing, val_fraction
        self.screen = screen  # a decontaminate.EvalIndex: its documents are dropped; None keeps every one
        self.eos = tokenizer.eos_token_id
        self.dtype = token_dtype(len(tokenizer))
        # The Rust tokenizer's batch call without offsets is the fastest way to the same ids as tokenizer(...).
        self.backend = _plain_copy(tokenizer.backend_tokenizer) if getattr(tokenizer, "is_fast", False) else None
        self.tokenizer = None if self.backend is not None else tokenizer
        self.chat = ChatRenderer(tokenizer) if chat else None

    @property
    def special_tokens(self) -> bool:
        return self.packing == "bos-eos"

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, framed as the packing says (EOS not yet appended)."""
        if self.special_tokens:
            texts = [text.strip() for text in texts]
        if self.backend is not None:
            encodings = self.backend.encode_batch_fast(texts, add_special_tokens=self.special_tokens)
            return [encoding.ids for encoding in encodings]
        return self.tokenizer(list(texts), add_special_tokens=self.special_tokens)["input_ids"]

    def bos_token_id(self) -> int | None:
        """The token this packing puts before every document, or None when the tokenizer adds none."""
        if not self.special_tokens:
            return None
        plain = self.backend.encode("a", add_special_tokens=False).ids if self.backend else None
        if plain is None:
            plain = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        framed = self.encode(["a"])[0]
        return framed[0] if len(framed) > len(plain) and framed[1 : 1 + len(plain)] == plain else None

    def __call__(self, documents: Sequence) -> tuple[np.ndarray, np.ndarray, dict | None, tuple | None]:
        """The training ids, the held-out ids, what decontamination dropped (None without it), and with `chat`
        the (training, held-out) assistant masks (else None). Conversations are rendered first: decontamination
        and the split read their rendered text. Screening runs here, in the worker, so that it is spread over
        the workers as tokenising is."""
        rendered = [self._render(document) for document in documents]  # (text, ids, mask); ids None: plain text
        dropped = None
        if self.screen is not None:
            masks = self.screen.masks([text for text, _, _ in rendered])
            rendered, dropped = [one for one, mask in zip(rendered, masks) if not mask], self.screen.count(masks)
        encoded = iter(self.encode([text for text, ids, _ in rendered if ids is None]))
        streams: dict[str, list[int]] = {"train": [], "val": []}
        marks: dict[str, list[int]] = {"train": [], "val": []}
        for text, ids, mask in rendered:
            split = split_of(text, self.val_fraction)
            if ids is None:
                ids = next(encoded)
                mask = [1] * (len(ids) + 1)  # plain text: every token, EOS too, as a store without masks
            else:
                mask = [*mask, 0]  # the EOS after a conversation is packing, not the assistant's
            streams[split] += ids
            streams[split].append(self.eos)
            marks[split] += mask
        train, val = (np.asarray(streams[split], dtype=self.dtype) for split in SPLITS)
        if self.chat is None:
            return train, val, dropped, None
        return train, val, dropped, tuple(np.asarray(marks[split], dtype=np.uint8) for split in SPLITS)

    def _render(self, document) -> tuple[str, list[int] | None, list[int] | None]:
        if isinstance(document, str):
            return document, None, None
        if self.chat is None or not is_conversation(document):
            raise RecurfitError(
                "A row holds a conversation (`messages`) but the sources' first rows are text, so the store was "
                "set up for plain text: put the conversations in a source of their own (its first row a "
                "conversation), or write them as text."
            )
        return self.chat(document)
