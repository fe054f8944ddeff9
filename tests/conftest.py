"""Tiny random parents of every supported family, and the reference they must match after surgery.

`pytest --device cuda [--dtype bfloat16]` runs the model, cache, generation and training tests on that device
and precision (part 2 of the GPU check, benchmarks/gpu_check.py); the other tests are skipped there, as are the
tests marked `cpu_only`. Without the options every test runs on the CPU in float32.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import pty
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import low_precision
import pytest
import torch
from device_modules import DEVICE_MODULES, DTYPE_MODULES  # noqa: E402
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
from recurfit.data.shards import Layout

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest |Δlogit| between two bf16 computations of the same function on the tiny models: logits reach about
# 1.5, where one bf16 rounding is 2**-8 · 1.5 ≈ 0.006, and the two orders differ by up to ~16 such roundings
# accumulated through the layers (0.051 measured for OLMo-2's sdpa against eager attention on a CPU).
BF16_LOGIT_TOLERANCE = 0.1
# Two computation orders of one bf16 gradient (truncated backprop, checkpointing) differ by rounding: a few ulps
# (2^-8 of the value each) of the tensor's largest element. Measured: 0 on AMX, AVX-512 and AVX2 kernels.
BF16_GRADIENT_ULPS = 4
# Tests that compare greedy tokens of two computation orders: exact in float32, not in bf16.
GREEDY_TOKENS = (
    "compares the greedy tokens of two computation orders, and a bf16 near-tie flips an argmax; in bf16 the "
    "cache is checked on logits (test_incremental_decoding_equals_the_full_forward)"
)
# Tests that compare the greedy tokens or exit depths of a padded batch with each prompt decoded alone: exact in
# float32; in bf16 the two shapes take different SDPA kernels, whose roundings flip near-ties.
PADDED_ROWS = (
    "compares the greedy tokens or exit depths of a padded batch with each prompt alone, whose attention runs in "
    "other kernels, and a bf16 near-tie flips an argmax or an exit; in bf16 padding is checked on logits "
    "(test_left_padded_batch_equals_each_sequence_alone)"
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
    config.addinivalue_line(
        "markers", "two_processes: runs torchrun with 2 gloo processes (scripts/repeat-two-processes.py repeats them)"
    )
    config.addinivalue_line("markers", low_precision.DESCRIPTION)
    config.addinivalue_line("markers", low_precision.OPT_OUT_DESCRIPTION)
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


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: `-m low_precision` sees the marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests that compute in low precision (tests/low_precision.py). Under --device/--dtype, run only
    the tests those options change; say why each other one is skipped."""
    for item in items:
        if low_precision.computes_in_low_precision(item):
            item.add_marker(low_precision.MARKER)
    if PLACEMENT.is_default:
        return
    modules = DEVICE_MODULES if PLACEMENT.device.type != "cpu" else DTYPE_MODULES
    for item in items:
        reason = skip_reason(item, modules)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"{PLACEMENT.device} {PLACEMENT.dtype}: {reason}"))


# Why two-process tests are skipped under --device cuda: the GPU check's parts 3 and 4 (benchmarks/gpu_check.py) run
# one NCCL process instead.
TWO_PROCESSES = "2 processes need 2 GPUs under --device cuda, and the GPU check's machine has 1"


def skip_reason(item, modules: set[str]) -> str | None:
    if item.module.__name__ not in modules:
        return "not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)"
    cpu_only, float32_only = item.get_closest_marker("cpu_only"), item.get_closest_marker("float32_only")
    if cpu_only and PLACEMENT.device.type != "cpu":
        return cpu_only.args[0]
    if item.get_closest_marker("two_processes") and PLACEMENT.device.type != "cpu":
        return TWO_PROCESSES
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


