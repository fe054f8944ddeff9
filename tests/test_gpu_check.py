"""The five-minute GPU check (benchmarks/gpu_check.py): its plan fits five minutes, and its CPU smoke runs every
step at toy sizes with the packages the device machine lacks hidden, so that it runs the first time a GPU is lent."""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
STEPS = ["device", "correctness", "decode", "train", "sweep"]


def gpu_check(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=REPO, capture_output=True, text=True)


def test_plan_lists_the_steps_in_order_and_their_limits_add_up_to_at_most_five_minutes():
    done = gpu_check("--plan")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    steps = [re.match(r"^(\d+)\. (\w+)\s+(\d+) s  \S", line) for line in lines]
    steps = [match.groups() for match in steps if match]
    assert [name for _, name, _ in steps] == STEPS
    assert [int(number) for number, _, _ in steps] == list(range(1, len(STEPS) + 1))
    total = re.fullmatch(r"total: (\d+) s", lines[-1])
    assert total, lines[-1]
    assert int(total.group(1)) == sum(int(seconds) for _, _, seconds in steps) <= 300


def test_without_a_gpu_or_an_output_folder_it_says_what_to_do(tmp_path):
    done = gpu_check("--out", str(tmp_path / "out"))  # CI's machines have no CUDA device
    assert done.returncode == 2 and "no CUDA device is visible" in done.stderr and "--cpu-smoke" in done.stderr
    assert not (tmp_path / "out").exists()
    done = gpu_check("--cpu-smoke")
    assert done.returncode == 2 and "--out is required" in done.stderr


def test_a_step_past_its_limit_is_killed_and_said_so(tmp_path):
    gpu_check = checker()
    for folder in ("out", "work"):
        (tmp_path / folder).mkdir()
    step = gpu_check.Step("device", 0, "")  # no process finishes in no time
    status = gpu_check.run_step(step, 0, tmp_path / "out", tmp_path / "work", smoke=True)
    assert status == "timed out after 0 s"
    assert "===== device (limit 0 s)" in (tmp_path / "out" / "log.txt").read_text()


@contextlib.contextmanager
def benchmarks_importable():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        yield
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def checker():
    with benchmarks_importable():
        import gpu_check
    return gpu_check


def test_a_new_depth_at_a_compiled_batch_size_is_predicted_to_compile_nothing():
    predicted_compile = checker().predicted_compile
    assert predicted_compile({}, 1) is None  # nothing to go by: compiled whatever it costs
    assert predicted_compile({1: 60.0}, 1) == 0.0  # another r at batch 1: the same graphs
    assert predicted_compile({1: 60.0}, 32) == 60.0  # the same graphs at another batch size
    assert predicted_compile({}, 32, earlier=[60.0, 2.0]) == 60.0  # compiled by an earlier step's process only


def test_the_plan_leaves_room_for_a_cold_compile_of_each_batch_size_at_r_4_and_32():
    """A cold compile of up to COLD_COMPILE_S (90 s): the correctness step compiles batch 1 at r = 1 and runs
    r = 4 and 32 on the same graphs; the decode step compiles batch 32 at r = 32 within its own limit (the
    correctness step may leave it nothing), then r = 4 on the same graphs. No key at r = 4 or 32 is predicted
    not to fit."""
    gpu_check = checker()
    limits = {step.name: step.seconds for step in gpu_check.STEPS}
    cold, startup, margin = gpu_check.COLD_COMPILE_S, gpu_check.STARTUP_S, gpu_check.DECODE_MARGIN_S
    assert cold >= 90
    assert gpu_check.predicted_compile({1: cold}, 1) == 0.0  # correctness at r = 4 and 32; batch 1's decode keys
    assert limits["correctness"] >= startup + cold + 2 * margin  # r = 1's compile, then the runs at r = 4, 32
    first = gpu_check.predicted_compile({}, 32, earlier=[cold])  # decode: batch 32 at r = 32
    assert first == cold and first < limits["decode"] - startup - margin
    assert gpu_check.predicted_compile({32: cold}, 32) == 0.0  # then r = 4
    with benchmarks_importable():  # the sizes name the train benchmark's TinyLlama
        full = gpu_check.full_sizes()
    assert {r for _, r in full.decode["keys"]} == {4, 32} and {b for b, _ in full.decode["keys"]} == {1, 32}
    assert full.check["batch"] == 1 and {4, 32} <= set(full.check["compiled"])
    assert sum(limits.values()) <= 300


