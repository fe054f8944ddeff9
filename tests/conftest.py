"""Tiny random parents of every supported family, and the reference they must match after surgery."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
# Sliding windows shorter than the test sequences, so that the per-layer masks matter.
FAMILY_KWARGS = {
    "llama": {},
    "mistral": dict(sliding_window=5),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=3),
    "qwen3": dict(use_sliding_window=True, sliding_window=5, max_window_layers=2),
    "olmo2": {},
    "olmo3": dict(sliding_window=5),
    "gemma": dict(head_dim=16),
}
FAMILIES = list(FAMILY_KWARGS)


def tiny_parent(model_type: str, num_layers: int = 6, seed: int = 0, **overrides) -> torch.nn.Module:
    config = CONFIG_MAPPING[model_type](
        num_hidden_layers=num_layers, **{**COMMON, **FAMILY_KWARGS[model_type], **overrides}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random init leaves norms at 1 and some weights tiny; perturb everything so no layer is a no-op.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def pruned(parent: torch.nn.Module, kept: list[int]) -> torch.nn.Module:
    """The parent with every layer not in `kept` removed: what an identity-adapter retrofit must compute."""
    model = copy.deepcopy(parent)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [parent.config.layer_types[i] for i in kept]
    model.config.num_hidden_layers = len(kept)
    model.config.use_cache = False  # the kept layers keep their old cache indices
    return model


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def token_batch(batch: int = 2, length: int = 12, seed: int = 1) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


# ---------------------------------------------------------------- training fixtures

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?0123456789\n"
WORDS = "the cat sat on a mat dog ran far and then slept under big red tree".split()


def char_tokenizer():
    """A character-level fast tokenizer whose 46 ids fit the tiny models' 97-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>", pad_token="<pad>", unk_token="<unk>"
    )


def write_documents(path, count: int, seed: int = 0, words=WORDS) -> None:
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + "."
            file.write(json.dumps({"text": text}) + "\n")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A tiny llama parent with a tokenizer, and two prepared token stores (seq_len 32)."""
    from recurfit.data import prepare

    root = tmp_path_factory.mktemp("workspace")
    tokenizer = char_tokenizer()
    parent = tiny_parent("llama", num_layers=6)
    parent.save_pretrained(root / "parent")
    tokenizer.save_pretrained(root / "parent")
    for name, seed, words in (("prose", 0, WORDS), ("math", 1, list("0123456789") + ["plus", "is"])):
        write_documents(root / f"{name}.jsonl", 300, seed, words)
        prepare(tokenizer, [str(root / f"{name}.jsonl")], 32, root / name, show_progress=False, val_fraction=0.05)
    return root


def run_cli(capsys, *argv) -> tuple[int, str]:
    """`recurfit ARGV…` in this process: its exit status and everything it printed, on one line."""
    from recurfit.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split())  # undo rich's line wrapping


def generate_adaptive(model, ids, mask, criterion, threshold=None, min_steps=2, **kwargs):
    """Greedy decoding of 6 tokens at r = 12 with an adaptive-exit rule; returns generate's dict output."""
    from recurfit.generation import ExitRule

    rule = ExitRule(criterion, min_steps=min_steps, **({} if threshold is None else {"threshold": threshold}))
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        num_steps=12,
        pad_token_id=0,
        return_dict_in_generate=True,
        exit_rule=rule,
        **kwargs,
    )