def gradient_close(expected: torch.Tensor, float32_rtol: float, float32_atol: float) -> dict:
    """assert_close's rtol/atol for a gradient: the test's own in float32; under --dtype bfloat16, a few bf16 ulps
    of the tensor's largest element. The tiny models' gradients reach 1e-3 to 0.9 per tensor (measured on the
    retrofits of test_model_modeling.py), so the logits' atol (0.1) would accept a gradient of zeros."""
    if PLACEMENT.dtype == torch.float32:
        return {"rtol": float32_rtol, "atol": float32_atol}
    return {"rtol": 1.6e-2, "atol": BF16_GRADIENT_ULPS * 2**-8 * expected.abs().max().item()}


def control_margin(float32: float) -> float:
    """The smallest difference a negative control accepts as "different": twice the tolerance of the positive check
    it guards (`tolerance(float32)`), so that no result passes both the control and the check."""
    return 2 * tolerance(float32)


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


def char_tokenizer(chars: str = CHARS):
    """A character-level fast tokenizer whose 46 ids fit the tiny models' 97-token vocabulary (other `chars`, in
    another order: another tokenizer of the same size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>", pad_token="<pad>", unk_token="<unk>"
    )


# ChatML's layout in the character tokenizer's own special tokens; each assistant turn in a generation block
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '</s>\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '</s>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)


def chat_tokenizer(generation: bool = True):
    """The character tokenizer with a chat template, its vocabulary unchanged (a store of it trains the workspace's
    parent); with `generation`, the template marks assistant turns with {% generation %} blocks."""
    tokenizer = char_tokenizer()
    template = CHAT_TEMPLATE
    if not generation:
        template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tokenizer.chat_template = template
    return tokenizer


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """Sums asked and answered in one or two exchanges, some after a system message (lengths vary)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": "answer in words."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 2)):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            reply = f"{a} plus {b} is {a + b}." + " ok then." * rng.randint(0, 3)
            messages += [{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": reply}]
        out.append(messages)
    return out


def write_conversations(path, items: list[list[dict]]) -> None:
    import json

    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in items))


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
        # Words drawn from a short list hold no evaluation item, and the GPU check's machine has no eval sets.
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


# ---------------------------------------------------------------- shared by several test files


class AdapterProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the inner width of every matrix product that reads the adapter's weight (or a slice of it)."""

    def __init__(self, adapter: torch.nn.Module):
        super().__init__()
        self.storage, self.widths = adapter.weight.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            left, right = args[-2:]
            if right.untyped_storage().data_ptr() == self.storage:
                self.widths.append(left.shape[-1])
        return func(*args, **(kwargs or {}))


def model_with_state_for_cache(family: str = "llama", shape=(2, 2, 2)):
    """A retrofit whose adapter reads the state (random init) and whose s_0 is zeros (deterministic)."""
    import recurfit

    torch.manual_seed(0)
    return recurfit.retrofit(tiny_parent(family), shape, adapter_init="random", state_init_std=0.0).eval()


def prompts_for_cache(batch=2, length=11, seed=0):
    ids = placed(torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    return ids, mask


@pytest.fixture
def parent_dir(tmp_path):
    folder = tmp_path / "parent"
    tiny_parent("llama", num_layers=6).save_pretrained(folder)
    return folder


def recurrent(family="llama", **kwargs):
    """A retrofit whose depth matters: a random adapter, so every r gives different logits."""
    import recurfit

    parent = tiny_parent(family)
    return recurfit.retrofit(parent, (2, 2, 2), adapter_init="random", **kwargs).eval()


@pytest.fixture(scope="module")
def lm_pair():
    from recurfit.evaluate.lm import RecurfitLM

    model = recurrent(state_init_std=0.0)
    tokenizer = char_tokenizer()

    def make(batch_size, **kwargs):
        return RecurfitLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, num_steps=3, **kwargs)

    return make


