"""Training at scale, proven with real processes (torchrun, gloo on the CPU): FSDP2 with a depth drawn per
micro-batch, collectives that do not grow with the recurrence, validation shared out over the processes; and the
core's gradients under bf16 autocast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import PLACEMENT, tiny_parent
from safetensors.torch import load_file
from test_train import REPO, TWO_PROCESSES, one_and_two_processes, run_cli, tiny_config, train_losses

import recurfit
from recurfit.train import load_config, train
from recurfit.train.metrics import read_log

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
PROBE = Path(__file__).parent / "distributed_probe.py"
# A hang (collectives that differ between processes) must fail the test, not the CI run.
HANG = 300


@pytest.mark.cpu_only(TWO_PROCESSES)
def test_fsdp2_with_a_depth_per_micro_batch_trains_as_one_process(tmp_path, workspace):
    """Every paper recipe draws (n, k) per micro-batch, so the two processes run their cores a different number of
    times in the same step; under FSDP2 they must still issue the same collectives (they hung before)."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 1}
    depth = {"mean_recurrence": 4, "backprop_depth": 2, "draw": "micro_batch"}
    base = tiny_config(
        workspace, tmp_path / "x", steps=3, optimizer=optimizer, depth=depth, batch={"micro": 1, "global": 4}
    )
    base["checkpoint"] = {"every": 0, "keep": 1}
    one_and_two_processes(tmp_path, base, {"distributed": "fsdp"}, timeout=HANG)
    logs = {name: [r for r in read_log(tmp_path / name) if r["kind"] == "train"] for name in ("one", "two")}
    # the draws differ between the micro-batches the two processes run at the same time
    assert any(len({tuple(d) for d in record["depths"]}) > 1 for record in logs["two"])
    assert [r["depths"] for r in logs["two"]] == [r["depths"] for r in logs["one"]]
    expected, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert list(got) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)


def probe(tmp_path: Path, workspace: Path, name: str, processes: int, mode: str = "steps", **overrides) -> list[dict]:
    """distributed_probe.py's result of each process, for the tiny config with `overrides`."""
    config = tiny_config(workspace, tmp_path / name, **overrides)
    config["eval"] = {"every": 0, "steps": [1, 2, 4, 8], "rows": 7}  # 4 micro-batches of 2 rows, the last of 1
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [*TORCHRUN, str(PROBE), mode] if processes == 2 else [sys.executable, str(PROBE), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*command, str(path), str(tmp_path / f"{name}.json")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"{name}.json.{rank}").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module")
def fsdp_probe(tmp_path_factory, workspace):
    """One process, and two under FSDP2 with 2 micro-batches of 2 rows per process and step."""
    root = tmp_path_factory.mktemp("probe")
    settings = {"batch": {"micro": 2, "global": 8}, "distributed": "fsdp"}
    return probe(root, workspace, "one", 1, **settings), probe(root, workspace, "two", 2, **settings)


@pytest.mark.cpu_only(TWO_PROCESSES)
def test_fsdp2_collectives_do_not_grow_with_the_recurrence(fsdp_probe):
    """The recurrent body is gathered once per step and reduced once: its collectives are the same at (1, 1)
    as at (6, 3), where one FSDP2 unit per core layer would gather each layer 9 times per forward."""
    _, two = fsdp_probe
    for result in two:
        counts = result["collectives"]
        assert counts["1,1"] == counts["6,3"]
        gathers, reductions = counts["1,1"]
        # units: 2 prelude layers, the body, the root. Gradients are reduced once per step (not per micro-batch),
        # each unit once; the prelude layers are gathered for each forward and backward, body and root once.
        assert reductions == 4
        assert gathers <= 2 * 2 * 2 + 2
    assert two[0]["collectives"] == two[1]["collectives"]


@pytest.mark.cpu_only(TWO_PROCESSES)
def test_validation_is_shared_out_and_reads_every_recurrence_in_one_pass(fsdp_probe):
    one, two = fsdp_probe
    (alone,) = one
    expected = alone["validation"]["record"]
    assert {key for key in expected if key.startswith("math/")} == {f"math/loss@{r}" for r in (1, 2, 4, 8)}
    # 2 stores × 4 micro-batches: one forward each (not one per test recurrence), shared 2 + 2 per store
    assert alone["validation"]["forwards"] == 2 * 4
    assert [result["validation"]["forwards"] for result in two] == [2 * 2, 2 * 2]
    for result in two:
        record = result["validation"]["record"]
        assert record.keys() == expected.keys()
        assert all(record[key] == pytest.approx(value, rel=1e-5) for key, value in expected.items() if key != "kind")


