"""Tiny random parents of every supported family, and the reference they must match after surgery.

`pytest --device cuda [--dtype bfloat16]` runs the model, cache, generation and training tests on that device
and precision (the GPU suite, benchmarks/gpu_suite.py); the other tests are skipped there, as are the tests
marked `cpu_only`. Without the options every test runs on the CPU in float32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

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

# ---------------------------------------------------------------- --device and --dtype

# The test modules that follow --device (training runs through `recurfit train`, which picks the GPU itself)
# and --dtype (the models the tests build directly).
TRAINING_MODULES = {"test_train", "test_healing", "test_distributed"}  # multi-process tests there are cpu_only
DEVICE_MODULES = {"test_parity", "test_model", "test_cache", "test_generation", *TRAINING_MODULES}
DTYPE_MODULES = DEVICE_MODULES - TRAINING_MODULES
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest |Δlogit| between two bf16 computations of the same function on the tiny models: logits reach about
# 1.5, where one bf16 rounding is 2**-8 · 1.5 ≈ 0.006, and the two orders differ by up to ~16 such roundings
# accumulated through the layers (0.051 measured for OLMo-2's sdpa against eager attention on a CPU).
BF16_LOGIT_TOLERANCE = 0.1
# Tests that compare greedy tokens of two computation orders: exact in float32, not in bf16.
GREEDY_TOKENS = (
    "compares the greedy tokens of two computation orders, and a bf16 near-tie flips an argmax; in bf16 the "
    "cache is checked on logits (test_incremental_decoding_equals_the_full_forward)"
)


@dataclass
class Placement:
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    @property
    def is_default(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32


PLACEMENT = Placement()


def pytest_addoption(parser):
    group = parser.getgroup("recurfit")
    group.addoption("--device", default="cpu", help="run the model, cache, generation and training tests here")
    group.addoption("--dtype", default="float32", choices=list(DTYPES), help="precision of the tests' models")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): skipped under --device cuda, with the reason")
    config.addinivalue_line("markers", "float32_only(reason): skipped under --dtype bfloat16, with the reason")
    try:
        device = torch.device(config.getoption("--device"))
    except RuntimeError:
        raise pytest.UsageError(
            f"--device {config.getoption('--device')!r}: not a torch device; use cpu or cuda."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA GPU is visible here; leave --device out to test on the CPU.")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # what tensors report: cuda:0, not cuda
    PLACEMENT.device, PLACEMENT.dtype = device, DTYPES[config.getoption("--dtype")]


def pytest_collection_modifyitems(config, items):
    """Under --device/--dtype, run only the tests those options change; say why each other one is skipped."""
    if PLACEMENT.is_default:
        return
    modules = DEVICE_MODULES if PLACEMENT.device.type != "cpu" else DTYPE_MODULES
    for item in items:
        reason = skip_reason(item, modules)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"{PLACEMENT.device} {PLACEMENT.dtype}: {reason}"))


def skip_reason(item, modules: set[str]) -> str | None:
    if item.module.__name__ not in modules:
        return "not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)"
    cpu_only, float32_only = item.get_closest_marker("cpu_only"), item.get_closest_marker("float32_only")
    if cpu_only and PLACEMENT.device.type != "cpu":
        return cpu_only.args[0]
    if float32_only and PLACEMENT.dtype != torch.float32:
        return float32_only.args[0]
    return None


def placed(value):
    """A module or tensor moved to the tests' device (floating-point ones also to the tests' dtype)."""
    if isinstance(value, torch.nn.Module) or value.is_floating_point():
        return value.to(PLACEMENT.device, PLACEMENT.dtype)
    return value.to(PLACEMENT.device)


def tolerance(float32: float) -> float:
    """The largest |Δlogit| a test allows: its own float32 bound, or the bf16 one under --dtype bfloat16."""
    return float32 if PLACEMENT.dtype == torch.float32 else max(float32, BF16_LOGIT_TOLERANCE)


def close(float32_rtol: float, float32_atol: float) -> dict:
    """assert_close's rtol/atol: the test's own in float32, torch's bf16 defaults under --dtype bfloat16."""
    if PLACEMENT.dtype == torch.float32:
        return {"rtol": float32_rtol, "atol": float32_atol}
    return {"rtol": max(float32_rtol, 1.6e-2), "atol": max(float32_atol, BF16_LOGIT_TOLERANCE)}


# ---------------------------------------------------------------- tiny models


def tiny_parent(
    model_type: str, num_layers: int = 6, seed: int = 0, place: bool = True, **overrides
) -> torch.nn.Module:
    config = CONFIG_MAPPING[model_type](
        num_hidden_layers=num_layers, **{**COMMON, **FAMILY_KWARGS[model_type], **overrides}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random init leaves norms at 1 and some weights tiny; perturb everything so no layer is a no-op.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return placed(model) if place else model


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
    return placed(torch.randint(1, VOCAB, (batch, length), generator=generator))


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
    parent = tiny_parent("llama", num_layers=6, place=False)  # saved in float32: `train` places it itself
    parent.save_pretrained(root / "parent")
    tokenizer.save_pretrained(root / "parent")
    for name, seed, words in (("prose", 0, WORDS), ("math", 1, list("0123456789") + ["plus", "is"])):
        write_documents(root / f"{name}.jsonl", 300, seed, words)
        # Words drawn from a short list hold no evaluation item, and the GPU suite's machine has no eval sets.
        prepare(tokenizer, [str(root / f"{name}.jsonl")], 32, root / name, show_progress=False, val_fraction=0.05,
                decontaminate="none")  # fmt: skip
    return root


@pytest.fixture
def drawn(monkeypatch):
    """Every figure `recurfit.evaluate` saves, kept open after its files are written."""
    from recurfit.evaluate.figures import runs, sweeps, training
    from recurfit.io import figures as io_figures

    figures = []
    save_figure = io_figures.save_figure
    monkeypatch.setattr(io_figures.plt, "close", lambda figure: None)
    for module in (io_figures, sweeps, training, runs):  # the last three hold the name; surgery's plot looks it up
        monkeypatch.setattr(
            module,
            "save_figure",
            lambda figure, path, *rest: figures.append(figure) or save_figure(figure, path, *rest),
        )
    return figures


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