def _requests(kind, arguments):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny parent and its retrofit saved with a tokenizer, as `eval` finds them on disk."""
    import recurfit

    root = tmp_path_factory.mktemp("eval")
    tokenizer = char_tokenizer()
    parent = tiny_parent("llama")
    for name, model in (("parent", parent), ("model", recurfit.retrofit(parent, (2, 2, 2), adapter_init="random"))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def visible_ticks(axis, which: str) -> list[str]:
    low, high = sorted(getattr(axis, f"get_{which}lim")())
    ticks = zip(getattr(axis, f"get_{which}ticks")(), getattr(axis, f"get_{which}ticklabels")())
    return [label.get_text() for value, label in ticks if low <= value <= high and label.get_text()]


def assert_inside(axis, xs, ys) -> None:
    import numpy as np

    (x0, x1), (y0, y1) = sorted(axis.get_xlim()), sorted(axis.get_ylim())
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    assert np.all((xs > x0) & (xs < x1)), (axis.get_title(), xs, (x0, x1))
    assert np.all((ys > y0) & (ys < y1)), (axis.get_title(), ys, (y0, y1))


def check_figure(figure) -> None:
    renderer = figure.canvas.get_renderer()
    panels = [axis for axis in figure.axes if axis.get_visible()]
    assert figure.get_suptitle()
    (legend,) = figure.legends  # one legend for the figure, none inside a panel
    legend_box = legend.get_window_extent(renderer)
    assert 0 <= legend_box.x0 and legend_box.x1 <= figure.bbox.width and 0 <= legend_box.y0, legend_box
    for axis in panels:
        assert axis.get_legend() is None and axis.get_title() and axis.get_xlabel() and axis.get_ylabel()
        assert len(visible_ticks(axis, "x")) >= 2, (axis.get_title(), axis.get_xticks(), axis.get_xlim())
        assert len(visible_ticks(axis, "y")) >= 2, axis.get_title()
        assert not legend_box.overlaps(axis.get_window_extent(renderer))
        for line in axis.get_lines():
            if line.get_transform() == axis.transData:  # data lines, not the parent's horizontal line
                assert_inside(axis, *line.get_data())
            else:
                y = line.get_ydata()[0]
                assert min(axis.get_ylim()) < y < max(axis.get_ylim()), axis.get_title()
        for text in axis.texts:  # the r= labels
            assert axis.get_window_extent(renderer).contains(*text.get_window_extent(renderer).p1), text.get_text()


# (generator, text, what the filter passes on: None when the row is dropped)
ROWS = [
    ("DeepSeek-R1", "<extra_id_1>User\nwhy?\n<extra_id_1>Assistant\nbecause.", None),
    ("DeepSeek-R1-0528", "<extra_id_1>User\nsum 2 and 2\n<extra_id_1>Assistant\n4", None),
    ("deepseek-ai/DeepSeek-R1-Zero", "zero", None),
    ("QwQ-32B", "a qwq answer", None),
    ("Qwen3-235B-A22B-Thinking-2507", "a thinking answer", None),
    ("gpt-oss-120b", "an oss answer", None),
    ("Qwen3-235B-A22B", "<extra_id_1>User\nname a cat.\n<extra_id_1>Assistant\ntom.", "name a cat.\ntom."),
    (
        "Qwen2.5-32B-Instruct",
        "<extra_id_0>System\nbe brief.\n\n<extra_id_1>User\nhi\n<extra_id_1>Assistant\nhello\n"
        "<extra_id_1>User\nbye\n<extra_id_1>Assistant\nsee you.\n",
        "be brief.\n\nhi\nhello\nbye\nsee you.",
    ),
    ("DeepSeek-R1-Distill-Qwen-32B", "a distilled answer", "a distilled answer"),  # SFT-distilled: kept
    ("Mixtral-8x22B-Instruct-v0.1", "input: 1 plus 1? output: 2.", "input: 1 plus 1? output: 2."),  # not role tags
    (None, "  no generator, the user said hi  ", "no generator, the user said hi"),
]


def write_jsonl(path, rows=ROWS, key="generator"):
    with open(path, "w") as file:
        for generator, text, _ in rows:
            file.write(json.dumps({"text": text, key: generator}) + "\n")


def model_with_state(family: str = "llama", shape=(2, 2, 2), **kwargs):
    """A retrofit whose adapter reads the state (random init) and whose s_0 is zeros (deterministic)."""
    import recurfit

    torch.manual_seed(0)
    kwargs = {"adapter_init": "random", "state_init_std": 0.0, **kwargs}
    return recurfit.retrofit(tiny_parent(family), shape, **kwargs).eval()


def prompts(batch=2, length=11, seed=0):
    ids = placed(torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0  # left padding
    return ids, mask


# Any override of the section switches distillation on; a drawn adapter makes the student differ from its parent
# (the identity adapter keeps a (2, 2, 2) retrofit of the 6-layer parent equal to it: KL 0).
DISTILL = ("distill.temperature=1.7", "model.adapter_init=torch-default")


def tiny_plan_model(**overrides):
    """A (2, 2, 2) retrofit of a tiny llama on the meta device, and a config of micro-batch 2 of 8."""
    from conftest import tiny_parent

    from recurfit import retrofit
    from recurfit.train import load_config
    from recurfit.train.initial_model import planned_parts

    settings = {"out": "unused", "data": {"phases": [{"sources": ["unused"]}]}, "batch": {"micro": 2, "global": 8}}
    config = load_config(None, [f"{key}={value}" for key, value in overrides.items()], base=settings)
    with torch.device("meta"):
        model = retrofit(tiny_parent("llama", num_layers=6, place=False), (2, 2, 2))
    return config, planned_parts(model, config)


def plan(config, model, **kwargs):
    from recurfit.train.memory import plan_memory

    return plan_memory(config, model, 32, **{"device": "cuda", **kwargs})


def tiny_config(workspace: Path, out: Path, **overrides) -> dict:
    config = {
        "out": str(out),
        "model": {"path": str(workspace / "parent"), "shape": [2, 2, 2]},
        "data": {
            "phases": [
                {"sources": [str(workspace / "prose")], "tokens": 32 * 8 * 4},
                {
                    "sources": [
                        {"path": str(workspace / "prose"), "weight": 1},
                        {"path": str(workspace / "math"), "weight": 1},
                    ]
                },
            ],
            "validation": [str(workspace / "prose"), str(workspace / "math")],
        },
        "depth": {"mean_recurrence": 4, "backprop_depth": 2, "curriculum": "1-sqrt", "curriculum_fraction": 0.5},
        # Newton-Schulz in float32 whatever the CPU: the loop's tests then compute alike on every CPU kind (`auto`
        # is bf16 only where bf16 matmul is native). Muon in bf16 has tests of its own (tests/low_precision.py
        # selects them).
        "optimizer": {"name": "muon", "muon_lr": 0.02, "lr": 0.003, "warmup": 2, "decay": 0.2, "muon_dtype": "float32"},
        # Forward and backward in float32 likewise (`auto` autocasts to bf16 where bf16 matmul is native): the loop's
        # tests compare computation orders (processes, resumes, accumulation) at float32's precision; bf16 autocast
        # training has tests of its own.
        "precision": "fp32",
        "batch": {"micro": 2, "global": 8},
        "steps": 12,
        "checkpoint": {"every": 4, "keep": 2},
        "eval": {"every": 0, "steps": [1, 4], "rows": 4},
        "log": {"progress": False},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            config[section][name] = value
        else:
            config[section] = value
    return config


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    """A recurrent run and its fixed-depth parent trained on the same data, 8 steps, snapshots every 3."""
    from recurfit.train import load_config, train

    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("recurrent", []), ("parent", ["model.shape=null"])):
        overrides = ["steps=8", "snapshots.every=3", "checkpoint.every=4", *extra]
        train(load_config(None, overrides, base=tiny_config(workspace, root / name)))
    return root


THEIR_NORMS = {
    "llama": ("input_layernorm", "post_attention_layernorm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


def write_raven_checkpoint(model: recurfit.RecurrentForCausalLM, folder, family: str, padded_vocab: int):
    """Write `model` the way the reference code names and fuses its tensors."""
    from safetensors.torch import save_file

    sd, text = model.state_dict(), model.config.text_config
    pad = padded_vocab - text.vocab_size
    out = {
        "transformer.wte.weight": torch.cat([sd["model.embed_tokens.weight"], torch.randn(pad, text.hidden_size)]),
        "lm_head.weight": torch.cat([sd["lm_head.weight"], torch.randn(pad, text.hidden_size)]),
        "transformer.ln_f.weight": sd["model.norm.weight"],
        "transformer.adapter.weight": sd["model.adapter.weight"],
    }
    for ours, theirs in {"prelude": "prelude", "core": "core_block", "coda": "coda"}.items():
        for i in range(len(getattr(model.model, ours))):
            src, dst = f"model.{ours}.{i}.", f"transformer.{theirs}.{i}."
            out[dst + "attn.Wqkv.weight"] = torch.cat([sd[src + f"self_attn.{p}_proj.weight"] for p in "qkv"])
            out[dst + "attn.proj.weight"] = sd[src + "self_attn.o_proj.weight"]
            out[dst + "mlp.fc.weight"] = torch.cat([sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]])
            out[dst + "mlp.proj.weight"] = sd[src + "mlp.down_proj.weight"]
            norm_1, norm_2 = THEIR_NORMS[family]
            out[dst + "norm_1.weight"], out[dst + "norm_2.weight"] = (
                sd[src + f"{norm_1}.weight"],
                sd[src + f"{norm_2}.weight"],
            )
            if family == "olmo2":
                out[dst + "attn.q_norm.weight"] = sd[src + "self_attn.q_norm.weight"]
                out[dst + "attn.k_norm.weight"] = sd[src + "self_attn.k_norm.weight"]
    save_file({k: v.contiguous() for k, v in out.items()}, folder / "model.safetensors")
    P, R, C = model.config.shape
    config = {
        "model_type": "huginn_raven",
        "architectures": ["RavenForCausalLM"],
        "n_embd": text.hidden_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": text.hidden_size // text.num_attention_heads,
        "intermediate_size": text.intermediate_size,
        "n_layers": P + R + C,
        "n_layers_in_prelude": P,
        "n_layers_in_recurrent_block": R,
        "n_layers_in_coda": C,
        "norm_eps": text.rms_norm_eps,
        "vocab_size": text.vocab_size,
        "padded_vocab_size": padded_vocab,
        "rope_base": text.rope_parameters["rope_theta"],
        "tie_embeddings": False,
        "mean_recurrence": 8,
        "mean_backprop_depth": 4,
        "init_values": {"std": 0.02, "embed_scale": 1.0},
        "max_position_embeddings": text.max_position_embeddings,
    }
    (folder / "config.json").write_text(json.dumps(config))


def raven_folder(tmp_path, original, family="llama", name="raven", tensors=None, **config):
    """`original` written in the authors' layout, with extra config.json keys and tensors (None removes a key)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / name
    folder.mkdir()
    write_raven_checkpoint(original, folder, family, padded_vocab=128)
    settings = json.loads((folder / "config.json").read_text())
    settings.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    if tensors:
        state = load_file(folder / "model.safetensors") | tensors
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def small_run(workspace, out, steps=3, **overrides) -> dict:
    config = tiny_config(workspace, out, steps=steps, checkpoint={"every": 0, "keep": 1}, **overrides)
    config["data"]["phases"] = [{"sources": [str(workspace / "prose")]}]
    config["optimizer"].update(warmup=1, decay=1)
    return config


