"""The five-minute GPU check (benchmarks/gpu_check.py): its plan fits five minutes, and its CPU smoke runs every
step at toy sizes with the packages the device machine lacks hidden, so that it runs the first time a GPU is lent."""

from __future__ import annotations

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
STEPS = ["device", "correctness", "decode", "train", "sweep", "vllm"]


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
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    for folder in ("out", "work"):
        (tmp_path / folder).mkdir()
    step = gpu_check.Step("device", 0, "")  # no process finishes in no time
    status = gpu_check.run_step(step, 0, tmp_path / "out", tmp_path / "work", smoke=True)
    assert status == "timed out after 0 s"
    assert "===== device (limit 0 s)" in (tmp_path / "out" / "log.txt").read_text()


def test_compile_time_at_a_new_depth_is_predicted_from_how_it_grew_between_two_depths():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_check import predicted_compile
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    shape = (4, 8, 4)  # 16, 40 and 264 layers at r = 1, 4, 32
    assert predicted_compile({}, shape, 32) is None
    assert predicted_compile({4: 40.0}, shape, 4) == 40.0  # another batch size at the same r
    assert predicted_compile({4: 40.0}, shape, 32) == pytest.approx(40.0 * 264 / 40)  # by the layers
    assert predicted_compile({1: 16.0, 4: 40.0}, shape, 32) == pytest.approx(40.0 + 1.0 * (264 - 40))  # 1 s a layer
    # One recurrence step compiled and reused: r = 4 compiled nothing new, so r = 32 costs at most the first compile.
    assert predicted_compile({1: 30.0, 4: 0.5}, shape, 32) == 30.0


def test_decode_times_eagerly_the_keys_whose_predicted_compile_does_not_fit_the_time_left(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # The correctness step compiled r = 2 of the same model in 1 s; 5 s are left, less than the margin decoding needs.
    (out / "results.jsonl").write_text(json.dumps({"step": "correctness", "r": 2, "compile_s": 1.0}) + "\n")
    deadline = f"{time.time() + 5:.1f}"
    done = gpu_check(
        "--step", "decode", "--cpu-smoke", "--out", str(out), "--work", str(tmp_path), "--deadline", deadline
    )
    assert done.returncode == 0, done.stderr
    decode = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()][1:]
    assert [(r["batch"], r["r"]) for r in decode] == [(1, 2), (1, 4), (2, 4), (2, 2)]
    # r = 2 as measured; r = 4 scaled by the layers of the (1, 2, 1) step: (1 + 4·2 + 1) / (1 + 2·2 + 1)
    assert [r["predicted_compile_s"] for r in decode] == pytest.approx([1.0, 10 / 6, 10 / 6, 1.0])
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

    # The sweep's keys past dynamo's recompile limit fail while every compiled step shares one code object's
    # budget; they must still be tried and reported, one line each, and nothing else may fail.
    sweep = lines["sweep"]
    assert len(sweep) == 14 and [r["key"] for r in sweep[2:]][0] == "key 1 (batch 1, r = 1)"
    assert all(r["ok"] for r in sweep[:10]), sweep  # two warm-start prompt lengths, then the keys within the limit
    assert all(r["ok"] or "FailOnRecompileLimitHit" in r["error"] for r in sweep), sweep
    expected = {step: "ok" for step in STEPS}
    if not all(r["ok"] for r in sweep):
        expected["sweep"] = "failed (exit 1)"
    assert status == expected, log
    assert done.returncode == (0 if expected["sweep"] == "ok" else 1)

    (device,) = lines["device"]  # hidden as on the device machine
    assert {"datasets", "gguf", "lm_eval", "math_verify"} <= set(device["missing"])
    assert device["bf16_tflops"] > 0 and device["bandwidth_gbs"] > 0
    correctness = {r["r"]: r for r in lines["correctness"]}
    assert sorted(correctness) == [1, 2, 4]
    for record in correctness.values():  # the smoke runs in fp32: eager and compiled match the reference
        assert record["eager_vs_fp32"]["agreement"] == 1.0 and record["eager_vs_fp32"]["max_logit_error"] == 0
        assert record["compile_s"] is not None and record["compiled_vs_eager"]["agreement"] == 1.0
        assert record["compiled_vs_fp32"]["max_logit_error"] < 1e-4
    decode = lines["decode"]
    assert [(r["batch"], r["r"]) for r in decode] == [(1, 2), (1, 4), (2, 4), (2, 2)]
    assert all(r["same_tokens"] and math.isfinite(r["compiled_tokens_s"]) and r["floor_ms"] > 0 for r in decode)
    (train,) = lines["train"]
    assert train["micro"] == 2 and train["tokens_s"] > 0 and train["plan_bytes"] > 0 and train["peak_bytes"] is None
    (vllm,) = lines["vllm"][:1]
    assert "vLLM" in vllm["text"]
