"""Tests of `recurfit/train/distributed.py`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    PLACEMENT,
    REPO,
    one_and_two_processes,
    spawn_recurfit,
    tiny_config,
    tiny_parent,
    tiny_plan_model,
    train_losses,
)
from safetensors.torch import load_file

import recurfit
from recurfit.errors import RecurfitError
from recurfit.train import load_config, train
from recurfit.train.metrics import read_log

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


PROBE = Path(__file__).parent / "distributed_probe.py"


# A hang (collectives that differ between processes) must fail the test, not the CI run.
HANG = 300

DEPTHS = [(1, 1), (6, 3)]  # distributed_probe.py's: one training step at each (then one at uneven depths)


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


def core_gradients(model, ids, cache_enabled: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled):
        logits = model(input_ids=ids, num_steps=(3, 2)).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    trained = ("model.core.", "model.adapter.")
    return {name: p.grad for name, p in model.named_parameters() if name.startswith(trained)}


# AdamW in float32: 2 processes differ from 1 by the float rounding of the all-reduce only, which AdamW's update
# does not amplify over 6 steps (equal to the bit under AMX, AVX-512 and AVX2 kernels).
DDP_TOLERANCE = 1e-6

# Muon amplifies differences at the last bit: over 6 steps a difference of one ulp in a gradient (the all-reduce's
# order, a kernel's blocking) grows to 1e-5..1e-4 of the loss, by an amount that depends on the CPU's kernels (bf16
# Newton-Schulz on AMX reached 1.04e-4 where AVX-512 gave 1.4e-5). No fixed figure holds on every CPU, so the bound
# is measured where the test runs: the noise floor is the larger difference that regrouping the same 1-process run
# into micro-batches of 1 and of 4 rows (the same global batch, other summation orders) makes, and 2 processes must
# stay within FLOOR_FACTOR of it. Measured on AMX, AVX-512 and AVX2 kernels (ONEDNN_MAX_CPU_ISA), fp32 and bf16
# Newton-Schulz, DDP and FSDP2: the 2-process difference was 0 to 1.4 times the floor. A DDP whose processes
# stepped on their own gradients (never reduced before the update) differs by 1.1e-2 at step 2: 30 times the
# largest bound measured.
FLOOR_FACTOR = 4
# The floor is measured through the code under test, so it is capped: at most 1e-3, 10 times the largest measured
# (1.04e-4, AMX). A Muon that amplified rounding further would otherwise widen its own bound.
MAX_FLOOR = 1e-3
# The 2-process final weights against 1 process's, per tensor, relative to its largest element: measured 1.8 % after
# 6 steps of bf16 Newton-Schulz (AVX-512 kernels; AMX's noise is up to 7 times AVX-512's in the losses). A
# checkpoint holding one process's shard and zeros, or another tensor, differs by 100 %.
WHOLE_TENSOR_BOUND = 0.25
REGROUPED = (1, 4)  # micro-batch sizes of the noise-floor runs; the tiny config's is 2 rows, 8 per step


def reduction_order_floor(tmp_path: Path, base: dict, expected: dict[int, float]) -> float:
    """The largest relative loss difference, over steps, between the 1-process run `expected` of `base` and the same
    run with its global batch regrouped into micro-batches of each size in REGROUPED."""
    runs = []
    for micro in REGROUPED:
        out = tmp_path / f"regrouped-{micro}"
        config = {**base, "batch": {**base["batch"], "micro": micro}, "out": str(out)}
        (tmp_path / f"regrouped-{micro}.yaml").write_text(yaml.safe_dump(config))
        runs.append((out, spawn_recurfit("train", str(tmp_path / f"regrouped-{micro}.yaml"), stderr=subprocess.PIPE)))
    floor = 0.0
    for out, process in runs:
        assert process.wait(HANG) == 0, process.stderr.read().decode()[-2000:]
        losses = train_losses(out)
        assert list(losses) == list(expected)
        floor = max(floor, *(abs(losses[step] - loss) / loss for step, loss in expected.items()))
    assert floor <= MAX_FLOOR, f"regrouping alone changes the losses by {floor:.2e} (relative), over {MAX_FLOOR}"
    return floor


def two_processes_against_one(tmp_path, workspace, optimizer: dict) -> tuple[dict, dict, dict]:
    """Per-step training losses of 1 process and of 2 DDP processes, 6 steps of the same global batch, and the
    config they ran."""
    base = tiny_config(workspace, tmp_path / "x", steps=6, checkpoint={"every": 0, "keep": 1}, optimizer=optimizer)
    one_and_two_processes(tmp_path, base, {})
    expected, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert list(got) == list(range(1, 7))
    return expected, got, base


@pytest.mark.two_processes
def test_fsdp2_with_a_depth_per_micro_batch_trains_as_one_process(tmp_path, workspace):
    """Every paper recipe draws (n, k) per micro-batch; with each process's own draws (`depth.across_processes:
    own`) the two processes run their cores a different number of times in the same step, and under FSDP2 they must
    still issue the same collectives (they hung before)."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 1}
    depth = {"mean_recurrence": 4, "backprop_depth": 2, "draw": "micro_batch"}
    base = tiny_config(
        workspace, tmp_path / "x", steps=3, optimizer=optimizer, depth=depth, batch={"micro": 1, "global": 4}
    )
    base["checkpoint"] = {"every": 0, "keep": 1}
    depth = {**depth, "across_processes": "own"}
    one_and_two_processes(tmp_path, base, {"distributed": "fsdp", "depth": depth}, timeout=HANG)
    logs = {name: [r for r in read_log(tmp_path / name) if r["kind"] == "train"] for name in ("one", "two")}
    # the draws differ between the micro-batches the two processes run at the same time
    assert any(len({tuple(d) for d in record["depths"]}) > 1 for record in logs["two"])
    assert [r["depths"] for r in logs["two"]] == [r["depths"] for r in logs["one"]]
    expected, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert list(got) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)


@pytest.mark.two_processes
def test_fsdp2_collectives_do_not_grow_with_the_recurrence(fsdp_probe):
    """Every unit runs once per micro-batch whatever the depth: its collectives are the same at (1, 1) as at
    (6, 3), where one FSDP2 unit per core layer would gather each layer 9 times per forward."""
    _, two = fsdp_probe
    micro_batches = 2  # per process and step
    for result in two:
        counts = result["collectives"]
        # one step with each process at its own depth: r = 1 on one, 32 on the other (it would hang otherwise)
        assert counts["1,1"] == counts["6,3"] == counts["uneven"]
        gathers, reductions = counts["1,1"]
        # units: the token embeddings (the tiny parent's head has its own weight), 2 prelude layers, the recurrent
        # body, the head (root). Each micro-batch reduce-scatters every unit's gradients; it gathers the embeddings
        # for their forward only (their backward reads the token ids), each prelude layer for its forward and again
        # for its backward, the body and the head once (kept from forward to backward).
        assert reductions == micro_batches * 5
        assert gathers == micro_batches * (1 + 2 * 2 + 1 + 1)
    assert two[0]["collectives"]["1,1"] == two[1]["collectives"]["1,1"]


@pytest.mark.two_processes
def test_fsdp2_by_layer_gathers_each_layer_at_each_use_and_the_processes_issue_the_same_collectives(
    tmp_path, workspace
):
    """`fsdp_units: layer`: every layer a unit, gathered for each use (forward and backward) and its gradients
    reduce-scattered once per micro-batch, so the gathers grow with the depth, identically on every process; no
    unit holds more than a layer."""
    settings = {"batch": {"micro": 2, "global": 8}, "distributed": "fsdp", "fsdp_units": "layer"}
    two = probe(tmp_path, workspace, "two", 2, **settings)
    micro_batches = 2  # per process and step
    assert all(two[0]["collectives"][f"{n},{k}"] == two[1]["collectives"][f"{n},{k}"] for n, k in DEPTHS)
    P, R, C = two[0]["collectives"]["shape"]
    for n, k in DEPTHS:
        uses = n + k  # of each core layer in a forward; k of them with gradient
        # the embeddings, prelude, core and coda layers, the body (adapter and final norm), the head; and one more:
        # FSDP2's backward prefetch follows the forward's order of units, in which the core's layers repeat, and
        # gathers a core layer once more after the core's backward
        gathers = 1 + 2 * P + (uses + k) * R + 2 * C + 1 + 1 + 1
        reductions = 1 + P + R + C + 1 + 1  # FSDP2 reduces a unit used several times once, after its last use
        assert two[0]["collectives"][f"{n},{k}"] == [micro_batches * gathers, micro_batches * reductions], (
            n,
            k,
            two[0]["collectives"],
        )
    assert "uneven" not in two[0]["collectives"]


@pytest.mark.two_processes
def test_fsdp2_by_layer_trains_as_one_process(tmp_path, workspace):
    """The same numbers as one process (hence as DDP), at the tolerance of the other FSDP2 tests."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 1}
    base = tiny_config(workspace, tmp_path / "x", steps=3, optimizer=optimizer, batch={"micro": 1, "global": 4})
    base["checkpoint"] = {"every": 0, "keep": 1}
    one_and_two_processes(tmp_path, base, {"distributed": "fsdp", "fsdp_units": "layer"}, timeout=HANG)
    expected, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert list(got) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)


@pytest.mark.two_processes
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


@pytest.mark.two_processes
def test_uneven_validation_shares_pair_the_collectives_and_count_each_micro_batch_once(tmp_path, workspace):
    """3 micro-batches over 2 processes: under DDP one process runs 2 forwards, the other 1; under FSDP2, whose
    every forward gathers units, the second runs one more (its first micro-batch again) and discards it, so the
    record is DDP's: a discarded forward counted would move the mean."""
    records = {}
    for strategy in ("ddp", "fsdp"):
        settings = {"batch": {"micro": 3, "global": 6}, "distributed": strategy}
        results = probe(tmp_path, workspace, strategy, 2, **settings)
        forwards = sorted(r["validation"]["forwards"] for r in results)
        assert forwards == ([2 * 1, 2 * 2] if strategy == "ddp" else [2 * 2, 2 * 2])  # 2 stores
        assert results[0]["validation"]["record"] == results[1]["validation"]["record"]
        records[strategy] = results[0]["validation"]["record"]
    assert records["fsdp"].keys() == records["ddp"].keys()
    for key, value in records["ddp"].items():
        assert key == "kind" or records["fsdp"][key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.two_processes
def test_resume_hashes_each_file_of_the_checkpoint_once_the_processes_sharing_them(tmp_path, workspace):
    """A 1B model's checkpoint is ~12 GB: each file is hashed once, by one of the processes, which share them out
    (once the main process hashed them all while the others waited), and every process resumes at its step."""
    settings = {"steps": 2, "checkpoint": {"every": 1, "keep": 2}, "optimizer": {"name": "adamw", "warmup": 0}}
    config = tiny_config(workspace, tmp_path / "run", **settings)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert spawn_recurfit("train", str(tmp_path / "run.yaml")).wait(HANG) == 0
    main, other = probe(tmp_path, workspace, "run", 2, mode="resume", **settings)
    assert (main["hashed"], main["step"]) == (2, 2)  # the model's and trainer's files
    assert (other["hashed"], other["step"]) == (1, 2)  # the optimizer's


@pytest.mark.not_under_isa_caps("casts the weights it saves to bf16, and asserts their dtypes and sizes only")
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
    assert f"2 × {size / 1e3:.1f} kB" in capsys.readouterr().err


def test_bf16_autocast_keeps_the_cores_gradient_after_steps_without_it():
    """The n steps without gradient cast the core's and adapter's weights first; autocast's cache must not hand
    those gradient-less casts to the k steps with gradient (torch 2.9.1 did: the adapter got no gradient at all).

    Tolerance: the cached forward shares one bf16 cast of each weight between the k steps, so its gradient is summed in
    bf16 before it reaches the fp32 weight; the uncached one sums in fp32. bf16 keeps 8 bits (2⁻⁸ ≈ 4e-3 relative per
    rounding): 1.8e-3 measured on torch 2.9.1; on torch 2.13, 0 on an Intel Xeon with AMX and up to 1.87e-3 on an AMD
    EPYC with AVX512-BF16 (no AMX), natively and under ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2 (the bound 5.3x
    above)."""
    model = recurfit.retrofit(tiny_parent("llama", place=False), shape=(2, 2, 1), adapter_init="torch-default")
    model = model.to(PLACEMENT.device)  # fp32 master weights, as training holds them; the GPU check runs it on CUDA
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0)).to(PLACEMENT.device)
    cached, uncached = core_gradients(model, ids, True), core_gradients(model, ids, False)
    assert cached.keys() == uncached.keys() and any(name.startswith("model.adapter.") for name in cached)
    for name, grad in cached.items():
        assert grad is not None and grad.abs().sum() > 0, f"{name} got no gradient"
        assert (grad - uncached[name]).norm() <= 1e-2 * uncached[name].norm(), name


@pytest.mark.two_processes
def test_fsdp2_shards_the_teacher_and_matches_one_process(tmp_path, workspace):
    """Distillation and depth supervision on 2 gloo processes under FSDP2 (student and teacher sharded) give
    the single process's losses (AdamW: no bf16 Newton-Schulz rounding to amplify)."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 2}
    base = tiny_config(workspace, tmp_path / "x", steps=4, checkpoint={"every": 0, "keep": 1}, optimizer=optimizer)
    base["model"]["adapter_init"] = "torch-default"
    base["distill"] = {"alpha": 0.4, "temperature": 1.7}
    base["depth"]["supervise"] = {"last": 2}
    one_and_two_processes(tmp_path, base, {"distributed": "fsdp"})
    expected, got = (
        [(r["loss"], r["ce"], r["kl"], r["ce_supervised"]) for r in read_log(tmp_path / name) if r["kind"] == "train"]
        for name in ("one", "two")
    )
    assert len(got) == 4
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


@pytest.mark.two_processes
def test_fsdp2_builds_the_teacher_on_the_meta_device_and_keeps_it_sharded(tmp_path, workspace):
    """Under FSDP2 only the main process loads the teacher (the other makes it on the meta device and receives its
    shards), every parameter is a shard again after the teacher's forward (its head, FSDP2's root, too: once it stayed
    gathered for the whole run), and the logits the loss reads from it are the unsharded teacher's. Float32 on both
    sides, the same weights (the gathers copy them exactly): equal to the bit on AVX-512 kernels; the bound leaves
    room for the one product that differs, the head's (a matmul against the gathered weight, against nn.Linear's),
    to round otherwise at float32's last bits on other kernels. Shards and zeros, or another teacher, differ at O(1)."""
    settings = {"distributed": "fsdp", "distill": {"alpha": 0.5}}
    results = probe(tmp_path, workspace, "teacher", 2, mode="teacher", **settings)
    assert [result["loads"] for result in results] == [1, 0]
    assert all(result["sharded"] for result in results)
    got = load_file(tmp_path / "teacher.json.safetensors")
    assert got["logits"].shape == got["unsharded"].shape == (2 * 16, got["logits"].shape[-1])
    torch.testing.assert_close(got["logits"], got["unsharded"], rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize(
    "settings",
    [
        {"distributed": "fsdp"},
        {"distributed": "fsdp", "fsdp_units": "layer"},
        {"distributed": "ddp", "depth.across_processes": "same"},
    ],
    ids=["fsdp-recurrence", "fsdp-layer", "ddp-same"],
)
def test_every_fsdp_run_draws_the_same_depths_on_every_process_each_drawn_as_one_process_draws_it(settings):
    """Under FSDP2 (either unit layout), and under DDP with `depth.across_processes: same`, each process's j-th
    micro-batch of a step runs the depth one process draws for its j-th (the sampler and its seeds unchanged, so a
    run's depths have the same distribution): no process waits at a micro-batch for another's deeper draw. Under
    DDP by default every micro-batch keeps its own draw, whatever the number of processes."""
    from recurfit.train.step_plan import depth_schedule, plan_step

    draws = {"depth.draw": "micro_batch", "depth.mean_recurrence": 8, "batch.micro": 2, "batch.global": 8}
    shared, _ = tiny_plan_model(**settings, **draws)
    own, _ = tiny_plan_model(**draws)
    schedule = depth_schedule(shared)
    drawn_apart = 0
    for step in range(40):
        one = [m.num_steps for m in plan_step(shared, schedule, step, 1, True).micro_batches]
        assert [m.num_steps for m in plan_step(own, schedule, step, 1, True).micro_batches] == one
        two = [m.num_steps for m in plan_step(shared, schedule, step, 2, True).micro_batches]
        assert two == one[:2] + one[:2]  # processes 0 and 1: 2 micro-batches each
        four = [m.num_steps for m in plan_step(shared, schedule, step, 4, True).micro_batches]
        assert four == one[:1] * 4
        assert [m.num_steps for m in plan_step(own, schedule, step, 2, True).micro_batches] == one
        drawn_apart += one[:2] != one[2:]
    assert drawn_apart > 20  # the negative control: one process's later micro-batches draw other depths


@pytest.mark.parametrize(
    "settings, problem",
    [
        (
            {
                "distributed": "fsdp",
                "fsdp_units": "layer",
                "depth.draw": "micro_batch",
                "depth.across_processes": "own",
            },
            "by layer, FSDP2's collectives follow the depth: use same or auto",
        ),
        ({"depth.across_processes": "same"}, "set depth.draw=micro_batch"),
    ],
)
def test_draws_across_processes_that_cannot_apply_are_refused(settings, problem):
    with pytest.raises(RecurfitError, match=problem):
        tiny_plan_model(**settings)


@pytest.mark.two_processes
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, workspace):
    expected, got, _ = two_processes_against_one(tmp_path, workspace, {"name": "adamw", "lr": 0.003, "warmup": 2})
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=DDP_TOLERANCE, abs=0)
    eval_one, eval_two = ([r for r in read_log(tmp_path / name) if r["kind"] == "eval"][-1] for name in ("one", "two"))
    assert eval_one.keys() == eval_two.keys() and "math/loss@4" in eval_one
    assert all(
        eval_two[key] == pytest.approx(value, rel=DDP_TOLERANCE, abs=0)
        for key, value in eval_one.items()
        if key != "kind"
    )


@pytest.mark.two_processes
@pytest.mark.parametrize("muon_dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_two_processes_match_one_under_muon(tmp_path, workspace, muon_dtype):
    # Muon's update is a function of the whole reduced gradient: DDP must all-reduce before it orthogonalises.
    expected, got, base = two_processes_against_one(
        tmp_path, workspace, {"name": "muon", "muon_lr": 0.02, "lr": 0.003, "warmup": 2, "muon_dtype": muon_dtype}
    )
    assert got[1] == expected[1]  # the first loss precedes any update
    bound = FLOOR_FACTOR * reduction_order_floor(tmp_path, base, expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=bound, abs=0)


@pytest.mark.two_processes
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "muon_fused"])
def test_fsdp2_with_gathered_muon_matches_one_process(tmp_path, workspace, fused):
    """FSDP2 shards every matrix over 2 gloo processes; Muon must still orthogonalise whole matrices
    (with `muon_fused`, whole [q; k; v] and [gate; up] concatenations).

    Orthogonalising each shard separately changes the update at O(1); the gathered update differs from the
    single-process one only by bf16 Newton-Schulz rounding of the reduced gradients (first step exact). bf16 on
    every CPU (auto picks it only where the CPU computes bf16 natively): its updates are scattered into buffers of
    the parameters' dtype."""
    base = tiny_config(workspace, tmp_path / "x", steps=6, checkpoint={"every": 3, "keep": 1})
    base["optimizer"] |= {"muon_fused": fused, "muon_dtype": "bfloat16"}
    one_and_two_processes(tmp_path, base, {"distributed": "fsdp"})
    expected, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert got[1] == expected[1] and list(got) == list(range(1, 7))
    bound = FLOOR_FACTOR * reduction_order_floor(tmp_path, base, expected)  # as for DDP (FLOOR_FACTOR's comment)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=bound, abs=0)
    # The sharded run's checkpoints hold whole tensors: they load in one process.
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("one", "two"))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    for name, whole in a.items():  # the same values as one process's, not one shard and zeros
        assert (b[name] - whole).abs().max() <= WHOLE_TENSOR_BOUND * whole.abs().max(), name


# DDP and FSDP2 in bf16 differ by the bf16 rounding of the embeddings and norms FSDP2 gathers in bf16 (docs/how-to/
# multi-gpu.md states the bound). Measured over 4 steps of the tiny config: at most 2.1e-4 relative (2.3e-4 with
# FSDP2's default policy, which casts the residual stream to bf16: at this size bf16 noise hides the difference
# in the loss, so the dtypes are asserted too). On an AMD EPYC with AVX512-BF16 (no AMX), natively and under
# ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2: at most 2.2e-4 (the bound 4.5x above).
FSDP_BF16_TOLERANCE = 1e-3


@pytest.mark.two_processes
def test_fsdp2_in_bf16_computes_in_the_precisions_of_ddp_with_autocast(tmp_path, workspace):
    settings = {"precision": "bf16", "optimizer": {"name": "adamw", "lr": 0.003, "warmup": 2}}
    ddp = probe(tmp_path, workspace, "ddp", 2, "numerics", **settings)
    fsdp = probe(tmp_path, workspace, "fsdp", 2, "numerics", distributed="fsdp", **settings)
    # The core receives the adapter's output: a linear's, bf16 under autocast in both.
    residual = {"prelude": "torch.float32", "adapter": "torch.float32", "core": "torch.bfloat16"}
    assert ddp[0]["dtypes"] == fsdp[0]["dtypes"] == residual
    for expected, got in zip(ddp[0]["losses"], fsdp[0]["losses"], strict=True):
        assert got == pytest.approx(expected, rel=FSDP_BF16_TOLERANCE, abs=0)


@pytest.mark.two_processes
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_processes_build_on_the_meta_device_with_the_weights_of_one(tmp_path, workspace, strategy):
    """Under torchrun only the main process builds the retrofit; the other makes it on the meta device and
    receives its shards (FSDP2) or the whole (DDP). The set-up weights equal one process's build bit for bit:
    the layers chosen, the drawn adapter, the untied head, the RoPE frequencies the forward uses."""
    from recurfit.train.initial_model import build_model
    from recurfit.train.parts import select_parts

    settings = {"distributed": strategy, "model__adapter_init": "torch-default", "model__untie_embeddings": True}
    probe(tmp_path, workspace, strategy, 2, mode="weights", **settings)
    got = load_file(tmp_path / f"{strategy}.json.safetensors")
    config = load_config(tmp_path / f"{strategy}.yaml")
    built = select_parts(build_model(config.model, config.depth, config.seed), config)
    expected = built.state_dict()
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    expected_buffers = dict(built.named_buffers())
    assert any(name.endswith("inv_freq") for name in expected_buffers)
    for rank in range(2):  # every process's, the one that built nothing included
        buffers = load_file(tmp_path / f"{strategy}.json.buffers.{rank}")
        assert buffers.keys() == expected_buffers.keys()
        assert all(torch.equal(buffers[name], expected_buffers[name]) for name in expected_buffers), rank


@pytest.mark.two_processes
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_closing_the_processes_ends_the_gloo_threads_before_the_interpreter_exits(tmp_path, workspace, strategy):
    """After 4 training steps, `Processes.close` destroys the group for real: its gloo threads are joined while
    the interpreter runs. A group left alive (a trainer not freed first, DTensor's caches holding FSDP2's mesh)
    keeps them into the interpreter's finalisation, where one that frees a tensor aborts the finished process."""
    results = probe(tmp_path, workspace, strategy, 2, "numerics", distributed=strategy)
    for result in results:
        assert not [name for name in result["threads_after_close"] if "gloo" in name], result["threads_after_close"]


@pytest.mark.two_processes
def test_fsdp2_muon_orthogonalises_each_matrix_on_one_process(fsdp_probe):
    """Sharded Muon deals the matrices out round robin: over the probe's 3 steps, the two processes together
    orthogonalise each unit once per step, each half of them (within one per step): none repeats another's work."""
    _, two = fsdp_probe
    units = two[0]["collectives"]["units"]
    done = [result["collectives"]["orthogonalised"] for result in two]
    steps = len(DEPTHS) + 1  # and the step at uneven depths
    assert sum(done) == steps * units and abs(done[0] - done[1]) <= steps


@pytest.mark.two_processes
def test_fsdp2_trains_the_head_alone_as_one_process(tmp_path, workspace):
    """`model.trainable: [head]` under FSDP2: the head's gradient is reduced and applied, so the head moves and the
    losses, gradient norms and final head are one process's. (The loss once read the head's weight off the module,
    outside the root unit's forward: no FSDP2 hook was in the loss's graph, the head's gradient was never reduced,
    and the 2-process run kept its first loss with a gradient norm of 0.)"""
    optimizer = {"name": "adamw", "lr": 0.01, "warmup": 1}
    base = tiny_config(workspace, tmp_path / "x", steps=3, checkpoint={"every": 0, "keep": 1}, optimizer=optimizer)
    base["model"]["trainable"] = ["head"]
    base["eval"] = {"every": 0, "steps": [1], "rows": 2}
    one, two = one_and_two_processes(tmp_path, base, {"distributed": "fsdp"}, timeout=HANG)
    expected, got = ([r for r in read_log(path) if r["kind"] == "train"] for path in (one, two))
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, expected, strict=True):
        assert a["grad_norm"] > 0
        # AdamW in float32: the all-reduce's rounding only (DDP_TOLERANCE's reasoning)
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-5, abs=1e-6)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(workspace / "parent").get_output_embeddings().weight.detach()
    heads = [load_file(path / "final" / "model.safetensors")["lm_head.weight"] for path in (one, two)]
    assert (heads[1] - start).abs().max() > 1e-3  # AdamW at lr 0.01 moves each weight by ~0.01 per step
    assert torch.allclose(heads[1], heads[0], rtol=1e-5, atol=1e-6)


# The processes end within this of each other, whatever distributed_timeout (left at its default, minutes): the
# others read the failed process's error within the store's polling interval (1 s) and exit at once, while the failed
# one finishes its own exit. Measured on 2 cores shared with other jobs: the other process ended 4 and 8 s before the
# failed one had exited. Without the error watch, a process waiting in a gloo collective for one that exited raises
# gloo's connection error (a traceback, status 1), and one waiting in NCCL waits out the timeout.
WITHIN_SECONDS = 15

FAILING_STEP = """
import sys
from recurfit.errors import RecurfitError
from recurfit.train import loop
real = loop.Trainer._micro_batch_loss
def failing(self, *args, **kwargs):
    if self.processes.rank == 1 and self.counters.step == 1:
        raise RecurfitError("process 1's second step failed (injected)")
    return real(self, *args, **kwargs)
loop.Trainer._micro_batch_loss = failing
from recurfit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def processes_without_agent(
    tmp_path: Path, config: dict, script: str | None = None, *flags: str
) -> list[tuple[int, str, float]]:
    """`recurfit train` of `config` with `flags` (or `script` with these arguments) in 2 processes launched as a
    cluster's scheduler launches them, with no torchrun agent to end the others when one fails (as across nodes): per
    process, its exit status, its stderr and the seconds it ran (None: still running after HANG seconds, killed)."""
    import socket
    import time

    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    command = ["-c", script] if script else ["-m", "recurfit"]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    started, running = time.monotonic(), []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", PYTHONPATH=str(REPO))
        argv = [sys.executable, *command, "train", str(tmp_path / "run.yaml"), *flags]
        running.append(subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True))
    ended = [None, None]
    while None in ended and time.monotonic() - started < HANG:
        for rank, process in enumerate(running):
            if ended[rank] is None and process.poll() is not None:
                ended[rank] = time.monotonic() - started
        time.sleep(0.1)
    for process in running:
        if process.poll() is None:
            process.kill()
    return [(p.wait(), p.stderr.read(), seconds) for p, seconds in zip(running, ended, strict=True)]


def assert_every_process_ends_with(results: list[tuple[int, str, float]], message: str) -> None:
    """Both processes exited with status 2 (a RecurfitError) within WITHIN_SECONDS of each other,
    each saying `message` on one line of its stderr, without a traceback."""
    for rank, (status, stderr, seconds) in enumerate(results):
        assert seconds is not None, f"process {rank} still ran after {HANG} s: {stderr[-2000:]}"
        assert status == 2, f"process {rank} exited with {status}: {stderr[-2000:]}"
        assert "Traceback" not in stderr and "Exception raised from" not in stderr, stderr[-3000:]  # Python's, c10's
        lines = [line for line in stderr.splitlines() if message in line]
        expected = "error: process 1 failed: " if rank == 0 else "error: "
        assert len(lines) == 1 and lines[0].startswith(expected), stderr[-2000:]
    assert abs(results[0][2] - results[1][2]) <= WITHIN_SECONDS


@pytest.mark.two_processes
def test_an_id_outside_the_vocabulary_in_one_processs_share_ends_every_process(tmp_path, workspace):
    """A store damaged in one row that only process 1's share of the first batch holds: process 1 fails at its
    check, before the step's collectives, and process 0, already waiting for it in FSDP2's first gather, ends too."""
    import numpy as np
    from transformers import AutoConfig

    from recurfit.data import Phase, RowStream, TokenStore

    damaged = tmp_path / "damaged"
    shutil.copytree(workspace / "prose", damaged)
    config = tiny_config(workspace, tmp_path / "run", steps=3, distributed="fsdp")
    config["data"] = {"phases": [{"sources": [str(damaged)]}], "validation": []}
    seed, store = load_config(None, [], base=config).seed, TokenStore(damaged)
    shares = [RowStream([Phase({str(damaged): 1.0})], seed=seed).next_batch(8, rank, 2).numpy() for rank in (0, 1)]
    rows = store[:]
    (row,) = np.flatnonzero((rows == shares[1][0]).all(axis=1))  # process 1's first row of step 1
    assert not (shares[0] == rows[row]).all(axis=1).any()  # not in process 0's share
    bad = AutoConfig.from_pretrained(workspace / "parent").vocab_size + 7
    width, offset = store.seq_len + 1, 0
    for path, tokens in store.files:  # a token of the row, in the file that holds it
        if row * width < offset + tokens:
            tokens_of_file = np.memmap(path, dtype=store.dtype, mode="r+")
            tokens_of_file[row * width - offset + 5] = bad
            tokens_of_file.flush()
            break
        offset += tokens
    results = processes_without_agent(tmp_path, config)
    assert_every_process_ends_with(results, f"holds token id {bad}, but the model's vocabulary has")


@pytest.mark.two_processes
def test_an_error_in_one_processs_step_ends_every_process(tmp_path, workspace):
    """Process 1 fails in its second step, while process 0 waits for it in FSDP2's collectives."""
    config = tiny_config(workspace, tmp_path / "run", steps=3, distributed="fsdp")
    config["eval"] = {"every": 0, "steps": [1], "rows": 2}
    results = processes_without_agent(tmp_path, config, FAILING_STEP)
    assert_every_process_ends_with(results, "process 1's second step failed (injected)")


STALE_VIEW = """
import os, sys
from recurfit.train import run_folder
if os.environ["RANK"] == "1":  # this node's view of the shared run folder is stale: it sees a final model
    run_folder.RunFolder.finished = property(lambda self: True)
from recurfit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.two_processes
def test_whether_a_run_is_finished_is_the_main_processs_answer(tmp_path, workspace):
    """`--resume` of a run that one process alone sees finished (a stale view of a shared folder): the processes
    train it, as the main process sees it. (Each process once asked the folder itself: the one that saw it finished
    exited before joining the group, and the other waited for it for distributed_timeout.)"""
    config = tiny_config(workspace, tmp_path / "run", steps=2, distributed="fsdp")
    config["eval"] = {"every": 0, "steps": [1], "rows": 2}
    results = processes_without_agent(tmp_path, config, STALE_VIEW, "--resume")
    for rank, (status, stderr, seconds) in enumerate(results):
        assert seconds is not None and status == 0, (rank, status, stderr[-2000:])
        assert "already finished" not in stderr
    assert list(train_losses(tmp_path / "run")) == [1, 2]


def fsdp2_against_one_process(tmp_path: Path, workspace: Path, units: str = "recurrence", **settings) -> None:
    """2 steps of `settings` on one process and on 2 under FSDP2 by `units`: the same losses, at the tolerance of
    the other FSDP2 tests (AdamW in float32: the reductions' rounding only)."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 1}
    base = tiny_config(workspace, tmp_path / "x", steps=2, optimizer=optimizer, batch={"micro": 1, "global": 4})
    base.update(checkpoint={"every": 0, "keep": 1}, eval={"every": 0, "steps": [1], "rows": 2}, **settings)
    one_and_two_processes(tmp_path, base, {"distributed": "fsdp", "fsdp_units": units}, timeout=HANG)
    expected, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert list(got) == [1, 2]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)


@pytest.mark.two_processes
@pytest.mark.parametrize("units", ["recurrence", "layer"])
def test_fsdp2_with_gradient_checkpointing_trains_as_one_process(tmp_path, workspace, units):
    """Each decoder layer recomputed in backward (both paper recipes turn it on): by layer, the recomputation runs a
    unit's forward again inside the backward."""
    model = {"path": str(workspace / "parent"), "shape": [2, 2, 2], "gradient_checkpointing": True}
    fsdp2_against_one_process(tmp_path, workspace, units, model=model)


@pytest.mark.two_processes
def test_fsdp2_with_compiled_layers_trains_as_one_process(tmp_path, workspace):
    """`compile: true` (each decoder layer compiled, here by the CPU's inductor) before FSDP2 shards them: the
    prelude layers are units, whose hooks then run inside the compiled call. One layer per part: compiling is the
    test's cost."""
    model = {"path": str(workspace / "parent"), "shape": [1, 1, 1]}
    fsdp2_against_one_process(tmp_path, workspace, compile=True, model=model)


@pytest.mark.two_processes
def test_fsdp2_trains_a_tied_recurrent_model_as_one_process(tmp_path, workspace):
    """A retrofit whose head is its token embeddings (kept tied): FSDP2 shards the shared matrix once, the tie
    holds through training, and the losses are one process's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recurfit import retrofit

    tied = retrofit(tiny_parent("llama", place=False, tie_word_embeddings=True), (2, 2, 2), untie_embeddings=False)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    tied.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(workspace / "parent").save_pretrained(tmp_path / "tied")
    fsdp2_against_one_process(tmp_path, workspace, model={"path": str(tmp_path / "tied")})
    for run in ("one", "two"):
        final = AutoModelForCausalLM.from_pretrained(tmp_path / run / "final")
        assert final.config.tie_word_embeddings
        assert final.get_output_embeddings().weight is final.get_input_embeddings().weight


def train_on(tmp_path: Path, config: dict, processes: int, *flags: str) -> dict[int, float]:
    """`recurfit train` of `config` under torchrun with `processes` processes; its log's losses by step."""
    path = tmp_path / f"{Path(config['out']).name}.yaml"
    path.write_text(yaml.safe_dump(config))
    torchrun = [*TORCHRUN[:-1], str(processes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [*torchrun, "-m", "recurfit", "train", str(path), *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr[-3000:]
    return train_losses(Path(config["out"]))


def stopped_at(run: Path, step: int, copy: Path) -> Path:
    """A copy of the finished `run` as it stood after checkpoint `step`: later checkpoints and the final model gone."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "final")
    for folder in (copy / "checkpoints").iterdir():
        if int(folder.name.removeprefix("step-")) > step:
            shutil.rmtree(folder)
    return copy


@pytest.mark.two_processes
def test_sharded_checkpoints_resume_exactly_and_on_other_numbers_of_processes(tmp_path, workspace):
    """Under torchrun each process writes its own shards of the model and optimizer (DCP: no process gathers them),
    and DCP reshards them on load: a run of 2 processes resumed on 2 logs its losses bit for bit, and resumed on
    4, then from the 4 processes' checkpoint on 2, or on 1 process, it continues as the run would have within the
    float rounding of another reduction order (AdamW in fp32: see DDP_TOLERANCE; FSDP2's reduce-scatters and one
    process's sums regroup the same additions)."""
    settings = {"steps": 6, "checkpoint": {"every": 2, "keep": 3}, "optimizer": {"name": "adamw", "warmup": 1}}
    config = {**tiny_config(workspace, tmp_path / "straight", **settings), "distributed": "fsdp"}
    straight = train_on(tmp_path, config, 2)
    assert list(straight) == [1, 2, 3, 4, 5, 6]
    checkpoint = tmp_path / "straight" / "checkpoints" / "step-000004"
    assert sorted(path.name for path in checkpoint.iterdir()) == ["sha256sums.txt", "state", "trainer.json"]
    assert sorted(path.name for path in (checkpoint / "state").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    def resumed(name: str, source: Path, step: int, processes: int) -> dict[int, float]:
        out = stopped_at(source, step, tmp_path / name)
        return train_on(tmp_path, {**config, "out": str(out)}, processes, "--resume")

    assert resumed("again", tmp_path / "straight", 4, 2) == straight  # same processes: exact
    for name, source, step, processes in (
        ("four", tmp_path / "straight", 2, 4),
        ("four-then-two", tmp_path / "four", 4, 2),
        ("one", tmp_path / "straight", 2, 1),
    ):
        losses = resumed(name, source, step, processes)
        assert list(losses) == list(straight)
        for step in range(3, 7):
            assert losses[step] == pytest.approx(straight[step], rel=1e-5), (name, step)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_fsdp_shard_size_defaults_to_a_nodes_processes_and_must_divide_them():
    from recurfit.train.distributed import fsdp_shard_size

    assert fsdp_shard_size(None, world=16, local_world=8) == 8  # two nodes: HSDP, sharded within each
    assert fsdp_shard_size(None, world=8, local_world=8) == 8  # one node: FSDP2 over every process
    assert fsdp_shard_size(2, world=8, local_world=8) == 2
    with pytest.raises(RecurfitError, match=r"fsdp_shard_size=3 does not divide the run's 8 processes"):
        fsdp_shard_size(3, world=8, local_world=8)
    with pytest.raises(RecurfitError, match="fsdp_shard_size=2 shards with FSDP2: set distributed=fsdp"):
        load_config(None, ["fsdp_shard_size=2"], base=tiny_config(Path("w"), Path("o")))


def hsdp_against_one_process(tmp_path: Path, workspace: Path, optimizer: dict, **settings) -> tuple[dict, dict, dict]:
    """3 steps of the tiny config with `optimizer` on one process and on 4 under HSDP as 2 copies of the model each
    sharded over 2 processes: per-step losses of each, and the config they ran."""
    base = tiny_config(workspace, tmp_path / "x", steps=3, optimizer=optimizer, **settings)
    base["eval"] = {"every": 0, "steps": [1], "rows": 2}
    (tmp_path / "one.yaml").write_text(yaml.safe_dump({**base, "out": str(tmp_path / "one")}))
    single = spawn_recurfit("train", str(tmp_path / "one.yaml"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    hsdp = {**base, "out": str(tmp_path / "hsdp"), "distributed": "fsdp", "fsdp_shard_size": 2}
    got = train_on(tmp_path, hsdp, 4)
    assert single.wait(HANG) == 0, single.stderr.read().decode()[-2000:]
    return train_losses(tmp_path / "one"), got, hsdp


# Without the all-reduce between the copies (each copy stepping on its own half of the batch), the losses of this
# test differ from one process's by 5e-4 at step 2 and 11 % at step 3: 50 times and more the bound.
@pytest.mark.two_processes
def test_hsdp_on_a_2x2_mesh_trains_as_one_process_and_resumes_from_its_sharded_checkpoints(tmp_path, workspace):
    """4 processes as 2 copies of the model, each sharded over 2 (`fsdp_shard_size: 2`), 2 micro-batches per process
    and step: each copy adds its reduce-scattered gradients up over the step and the copies all-reduce them once, so
    the losses are one process's (AdamW in float32: the reductions' rounding only, as the other FSDP2 tests). Its
    checkpoint resumes bit for bit on the same mesh, and on 2 processes sharding one copy (DCP reshards) as the run
    would have continued."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 1}
    settings = {"batch": {"micro": 1, "global": 8}, "checkpoint": {"every": 2, "keep": 1}}
    expected, got, hsdp = hsdp_against_one_process(tmp_path, workspace, optimizer, **settings)
    assert list(got) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)
    # the gradient norm (clipped by): DTensor's over the 2-D mesh, of the gradients averaged over all 4 processes
    norms = [[r["grad_norm"] for r in read_log(tmp_path / name) if r["kind"] == "train"] for name in ("one", "hsdp")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    again = stopped_at(tmp_path / "hsdp", 2, tmp_path / "again")
    assert train_on(tmp_path, {**hsdp, "out": str(again)}, 4, "--resume") == got
    two = stopped_at(tmp_path / "hsdp", 2, tmp_path / "two")
    resumed = train_on(tmp_path, {**hsdp, "out": str(two)}, 2, "--resume")
    assert list(resumed) == [1, 2, 3] and resumed[3] == pytest.approx(got[3], rel=1e-5)


@pytest.mark.two_processes
def test_hsdp_muon_orthogonalises_along_the_shard_dimension_as_one_process(tmp_path, workspace):
    """BatchedMuon on HSDP's 2-D mesh gathers, orthogonalises and scatters each matrix within its copy of the model,
    along the shard dimension: the losses are one process's within the noise floor of the other Muon tests."""
    optimizer = {"name": "muon", "muon_lr": 0.02, "lr": 0.003, "warmup": 1, "muon_dtype": "float32"}
    expected, got, hsdp = hsdp_against_one_process(tmp_path, workspace, optimizer, checkpoint={"every": 0, "keep": 1})
    assert got[1] == expected[1] and list(got) == [1, 2, 3]
    base = {key: value for key, value in hsdp.items() if key not in ("distributed", "fsdp_shard_size")}
    bound = FLOOR_FACTOR * reduction_order_floor(tmp_path, base, expected)  # as for DDP (FLOOR_FACTOR's comment)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=bound, abs=0)


@pytest.mark.two_processes
def test_a_damaged_shard_found_by_one_process_is_refused_on_every_process(tmp_path, workspace):
    """--resume of a sharded checkpoint whose shard only process 1 hashes has changed on disk: process 1 finds the
    mismatch, and every process refuses the checkpoint with the same one-line error naming the shard and the fix,
    without waiting for the others (none is older to fall back on)."""
    config = tiny_config(workspace, tmp_path / "run", steps=2, distributed="fsdp", checkpoint={"every": 2, "keep": 1})
    config["eval"] = {"every": 0, "steps": [1], "rows": 2}
    train_on(tmp_path, config, 2)
    stopped_at(tmp_path / "run", 2, tmp_path / "stopped")
    state = tmp_path / "stopped" / "checkpoints" / "step-000002" / "state"
    # sorted, the files are dealt in turn: state/.metadata to process 0, state/__0_0.distcp to process 1, ...
    shard = state / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    results = processes_without_agent(tmp_path, {**config, "out": str(tmp_path / "stopped")}, None, "--resume")
    for rank, (status, stderr, seconds) in enumerate(results):
        assert seconds is not None and status == 2, (rank, status, stderr[-2000:])
        assert "Traceback" not in stderr, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if "__0_0.distcp does not match its checksum" in line]
        assert len(lines) == 1 and "start the run over with --force" in lines[0], stderr[-2000:]