def short(workspace, out, *overrides, **sections) -> object:
    """A 4-step run of the tiny retrofit (checkpoint at 2), with `overrides` (`key=value`) applied."""
    from recurfit.train import load_config

    base = tiny_config(workspace, out, steps=4, checkpoint={"every": 2, "keep": 2}, **sections)
    return load_config(None, list(overrides), base=base)


def state_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def names_in_optimizers(trainer) -> set[str]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)] for o in trainer.optimizers for g in o.param_groups for p in g["params"]}


SMALL = Layout(shard_documents=16, block_documents=4)  # 300 documents: 19 shards of 4 blocks


@pytest.fixture
def documents(tmp_path) -> list[str]:
    write_documents(tmp_path / "docs.jsonl", 300)
    return [str(tmp_path / "docs.jsonl")]


KEY = re.compile(r"^(out|steps|model|data|depth|optimizer|batch|eval)(\.[\w]+)*=")


def suggested_overrides(path: Path) -> list[list[str]]:
    """The runs a recipe's header suggests, as override lists: `recurfit train RECIPE k=v …` lines,
    `k=v k2=v2` lines, and `label: k=a | b | c` lines (one run per alternative)."""
    runs = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = re.split(r"\s{2,}[#(]", line.lstrip("# ").split("# ")[0])[0].strip()  # drop trailing remarks
        text = text.split(":", 1)[1].strip() if re.match(r"^[a-z ]+:\s", text) else text
        if text.startswith("recurfit train"):
            runs.append([token for token in text.split()[3:] if "=" in token])
        elif "|" in text and KEY.match(text):
            key, first = text.split("|")[0].split("=", 1)
            runs += [[f"{key}={value.split()[0]}"] for value in [first, *text.split("|")[1:]]]
        elif KEY.match(text):
            runs.append(text.split())
    return runs


