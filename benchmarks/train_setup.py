"""A tiny training set-up from nothing (no download): a random Llama parent, a word-level tokenizer, a token store
and the config of a short `recurfit train` run, in one folder. TinyLlama-shaped for the GPU check's training
parts (benchmarks/gpu_check.py), a 16-layer toy llama for their CPU smoke and for benchmarks/validation.py; and
the set-up of a run on word problems, a retrofit to draft from (the GPU check's part 6).

    from train_setup import prepare_train   # with benchmarks/ on sys.path
    prepare_train(folder, smoke=True)       # folder/parent, folder/data, folder/train.yaml
    prepare_drafting(folder, smoke=True)    # folder/drafting-parent, folder/problems, folder/drafting.yaml
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_WORDS = 32000  # the synthetic tokenizer of the GPU runs: TinyLlama's vocabulary size
# The smoke's parent (with its vocabulary and layers), and benchmarks/gpu_check/smoke.py's toy models: a tiny Llama.
TOY_LLAMA = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
)


def prepare_train(work: Path, smoke: bool) -> None:
    """A parent (TinyLlama-shaped, random; tiny in the smoke), a word-level tokenizer, a token store and the
    config of a short `recurfit train` run at r̄ = 32, k̄ = 8 with FSDP2 (bf16 on the GPU)."""
    import random

    words = 500 if smoke else TOKENIZER_WORDS
    tokenizer = word_tokenizer([f"w{i}" for i in range(words - 4)])
    save_parent(work / "parent", tokenizer, smoke, words)
    rng = random.Random(0)
    texts = (
        " ".join(f"w{rng.randrange(words - 4)}" for _ in range(rng.randint(100, 1500)))
        for _ in range(200 if smoke else 2000)
    )
    # Random "wN" words hold no evaluation item, and the device machine has no eval sets to check them against.
    store = token_store(work / "docs.jsonl", tokenizer, texts, 32 if smoke else 1024, work / "data")
    micro = 1 if smoke else 4
    run = {
        "out": str(work / "run"),
        "model": {"path": str(work / "parent"), "shape": [4, 8, 4]},
        "data": {"phases": [{"sources": [str(store)]}], "validation": [str(store)]},
        "depth": {"mean_recurrence": 4 if smoke else 32, "backprop_depth": 2 if smoke else 8, "curriculum": "constant"},
        "optimizer": {"name": "muon"},
        "batch": {"micro": micro, "global": micro},
        "steps": 3 if smoke else 12,
        "distributed": "fsdp",
        "checkpoint": {"every": 0},
        "eval": {"every": 0, "steps": [1, 4], "rows": 4},
        "log": {"progress": False},
    }
    write_config(work / "train.yaml", run)


# The drafting run: word problems at r̄ = 8 (trained), decoded at r = 32 (4×, as the demo's retrofit is served).
DRAFTING = dict(problems=20000, seq_len=512, micro=8, steps=300, mean_recurrence=8, backprop_depth=4)
DRAFTING_SMOKE = dict(problems=300, seq_len=32, micro=1, steps=3, mean_recurrence=2, backprop_depth=1)


def prepare_drafting(work: Path, smoke: bool) -> None:
    """A retrofit worth drafting from: the parent as prepare_train's (TinyLlama-shaped, random) with a word-level
    tokenizer of recurfit's generated word problems, their token store and the config of a `recurfit train` run
    on them (DRAFTING). The parent's random layers hold nothing to keep, so every part trains: a few hundred steps
    teach the templates, and its depths then agree where the text is predictable and differ on the arithmetic,
    which is what self-speculation's acceptance depends on. Uniformly random tokens (prepare_train's) would leave
    every depth predicting noise."""
    from collections import Counter

    from recurfit.data.sources import math_problems

    sizes = DRAFTING_SMOKE if smoke else DRAFTING
    problems = list(math_problems(sizes["problems"], seed=0))
    counts = Counter(word for text in problems for word in text.split())
    words = [word for word, _ in counts.most_common((500 if smoke else TOKENIZER_WORDS) - 4)]
    tokenizer = word_tokenizer(words)
    save_parent(work / "drafting-parent", tokenizer, smoke, 500 if smoke else TOKENIZER_WORDS)
    # recurfit's own templates (recurfit/data/word_problems.py), decontaminated against the evaluation sets where
    # they are trained on; this run is timed, never evaluated.
    store = token_store(work / "problems.jsonl", tokenizer, problems, sizes["seq_len"], work / "problems")
    run = {
        "out": str(work / "drafting-run"),
        "model": {"path": str(work / "drafting-parent"), "shape": [4, 8, 4]},
        "data": {"phases": [{"sources": [str(store)]}]},
        "depth": {
            "mean_recurrence": sizes["mean_recurrence"],
            "backprop_depth": sizes["backprop_depth"],
            "curriculum": "constant",
        },
        "optimizer": {"name": "muon"},
        "batch": {"micro": sizes["micro"], "global": sizes["micro"]},
        "steps": sizes["steps"],
        "checkpoint": {"every": 0},
        "eval": {"every": 0},
        "log": {"progress": False},
    }
    write_config(work / "drafting.yaml", run)


def word_tokenizer(words: list[str]):
    """A word-level tokenizer of `words` (after four special tokens), splitting on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", bos_token="<s>", pad_token="<pad>", unk_token="<unk>"
    )


def save_parent(folder: Path, tokenizer, smoke: bool, vocab_size: int) -> None:
    """A random Llama: TinyLlama's shape, or in the smoke a 16-layer toy of `vocab_size` tokens; seed 0."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not smoke:
        from train_step import TINYLLAMA

        config = LlamaConfig(**TINYLLAMA)
    else:
        config = LlamaConfig(vocab_size=vocab_size, num_hidden_layers=16, **TOY_LLAMA)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def token_store(documents: Path, tokenizer, texts, seq_len: int, store: Path) -> Path:
    """`texts` as a JSONL file of documents, then as a token store of `seq_len`-token sequences (5 % held out)."""
    from recurfit.data import prepare

    with open(documents, "w") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    prepare(
        tokenizer,
        [str(documents)],
        seq_len,
        store,
        show_progress=False,
        val_fraction=0.05,
        force=True,
        decontaminate="none",
    )
    return store


def write_config(path: Path, run: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(run))
    print(f"parent {run['model']['path']}, store {run['data']['phases'][0]['sources'][0]}, config {path}")