def test_decode_times_eagerly_the_keys_whose_predicted_compile_does_not_fit_the_time_left(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # The correctness step compiled batch 1 in 1 s; 5 s are left, less than the margin decoding needs.
    record = {"step": "correctness", "batch": 1, "r": 2, "compile_s": 1.0}
    (out / "results.jsonl").write_text(json.dumps(record) + "\n")
    deadline = f"{time.time() + 5:.1f}"
    done = gpu_check(
        "--step", "decode", "--cpu-smoke", "--out", str(out), "--work", str(tmp_path), "--deadline", deadline
    )
    assert done.returncode == 0, done.stderr
    decode = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()][1:]
    # batch 1's keys are the correctness step's; batch 2's compile would take as long as batch 1's
    assert [(r["batch"], r["r"]) for r in decode] == [(2, 4), (2, 2)]
    assert [r["predicted_compile_s"] for r in decode] == [1.0, 1.0]
    assert all(r["compiled_tokens_s"] is None and "compiled: not run" in r["text"] for r in decode)
    assert all(math.isfinite(r["eager_tokens_s"]) for r in decode)  # the sign is noise's at 6 toy tokens


@pytest.mark.timeout(600)  # ~1 min on 2 idle cores; the steps' own limits are 3 × the GPU's
@pytest.mark.not_under_isa_caps("the smoke computes in float32; bf16 only times the device's peak, asserted > 0")
def test_cpu_smoke_runs_every_step_and_writes_a_line_for_each_result(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--cpu-smoke", "--out", str(out), "--work", str(tmp_path / "work"))
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    log = (out / "log.txt").read_text()
    status = {r["step"]: r["status"] for r in records if "status" in r and r["step"] != "run"}
    assert list(status) == STEPS, done.stdout + log
    lines = {step: [r for r in records if r["step"] == step and "status" not in r] for step in STEPS}
    summary = (out / "summary.md").read_text()
    assert all(r["text"] in summary for r in records if "text" in r)

    sweep = lines["sweep"]  # two warm-start prompt lengths, then r = 1-4 on the same graphs
    assert [r["key"] for r in sweep][1:3] == ["warm start, batch 2, r = 4, prompt 11", "batch 2, r = 1"]
    assert len(sweep) == 6 and all(r["ok"] and r["same_tokens"] for r in sweep), sweep
    assert [r["graphs"] for r in sweep][1:] == [0, 1, 0, 0, 0]  # the cold-start prelude at r = 1: one new trace
    assert status == {step: "ok" for step in STEPS}, log
    assert done.returncode == 0

    (device,) = lines["device"]  # hidden as on the device machine
    assert {"datasets", "gguf", "lm_eval", "math_verify"} <= set(device["missing"])
    assert device["bf16_tflops"] > 0 and device["bandwidth_gbs"] > 0
    correctness = {r["r"]: r for r in lines["correctness"]}
    assert sorted(correctness) == [1, 2, 4]
    for record in correctness.values():  # the smoke runs in fp32: eager and compiled match the reference
        assert record["eager_vs_fp32"]["agreement"] == 1.0 and record["eager_vs_fp32"]["max_logit_error"] == 0
        assert record["compile_s"] is not None and record["compiled_vs_eager"]["agreement"] == 1.0
        assert record["compiled_vs_fp32"]["max_logit_error"] < 1e-4
        # no CUDA graphs on the CPU: each of the 6 tokens runs without one, and the line says so
        assert record["graph_use"] == dict(ran=6, captured=0, replayed=0, failures={})
        assert "CUDA graphs: 0 captured, 0 token(s) replayed, 6 run without a graph" in record["text"]
    decode = lines["decode"]
    assert [(r["batch"], r["r"]) for r in decode] == [(1, 2), (1, 4), (2, 4), (2, 2)]
    assert all(r["same_tokens"] and math.isfinite(r["compiled_tokens_s"]) and r["floor_ms"] > 0 for r in decode)
    # batch 1's graphs were compiled in the correctness step's process; batch 2's compile is predicted from theirs
    compiled = max(r["compile_s"] for r in correctness.values())
    assert [r["predicted_compile_s"] for r in decode] == [0.0, 0.0, pytest.approx(compiled), 0.0]
    (train,) = lines["train"]
    assert train["micro"] == 2 and train["tokens_s"] > 0 and train["plan_bytes"] > 0 and train["peak_bytes"] is None