def config_for(workspace: Path, out: Path, *overrides: str, **sections):
    from recurfit.train import load_config

    return load_config(None, list(overrides), base=tiny_config(workspace, out, **sections))


def stopped_run(workspace: Path, out: Path, steps_done: int = 4, *overrides: str):
    """A run of 8 steps that stopped (as if killed) after `steps_done`, with a checkpoint every 2 steps."""
    from recurfit.train import Trainer

    config = config_for(workspace, out, "steps=8", "checkpoint.every=2", *overrides)
    trainer = Trainer(config)
    for _ in range(steps_done):
        trainer.log.write(trainer.train_step())
        if trainer.counters.step % 2 == 0:
            trainer.checkpoint()
    trainer.log.close()
    return config


PROMPT = "Do you wish to run the custom code"


CODE_MODULE = "raven_code"  # what the auto_map entries name: raven_code.py beside the weights


def write_code(folder, marker) -> None:
    """raven_code.py, which writes `marker` as soon as Python imports it."""
    (folder / f"{CODE_MODULE}.py").write_text(f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('ran')\n")


def add_auto_map(file, entries: dict, **fields) -> None:
    settings = json.loads(file.read_text())
    file.write_text(json.dumps({**settings, **fields, "auto_map": entries}))


def point_at_code(folder, marker, tokenizer_class: str | None = None) -> None:
    """The authors' folders' `auto_map`: config.json's and tokenizer_config.json's classes in the folder's code;
    `tokenizer_class`: one transformers does not have, so the tokenizer cannot be read without the code."""
    write_code(folder, marker)
    classes = {
        name: f"{CODE_MODULE}.Raven{name.removeprefix('Auto')}" for name in ("AutoConfig", "AutoModelForCausalLM")
    }
    add_auto_map(folder / "config.json", classes)
    tokenizer = {"AutoTokenizer": [f"{CODE_MODULE}.RavenTokenizer", f"{CODE_MODULE}.RavenTokenizerFast"]}
    add_auto_map(
        folder / "tokenizer_config.json", tokenizer, **({"tokenizer_class": tokenizer_class} if tokenizer_class else {})
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two raven checkpoints carrying code (a tokenizer transformers reads without it, and one it cannot read),
    a recurfit model whose tokenizer needs its code, and a token store to train and evaluate on."""
    from recurfit.data import prepare

    root = tmp_path_factory.mktemp("remote-code")
    original = recurfit.retrofit(tiny_parent("llama", place=False), shape=(1, 2, 1), adapter_init="random")
    tokenizer = char_tokenizer()
    for name, tokenizer_class in (("raven", None), ("raven-own-tokenizer", "RavenTokenizer")):
        (root / name).mkdir()
        write_raven_checkpoint(original, root / name, "llama", padded_vocab=97)
        tokenizer.save_pretrained(root / name)
        point_at_code(root / name, root / "marker", tokenizer_class)
    original.save_pretrained(root / "recurrent")
    tokenizer.save_pretrained(root / "recurrent")
    write_code(root / "recurrent", root / "marker")
    add_auto_map(
        root / "recurrent" / "tokenizer_config.json",
        {"AutoTokenizer": [f"{CODE_MODULE}.RavenTokenizer", None]},
        tokenizer_class="RavenTokenizer",
    )
    write_documents(root / "docs.jsonl", 60)
    prepare(tokenizer, [str(root / "docs.jsonl")], 16, root / "data", show_progress=False, val_fraction=0.2)
    return root


def run_in_terminal(tmp_path, *argv) -> subprocess.CompletedProcess:
    """`recurfit ARGV…` with a terminal as standard input that has already answered "y" to any question."""
    terminal, device = pty.openpty()
    os.write(terminal, b"y\n" * 8)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),  # where transformers would copy the folder's code to run it
        "RECURFIT_CACHE": str(tmp_path / "cache"),
    }
    try:
        return subprocess.run(
            [sys.executable, "-m", "recurfit", *map(str, argv)],
            stdin=device,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(terminal)
        os.close(device)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]  # errors: stderr


def assert_never_asked(folders, result) -> None:
    output = result.stdout + result.stderr
    ran = (folders / "marker").exists()
    (folders / "marker").unlink(missing_ok=True)  # the next test starts clean
    assert not ran, f"the folder's own code ran: {output}"
    assert PROMPT not in output and "Traceback" not in output, output


def bad_data_files(folder):
    """Files a user might pass by mistake, and the start of the one line each must give."""
    plain = folder / "plain.jsonl.gz"
    plain.write_text('{"text": "not gzipped"}\n')
    latin = folder / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "caf\xe9"}\n')
    cut = folder / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:60])
    damaged = folder / "damaged.parquet"
    damaged.write_bytes(b"PAR1 this is not really parquet")
    return {
        plain: f"{plain}: cannot read it as gzip (Not a gzipped file",
        latin: f"{latin}:3: byte 0xe9 (byte 14 of the line) is not UTF-8; convert the file to UTF-8",
        cut: f"{cut}: cannot read it as gzip (",
        damaged: f"{damaged}: not a readable parquet file (",
    }


REPO = Path(__file__).resolve().parents[1]


def spawn_recurfit(*args, env_extra=None, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "recurfit", *args], cwd=REPO, env=env, **kwargs)


def train_losses(out: Path) -> dict[int, float]:
    from recurfit.train.metrics import read_log

    return {r["step"]: r["loss"] for r in read_log(out) if r["kind"] == "train"}


def one_and_two_processes(
    tmp_path, config: dict, two_processes: dict, timeout: float | None = None
) -> tuple[Path, Path]:
    """Train `config` in 1 process and, concurrently, under torchrun with 2 (plus `two_processes` settings); a run
    that takes longer than `timeout` seconds (a hang) fails."""
    import yaml

    one, two = tmp_path / "one", tmp_path / "two"
    (tmp_path / "one.yaml").write_text(yaml.safe_dump({**config, "out": str(one)}))
    (tmp_path / "two.yaml").write_text(yaml.safe_dump({**config, **two_processes, "out": str(two)}))
    single = spawn_recurfit("train", str(tmp_path / "one.yaml"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    double = subprocess.run(
        [*torchrun, "-m", "recurfit", "train", str(tmp_path / "two.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert double.returncode == 0, double.stderr[-3000:]
    assert single.wait(timeout) == 0, single.stderr.read().decode()[-2000:]
    return one, two
