"""Instruction data: conversations (OpenAI-style lists of `{role, content}` messages) rendered with the parent
tokenizer's chat template, and which of their tokens are the assistant's.

A conversation's tokens are exactly `tokenizer.apply_chat_template(messages)`'s. Its mask marks the assistant's
tokens, found one of two ways:

- `generation`: a template that wraps each assistant turn in `{% generation %}` … `{% endgeneration %}` marks
  them itself (transformers' `return_assistant_tokens_mask`): the tokens inside those blocks.
- `prefixes` (every other template): for each assistant turn, the conversation before it is rendered with the
  generation prompt (`<|im_start|>assistant\\n` for ChatML), and the conversation up to and including it; the
  tokens between the two are the turn's. That is the assistant's content and whatever the template writes to
  close its turn: for ChatML `<|im_end|>` and the newline after it, so the model learns to end its turn. The
  header that opens the turn belongs to the prompt. Both renderings must be prefixes of the whole conversation's
  tokens; a template that renders earlier turns differently once later ones follow (one that drops the
  reasoning of earlier turns, say) is refused, naming the fix.
"""

from __future__ import annotations

import hashlib
import re

from ..errors import RecurfitError

GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
MASK_METHODS = ("generation", "prefixes")


def is_conversation(value) -> bool:
    """True for a non-empty list of messages, each a mapping with a string `role` and a `content`."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


def check_template(tokenizer) -> None:
    """A tokenizer without a chat template cannot render `messages`: say which tokenizer and what to do."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise RecurfitError(
            f"{name} has no chat template, which renders the sources' `messages`: prepare them with the tokenizer "
            "of an instruct model (--tokenizer), or give the conversations as plain text in a `text` field."
        )


def mask_method(tokenizer) -> str:
    """`generation` when the template marks the assistant's turns itself (and the tokenizer reports offsets,
    which transformers maps the marks to tokens with); `prefixes` otherwise."""
    template = getattr(tokenizer, "chat_template", None) or ""
    marked = isinstance(template, str) and GENERATION_BLOCK.search(template)
    return "generation" if marked and getattr(tokenizer, "is_fast", False) else "prefixes"


def template_hash(tokenizer) -> str:
    """Identifies the chat template: a store rendered with another template holds other tokens."""
    return hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16]


class ChatRenderer:
    """Conversation → (its rendered text, its token ids, its assistant mask: 1 per assistant token, else 0)."""

    def __init__(self, tokenizer):
        check_template(tokenizer)
        self.tokenizer = tokenizer
        self.method = mask_method(tokenizer)

    def text(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def ids(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )
        return list(rendered["input_ids"])

    def __call__(self, messages: list[dict]) -> tuple[str, list[int], list[int]]:
        if self.method == "generation":
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return self.text(messages), list(rendered["input_ids"]), list(rendered["assistant_masks"])
        ids = self.ids(messages)
        mask = [0] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self._prefix(messages, turn, True, ids))
            end = len(self._prefix(messages, turn + 1, False, ids))
            mask[start:end] = [1] * (end - start)
        return self.text(messages), ids, mask

    def _prefix(self, messages: list[dict], turns: int, generation_prompt: bool, whole: list[int]) -> list[int]:
        """The ids of the conversation's first `turns` messages, checked to begin the whole conversation's."""
        ids = self.ids(messages[:turns], generation_prompt)
        if whole[: len(ids)] != ids:
            shown = str(messages[0].get("content"))[:40]
            raise RecurfitError(
                f"The chat template renders the conversation that starts {shown!r} differently once later turns "
                f"follow (its first {turns} messages are not a prefix of the whole), so the assistant's tokens "
                "cannot be found by rendering prefixes: use a tokenizer whose template marks assistant turns with "
                "{% generation %} … {% endgeneration %}, or give the conversations as plain text."
            )
        return ids