@pytest.mark.cpu_only(TWO_PROCESSES)
def test_uneven_validation_shares_need_no_collective(tmp_path, workspace):
    """3 micro-batches over 2 processes: one process runs 2 forwards, the other 1, under DDP and FSDP2 alike."""
    for strategy in ("ddp", "fsdp"):
        settings = {"batch": {"micro": 3, "global": 6}, "distributed": strategy}
        results = probe(tmp_path, workspace, strategy, 2, **settings)
        assert sorted(r["validation"]["forwards"] for r in results) == [2 * 1, 2 * 2]
        assert results[0]["validation"]["record"] == results[1]["validation"]["record"]


@pytest.mark.cpu_only(TWO_PROCESSES)
def test_resume_hashes_the_checkpoint_once_not_on_every_process(tmp_path, workspace):
    """A 1B model's checkpoint is ~12 GB: the main process verifies it, the others read the one it chose."""
    settings = {"steps": 2, "checkpoint": {"every": 1, "keep": 2}, "optimizer": {"name": "adamw", "warmup": 0}}
    config = tiny_config(workspace, tmp_path / "run", **settings)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert run_cli("train", str(tmp_path / "run.yaml")).wait(HANG) == 0
    main, other = probe(tmp_path, workspace, "run", 2, mode="resume", **settings)
    assert main == {"hashed": 3, "step": 2}  # model, optimizer and trainer files, once
    assert other == {"hashed": 0, "step": 2}


def test_saves_are_timed_and_snapshots_can_be_bf16(tmp_path, workspace, capsys):
    settings = {"steps": 2, "snapshots": {"every": 1, "dtype": "bfloat16"}, "checkpoint": {"every": 1, "keep": 1}}
    config = tiny_config(workspace, tmp_path / "run", **settings)
    config["optimizer"]["warmup"] = 0
    result = train(load_config(None, base=config))
    saves = [(r["what"], r["step"]) for r in read_log(result.out) if r["kind"] == "save"]
    assert saves == [("snapshot", 0), ("snapshot", 1), ("checkpoint", 1), ("checkpoint", 2), ("final", 2)]
    assert all(r["seconds"] > 0 for r in read_log(result.out) if r["kind"] == "save")
    snapshot = result.out / "snapshots" / "step-000001"
    weights = load_file(snapshot / "model.safetensors")
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    assert json.loads((snapshot / "config.json").read_text())["dtype"] == "bfloat16"
    final = load_file(result.out / "final" / "model.safetensors")
    assert {t.dtype for t in final.values() if t.is_floating_point()} == {torch.float32}
    # the disk estimate follows the dtype: 2 snapshots of bf16 weights
    size = sum(t.numel() * 2 for t in weights.values())
    assert f"2 × {size / 1e3:.1f} kB" in capsys.readouterr().out


# ---------------------------------------------------------------- bf16 autocast and truncated backprop


def core_gradients(model, ids, cache_enabled: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled):
        logits = model(input_ids=ids, num_steps=(3, 2)).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    trained = ("model.core.", "model.adapter.")
    return {name: p.grad for name, p in model.named_parameters() if name.startswith(trained)}


def test_bf16_autocast_keeps_the_cores_gradient_after_steps_without_it():
    """The n steps without gradient cast the core's and adapter's weights first; autocast's cache must not hand
    those gradient-less casts to the k steps with gradient (torch 2.9.1 did: the adapter got no gradient at all).

    Tolerance: the cached forward shares one bf16 cast of each weight between the k steps, so its gradient is
    summed in bf16 before it reaches the fp32 weight; the uncached one sums in fp32. bf16 keeps 8 bits (2⁻⁸ ≈ 4e-3
    relative per rounding): 1.8e-3 measured on torch 2.9.1, 0 on 2.13, whose cache no longer serves the k steps."""
    model = recurfit.retrofit(tiny_parent("llama", place=False), shape=(2, 2, 1), adapter_init="torch-default")
    model = model.to(PLACEMENT.device)  # fp32 master weights, as training holds them; the suite runs it on CUDA
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0)).to(PLACEMENT.device)
    cached, uncached = core_gradients(model, ids, True), core_gradients(model, ids, False)
    assert cached.keys() == uncached.keys() and any(name.startswith("model.adapter.") for name in cached)
    for name, grad in cached.items():
        assert grad is not None and grad.abs().sum() > 0, f"{name} got no gradient"
        assert (grad - uncached[name]).norm() <= 1e-2 * uncached[name].norm(), name
