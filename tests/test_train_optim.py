"""Tests of `recurfit/train/optim.py`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_parent

from recurfit.train import Trainer, load_config, optim
from recurfit.train.config import OptimizerConfig
from recurfit.train.optim import (
    AdamWStar,
    BatchedMuon,
    build_optimizers,
    build_schedulers,
    newton_schulz_dtype,
    split_parameters,
    trains_in_bf16,
)

FIXTURES = Path(__file__).parent / "fixtures"


def _qkv(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    # GQA-like: q is 8×8, k and v 4×8. Fused [q; k; v] is 16×8, so its LR scale is √2 where each part's is 1.
    return [torch.nn.Parameter(torch.randn(rows, 8, generator=generator)) for rows in (8, 4, 4)]


# Square, wide and tall matrices, several of one shape (so Newton–Schulz runs batched), and a GQA-like k.
MUON_SHAPES = [(24, 24), (24, 24), (8, 24), (8, 24), (64, 24), (64, 24), (64, 24), (24, 64)]


def _muon_run(optimizer_class, dtype, steps=3, **settings) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in MUON_SHAPES]
    optimizer = optimizer_class(params, lr=0.02, weight_decay=0.1, momentum=0.95, **settings)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(dtype)
        optimizer.step()
    return [p.detach() for p in params]


def closed_form(step: int, total: int, warmup: int, decay: int, shape: str, m: float) -> float:
    """Warmup-stable-decay written out: linear warmup from m, constant, decay of `shape` to m."""
    if step < warmup:
        return m + (1 - m) * step / warmup
    if step < total - decay:
        return 1.0
    p = (step - (total - decay)) / decay
    f = {"cosine": (1 + math.cos(math.pi * p)) / 2, "linear": 1 - p, "1-sqrt": 1 - math.sqrt(p)}[shape]
    return m + (1 - m) * f


def multipliers(config: OptimizerConfig, total: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    (scheduler,) = build_schedulers([optimizer], config, total)
    values = []
    for _ in range(total):
        values.append(scheduler.get_last_lr()[0] / 2.0)
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_adamw_star_reproduces_the_reference_trajectory():
    """Running init, atan2 update without ε, update clipping against v, decay scaled by lr_t / lr_0."""
    vectors = json.loads((FIXTURES / "adamw_star.json").read_text())
    settings = vectors["settings"]
    params = {name: torch.nn.Parameter(torch.tensor(value)) for name, value in vectors["init"].items()}
    optimizer = AdamWStar(
        params.values(), lr=settings["initial_lr"], betas=settings["betas"], weight_decay=settings["weight_decay"]
    )
    assert len(vectors["lrs"]) == len(vectors["grads"]) == len(vectors["after"]) >= 5
    for lr, grads, after in zip(vectors["lrs"], vectors["grads"], vectors["after"]):
        optimizer.param_groups[0]["lr"] = lr
        for name, p in params.items():
            p.grad = torch.tensor(grads[name])
        optimizer.step()
        for name, p in params.items():
            torch.testing.assert_close(p.detach(), torch.tensor(after[name]), atol=1e-6, rtol=0)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_adamw_star_under_the_trainers_schedule_decays_by_the_schedule_not_the_lr():
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = AdamWStar([w], lr=2e-3, weight_decay=0.1)
    config = OptimizerConfig(warmup=2, decay=0, min_lr_ratio=0.25)
    build_schedulers([optimizer], config, total_steps=4)
    w.grad = torch.zeros(3)  # no gradient: only the decay moves w
    optimizer.step()  # step 0 runs at 0.25 · lr: the decay is 0.1 · 0.25, whatever the LR's size
    torch.testing.assert_close(w.detach(), torch.full((3,), 1 - 0.1 * 0.25))


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_fused_muon_equals_muon_on_the_concatenated_matrix():
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
    fused_params, separate_params = _qkv(0), _qkv(0)
    whole = torch.nn.Parameter(torch.cat([p.detach() for p in _qkv(0)]))
    fused = BatchedMuon(fused_params, fused=[fused_params], **settings)
    separate = BatchedMuon(separate_params, **settings)
    reference = torch.optim.Muon([whole], **settings)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=generator) for p in fused_params]
        for params in (fused_params, separate_params):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        whole.grad = torch.cat(grads)
        for optimizer in (fused, separate, reference):
            optimizer.step()
    rows = [p.shape[0] for p in fused_params]
    for p, expected in zip(fused_params, whole.detach().split(rows)):
        torch.testing.assert_close(p.detach(), expected, atol=1e-7, rtol=0)
    buffers = torch.cat([fused.state[p]["momentum_buffer"] for p in fused_params])
    torch.testing.assert_close(buffers, reference.state[whole]["momentum_buffer"], atol=0, rtol=0)
    # Orthogonalising q, k, v apart is a different update: the test above could fail. The fused and the reference
    # updates were bit-equal, and 0.0199 from the separate ones, on an AMD EPYC with AVX512-BF16 (no AMX), natively
    # and under ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2.
    difference = max((a - b).abs().max().item() for a, b in zip(fused_params, separate_params))
    assert difference > 1e-3


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_muon_in_bfloat16_equals_torch_muon_bit_for_bit(nesterov):
    expected = _muon_run(torch.optim.Muon, torch.float32, nesterov=nesterov)
    batched = _muon_run(BatchedMuon, torch.float32, nesterov=nesterov, ns_dtype=torch.bfloat16)
    for got, want in zip(batched, expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_batched_muon_in_float32_agrees_with_torch_muon_to_bfloat16_precision():
    """float32 Newton–Schulz is float64's to 3e-5 (relative, Frobenius); torch's bfloat16 one is within 2 %
    of it after three steps: the difference is bfloat16's rounding, not a different update.

    Measured on an AMD EPYC with AVX512-BF16 (no AMX), natively and under ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2:
    float32 9.96e-6 to 1.29e-5 (the bound 2.3x above), bfloat16 7.5e-3 to 1.16e-2 (75x above the lower bound, 1.7x below
    the upper)."""
    start = _muon_run(torch.optim.Muon, torch.float32, steps=0)
    bf16 = _muon_run(torch.optim.Muon, torch.float32)
    fp32 = _muon_run(BatchedMuon, torch.float32, ns_dtype=torch.float32)
    fp64 = _muon_run(BatchedMuon, torch.float64, ns_dtype=torch.float64)
    for p0, a, b, c in zip(start, bf16, fp32, fp64):
        moved = (c - p0.double()).norm()
        assert (b.double() - c).norm() / moved < 3e-5
        assert 1e-4 < (a.double() - c).norm() / moved < 0.02


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_auto_precisions_are_bf16_only_where_bf16_matmul_is_native(monkeypatch):
    """Both `auto` rules, Muon's Newton-Schulz and training's autocast: bf16 on a GPU and where the CPU multiplies
    bf16 in hardware (and no ISA cap hides it), float32 where torch would emulate it."""

    def auto_is_bf16() -> bool:
        muon = newton_schulz_dtype("auto", torch.device("cpu")) == torch.bfloat16
        assert trains_in_bf16("auto", "cpu") == muon
        return muon

    assert newton_schulz_dtype("float32", torch.device("cuda")) == torch.float32
    assert newton_schulz_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert newton_schulz_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert trains_in_bf16("auto", "cuda") and not trains_in_bf16("fp32", "cuda") and trains_in_bf16("bf16", "cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert auto_is_bf16() and not trains_in_bf16("fp32", "cpu")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN told to stay below its bf16 kernels
    assert not auto_is_bf16()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert not auto_is_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # e.g. Skylake, Zen 3
    assert not auto_is_bf16()


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_newton_schulz_batches_in_bounded_chunks(monkeypatch):
    """Chunking (a memory bound) changes nothing: a chunk of one matrix gives the same bits as a chunk of all."""
    monkeypatch.setattr(optim, "NS_BATCH_ELEMENTS", 1)
    one_by_one = _muon_run(BatchedMuon, torch.float32, ns_dtype=torch.bfloat16)
    monkeypatch.undo()
    together = _muon_run(BatchedMuon, torch.float32, ns_dtype=torch.bfloat16)
    for a, b in zip(one_by_one, together):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_muon_fused_groups_every_attention_and_mlp_of_the_model():
    from recurfit import retrofit

    model = retrofit(tiny_parent("llama"), (2, 2, 2))
    names = {id(p): n.removeprefix("model.").removesuffix(".weight") for n, p in model.named_parameters()}
    muon, adamw = build_optimizers(model, OptimizerConfig(name="muon", muon_fused=True))
    units = [[names[id(p)] for p in unit] for unit in muon.fused]
    assert len(units) == 2 * 6  # an attention and an MLP in each of the 6 layers
    assert ["core.0.self_attn.q_proj", "core.0.self_attn.k_proj", "core.0.self_attn.v_proj"] in units
    assert ["coda.1.mlp.gate_proj", "coda.1.mlp.up_proj"] in units
    fused = {n for unit in units for n in unit}
    assert not any(("o_proj" in n or "down_proj" in n or n == "adapter") for n in fused)
    # The auxiliary Adam is Keller's: ε = 1e-10; plain AdamW keeps torch's 1e-8 (both as the authors ran).
    assert adamw.param_groups[0]["eps"] == 1e-10
    assert build_optimizers(model, OptimizerConfig(name="adamw"))[0].param_groups[0]["eps"] == 1e-8
    assert build_optimizers(model, OptimizerConfig(name="muon"))[0].fused == []
    # A fused step runs on the real model and moves every matrix.
    before = [p.detach().clone() for p in muon.param_groups[0]["params"]]
    model(torch.randint(1, 90, (2, 12)), labels=torch.randint(1, 90, (2, 12)), num_steps=(1, 1)).loss.backward()
    muon.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, muon.param_groups[0]["params"]))


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize("shape", ["cosine", "linear", "1-sqrt"])
def test_schedule_matches_the_closed_form(shape):
    # 40 steps: warmup ceil(0.1 · 40) = 4, decay ceil(0.5 · 40) = 20, floor 0.01.
    config = OptimizerConfig(warmup=0.1, decay=0.5, decay_shape=shape, min_lr_ratio=0.01)
    got = multipliers(config, 40)
    assert got == pytest.approx([closed_form(s, 40, 4, 20, shape, 0.01) for s in range(40)], abs=1e-12)
    assert got[0] == pytest.approx(0.01) and got[3] == pytest.approx(0.01 + 0.99 * 3 / 4)
    assert got[4:20] == [1.0] * 16
    middle = {"cosine": 0.5, "linear": 0.5, "1-sqrt": 1 - math.sqrt(0.5)}[shape]
    assert got[30] == pytest.approx(0.01 + 0.99 * middle)
    assert 0.01 < got[39] < got[38] < 1.0


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_schedule_defaults_are_the_authors_and_decay_zero_is_constant():
    default = OptimizerConfig()
    assert (default.decay_shape, default.min_lr_ratio) == ("cosine", 0.001)
    got = multipliers(default, 50)  # warmup 5, decay 5, cosine to 0.001
    assert got == pytest.approx([closed_form(s, 50, 5, 5, "cosine", 0.001) for s in range(50)], abs=1e-12)
    constant = multipliers(OptimizerConfig(warmup=3, decay=0, min_lr_ratio=0.001), 20)
    assert constant[:3] == pytest.approx([0.001, 0.001 + 0.999 / 3, 0.001 + 0.999 * 2 / 3])
    assert constant[3:] == [1.0] * 17
    assert multipliers(OptimizerConfig(warmup=0, decay=0), 10) == [1.0] * 10


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_step_counts_round_up_as_the_authors_did():
    # ceil(fraction · steps), not round(): 0.01 · 130 = 1.3 → 2 warmup steps.
    assert OptimizerConfig(warmup=0.01, decay=0.25).schedule_steps(130) == (2, 33)
    assert OptimizerConfig(warmup=0.005, decay=0.9).schedule_steps(25000) == (125, 22500)  # TinyLlama runs
    assert OptimizerConfig(warmup=0.0025, decay=0.6).schedule_steps(50000) == (125, 30000)  # math runs
    assert OptimizerConfig(warmup=7, decay=20).schedule_steps(100) == (7, 20)  # counts are counts


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_the_trainers_schedulers_and_logged_lrs_follow_the_schedule(tmp_path, workspace):
    base = {
        "out": str(tmp_path / "run"),
        "model": {"path": str(workspace / "parent"), "shape": [2, 2, 2]},
        "data": {"phases": [{"sources": [str(workspace / "prose")]}]},
        "depth": {"mean_recurrence": 2, "backprop_depth": 1},
        "optimizer": {
            "muon_lr": 0.02,
            "lr": 0.004,
            "warmup": 2,
            "decay": 0.5,
            "decay_shape": "1-sqrt",
            "min_lr_ratio": 0.1,
        },
        "batch": {"micro": 2, "global": 2},
        "steps": 8,
        "checkpoint": {"every": 0},
        "eval": {"steps": [1], "rows": 2},
        "log": {"progress": False},
    }
    trainer = Trainer(load_config(None, base=base))
    expected = [closed_form(s, 8, 2, 4, "1-sqrt", 0.1) for s in range(8)]
    first = [trainer.train_step() for _ in range(2)]
    assert [r["muon_lr"] for r in first] == pytest.approx([0.02 * e for e in expected[:2]])
    assert [r["lr"] for r in first] == pytest.approx([0.004 * e for e in expected[:2]])
    muon, adamw = [], []
    for _ in range(6):
        muon.append(trainer.schedulers[0].get_last_lr()[0])
        adamw.append(trainer.schedulers[1].get_last_lr()[0])
        for scheduler in trainer.schedulers:
            scheduler.step()
    assert muon == pytest.approx([0.02 * e for e in expected[2:]])
    assert adamw == pytest.approx([0.004 * e for e in expected[2:]])


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    from recurfit import retrofit

    model = retrofit(tiny_parent("llama"), (2, 2, 2))
    matrices, others = split_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in matrices}
    assert "model.adapter.weight" in muon and "model.core.0.self_attn.q_proj.weight" in muon
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {names[id(p)] for p in others}
    assert all(p.ndim == 2 for p in matrices) and all("norm" not in n for n in muon)


def test_adamw_star_minimises_and_decays_with_the_schedule():
    target = torch.tensor([3.0, -2.0, 0.5])
    x = torch.nn.Parameter(torch.zeros(3))
    optimizer = AdamWStar([x], lr=0.1, weight_decay=0.0)
    for _ in range(200):
        optimizer.zero_grad()
        ((x - target) ** 2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(x.detach(), target, atol=0.05, rtol=0)
    # A zero gradient moves nothing but the decay, scaled by lr_t / lr_max (here 1/2), not by lr.
    w = torch.nn.Parameter(torch.ones(2))
    decaying = AdamWStar([w], lr=1e-3, weight_decay=0.1)
    decaying.param_groups[0]["initial_lr"], decaying.param_groups[0]["lr"] = 1e-3, 5e-4
    w.grad = torch.zeros(2)
    decaying.step()
    torch.testing.assert_close(w.detach(), torch.full((2,), 1 - 0.1 * 0.5))
