"""A tiny training set-up from nothing (no download): a random Llama parent, a word-level tokenizer, a token store
and the config of a short `recurfit train` run, in one folder. TinyLlama-shaped for the GPU check's training
parts (benchmarks/gpu_check.py), a 16-layer toy llama for their CPU smoke and for benchmarks/validation.py.

    from train_setup import prepare_train   # with benchmarks/ on sys.path
    prepare_train(folder, smoke=True)       # folder/parent, folder/data, folder/train.yaml
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

    import torch
    import yaml
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from recurfit.data import prepare

    words = 500 if smoke else TOKENIZER_WORDS
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(words - 4)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", bos_token="<s>", pad_token="<pad>", unk_token="<unk>"
    )
    if not smoke:
        from train_step import TINYLLAMA

        config = LlamaConfig(**TINYLLAMA)
    else:
        config = LlamaConfig(vocab_size=words, num_hidden_layers=16, **TOY_LLAMA)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(work / "parent")
    tokenizer.save_pretrained(work / "parent")

    rng = random.Random(0)
    seq_len = 32 if smoke else 1024
    with open(work / "docs.jsonl", "w") as file:
        for _ in range(200 if smoke else 2000):
            text = " ".join(f"w{rng.randrange(words - 4)}" for _ in range(rng.randint(100, 1500)))
            file.write(json.dumps({"text": text}) + "\n")
    store = work / "data"
    # Random "wN" words hold no evaluation item, and the device machine has no eval sets to check them against.
    prepare(
        tokenizer,
        [str(work / "docs.jsonl")],
        seq_len,
        store,
        show_progress=False,
        val_fraction=0.05,
        force=True,
        decontaminate="none",
    )
    micro = 1 if smoke else 4
    run = {
        "out": str(work / "run"),
        "model": {"path": str(work / "parent"), "shape": [4, 8, 4]},
        "data": {"phases": [{"sources": [str(work / "data")]}], "validation": [str(work / "data")]},
        "depth": {"mean_recurrence": 4 if smoke else 32, "backprop_depth": 2 if smoke else 8, "curriculum": "constant"},
        "optimizer": {"name": "muon"},
        "batch": {"micro": micro, "global": micro},
        "steps": 3 if smoke else 12,
        "distributed": "fsdp",
        "checkpoint": {"every": 0},
        "eval": {"every": 0, "steps": [1, 4], "rows": 4},
        "log": {"progress": False},
    }
    (work / "train.yaml").write_text(yaml.safe_dump(run))
    print(f"parent {work / 'parent'}, store {work / 'data'} (seq {seq_len}), config {work / 'train.yaml'}")
