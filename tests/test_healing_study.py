"""The healing study's script end to end on a tiny parent: every arm trains, is evaluated over training, and
the report compares them (the real study runs the same code on the embedded SmolLM2: docs/results/healing.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_config

from recurfit.evaluate.over_training import RunEvaluation
from recurfit.train.metrics import read_log

REPO = Path(__file__).resolve().parents[1]


def study():
    spec = importlib.util.spec_from_file_location("healing_study", REPO / "scripts" / "healing_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def rows_read(monkeypatch):
    """{run folder name: [(step, stream position, hash of the rows), …]}: what each training step read, in order."""
    from recurfit.data import RowStream
    from recurfit.train.loop import Trainer

    read, running = {}, []
    next_rows, train_step = RowStream.next_rows, Trainer.train_step

    def reading(self, *args):
        position, (rows, masks) = self.position, next_rows(self, *args)
        read.setdefault(running[-1].out.name, []).append(
            (running[-1].counters.step + 1, position, hashlib.sha256(rows.numpy().tobytes()).hexdigest())
        )
        return rows, masks

    def stepping(self):
        running.append(self)
        try:
            return train_step(self)
        finally:
            running.pop()

    monkeypatch.setattr(RowStream, "next_rows", reading)
    monkeypatch.setattr(Trainer, "train_step", stepping)
    return read


def test_every_arm_trains_is_evaluated_and_reported(workspace, tmp_path, rows_read):
    healing = study()
    config = tiny_config(workspace, tmp_path / "unused")
    config["log"] = {"progress": False}
    config["checkpoint"] = {"every": 0, "keep": 1}
    config["optimizer"]["warmup"] = 0.1  # a fraction: the adapter-only quarter of 8 steps is 2 steps
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    out = tmp_path / "study"
    arms = list(healing.ARMS)  # every arm, in the study's order
    argv = ["--recipe", recipe, "--out", out, "--arms", ",".join(arms), "--seeds", "0,1", "--steps", "8"]
    argv = [str(a) for a in [*argv, "--snapshot-every", "4", "--rows", "4", "--baseline", workspace / "parent"]]
    healing.main(argv)

    results = json.loads((out / "results.json").read_text())
    assert list(results) == arms and {arm: set(by_seed) for arm, by_seed in results.items()} == dict.fromkeys(
        arms, {"0", "1"}
    )
    plain, distilled = results["ce-identity"]["0"], results["distill"]["0"]
    # Distillation's teacher forwards count: 2·N(parent) per token more than the same retrofit's training.
    assert distilled["flops"] > plain["flops"]
    recurrent = [arm for arm in arms if not arm.startswith("parent")]
    for arm in recurrent:
        row = results[arm]["0"]
        assert 2 <= row["mean_depth"] <= 16 and set(row["prose_by_r"]) == {"1", "2", "4", "8", "16", "32"}
        # The exit depth through the cache of generation, and teacher-forced on the same tokens.
        assert 0 < row["tokens"] <= healing.PROMPTS * (healing.NEW_TOKENS - 1)
        for key in ("mean_depth_cached", "mean_depth_teacher_forced"):
            assert healing.EXIT_MIN_STEPS <= row[key] <= healing.EXIT_MAX, (arm, key)
        # The second seed's final model is evaluated at the training mean only: it gives the seed spread.
        assert "prose_by_r" not in results[arm]["1"] and "mean_depth_cached" not in results[arm]["1"]
        second = RunEvaluation.load(out / "eval" / f"{arm}-s1-prose").final
        assert [r.steps for r in second.rows] == [config["depth"]["mean_recurrence"]]
    for arm in ("parent", "parent-5x", "parent-adamw"):
        assert "mean_depth" not in results[arm]["0"] and "mean_depth_cached" not in results[arm]["0"]
    # Every arm starts from the paper's rates, whatever the recipe says (its arms change only what they name); each
    # parent line is trained at its arms' rates.
    rates = {}
    for arm in arms:
        settings = yaml.safe_load((out / "runs" / f"{arm}-s1" / "config.yaml").read_text())
        rates[arm] = (settings["optimizer"]["name"], settings["optimizer"]["muon_lr"], settings["optimizer"]["lr"])
    assert (
        rates["distill"] == ("muon", 1e-3, 5e-5) != ("muon", config["optimizer"]["muon_lr"], config["optimizer"]["lr"])
    )
    assert rates["ce-muon-5x"] == rates["parent-5x"] == ("muon", 5e-3, 2.5e-4)
    assert rates["ce-adamw"][::2] == rates["lora"][::2] == rates["parent-adamw"][::2] == ("adamw", 5e-4)
    for arm in arms:
        assert rates[arm] == rates[healing.parent_line(arm)], arm
    # Depth supervision runs from the paper's random adapter start, where the supervised readouts differ.
    settings = yaml.safe_load((out / "runs" / "depth-supervision-torch-default-s0" / "config.yaml").read_text())
    assert (
        settings["model"]["adapter_init"] == "torch-default"
        and settings["depth"]["supervise"]["weighting"] == "uniform"
    )
    for seed in ("0", "1"):
        assert abs(results["depth-supervision-torch-default"][seed]["supervised_minus_final_ce"]) > 1e-4
    # The chained arm: an adapter-only run, then everything from its final model, continuing its schedule.
    first = out / "runs" / "adapter-then-all-s0-adapter"
    assert (first / "final").is_dir() and (out / "runs" / "adapter-then-all-s0" / "final").is_dir()
    # Every arm reads the same rows in the same order, step by step: the chained arm's two runs together too.
    for seed in (0, 1):
        reference = rows_read[f"ce-identity-s{seed}"]
        assert [step for step, *_ in reference] == list(range(1, 9))
        chain = rows_read[f"adapter-then-all-s{seed}-adapter"] + rows_read[f"adapter-then-all-s{seed}"]
        assert len(rows_read[f"adapter-then-all-s{seed}-adapter"]) == 2 and chain == reference
        for arm in set(arms) - {"adapter-then-all"}:
            assert rows_read[f"{arm}-s{seed}"] == reference, arm
    assert rows_read["ce-identity-s0"] != rows_read["ce-identity-s1"]  # the seed sets the data order
    # Its compute and time count once each: the second run's counters go on from the first's.
    chained, alone = results["adapter-then-all"]["0"], results["ce-identity"]["0"]
    assert chained["flops"] == pytest.approx(alone["flops"], rel=1e-12)
    logs = [read_log(out / "runs" / name) for name in ("adapter-then-all-s0-adapter", "adapter-then-all-s0")]
    assert chained["seconds"] == pytest.approx(sum(r["seconds"] for log in logs for r in log if r["kind"] == "train"))
    # Evaluated runs keep final/ only (the evaluations hold their snapshots' numbers).
    for folder in (out / "runs").iterdir():
        assert (folder / "final").is_dir() and not (folder / "snapshots").exists(), folder
        assert not (folder / "checkpoints").exists(), folder
    assert len(RunEvaluation.load(out / "eval" / "ce-identity-s0-math").sweeps) == 3  # steps 0, 4, 8
    report = (out / "report.md").read_text()
    assert "| distill † | 0,1 | parent |" in report and "| ce-muon-5x † | 0,1 | parent-5x |" in report
    assert "gap closed" in report and "- math: distill against ce-identity: no verdict (2 and 2 seeds)" in report
    for store in ("prose", "math"):
        assert (out / "figures" / store / "loss_over_training.png").is_file()
        assert (out / "figures" / f"{store}-by-r-without-random-adapter" / "loss_final.png").is_file()

    # Run again, it trains and measures nothing (every stage is done) and reports the same numbers.
    rows_read.clear()
    healing.main(argv)
    assert rows_read == {} and json.loads((out / "results.json").read_text()) == results


def synthetic(finals: list[float], start: float = 8.0, **extra) -> dict[int, dict]:
    """An arm's results over seeds 0, 1, …: the final math loss of each, the fresh retrofit's start loss."""
    return {
        seed: {"flops": 1e12, "math_final": final, "math_start": start, "math_parent": 2.0, **extra}
        for seed, final in enumerate(finals)
    }


def test_the_report_gives_verdicts_by_its_rule_and_gap_closed_against_each_rates_parent():
    healing = study()
    results = {
        "ce-identity": synthetic([5.3, 5.4, 5.5]),
        "ce-muon-5x": synthetic([4.0, 4.0, 4.0]),  # closes 80 % against parent-5x, 133 % against parent
        "parent": synthetic([5.0, 5.0, 5.0]),
        "parent-5x": synthetic([3.0, 3.0, 3.0]),
        "distill": synthetic([5.2, 5.3, 5.4]),  # −0.1 nats against a bound of 2·√(0.01/3 + 0.01/3) = 0.163
        "ce-adamw": synthetic([5.05, 5.15, 5.25]),  # −0.25 nats: beyond the bound
        "lora": synthetic([3.0, 3.1]),  # two seeds: labelled, no verdict
    }
    text = healing.report(results, ["math"], 1.0)
    assert "| ce-muon-5x | 0,1,2 | parent-5x | 1.0 | 4.000 ± 0.000 | 80 ± 0 % |" in text
    assert "| ce-identity | 0,1,2 | parent | 1.0 | 5.400 ± 0.100 | 87 ± 3 % |" in text
    assert "| parent | 0,1,2 | (itself) | 1.0 | 5.000 ± 0.000 | 100 ± 0 % |" in text
    assert "| lora † | 0,1 | parent-adamw |" in text  # its parent line was not run: no gap closed
    assert "- math: ce-muon-5x − ce-identity = -1.400 nats (bound 0.115): lower" in text
    assert "- math: distill − ce-identity = -0.100 nats (bound 0.163): no difference shown" in text
    assert "- math: ce-adamw − ce-identity = -0.250 nats (bound 0.163): lower" in text
    assert "- math: ce-adamw − ce-muon-5x = +1.150 nats (bound 0.115): higher" in text
    assert "- math: lora against ce-identity: no verdict (2 and 3 seeds)" in text
    assert "- math: lora against ce-adamw: no verdict (2 and 3 seeds)" in text
    # The rule, as the doc states it.
    assert "A differs from B when |mean_A − mean_B| > 2·√(s_A²/n_A + s_B²/n_B)" in text


def test_exit_depths_follow_the_kl_rule(workspace, tmp_path, monkeypatch):
    """The teacher-forced exit depth is where successive readouts first agree to the threshold."""
    import recurfit

    healing = study()
    parent = recurfit.model.loading.load_model(str(workspace / "parent"))
    model = recurfit.retrofit(parent, (2, 2, 2))  # [0 | I] adapter: every readout is the pruned parent's
    model.save_pretrained(tmp_path / "model")
    identical = healing.exit_depths(tmp_path / "model", str(workspace / "math"), rows=4)
    assert identical["mean_depth"] == healing.EXIT_MIN_STEPS  # KL = 0 at the first step it is checked
    assert identical["loss_at_exit"] == pytest.approx(identical["loss_full"], abs=1e-6)
    # Through generation's cache as well, and teacher-forced on the tokens it generated.
    cached = healing.cached_exit_depths(tmp_path / "model", str(workspace / "math"))
    assert cached["tokens"] == healing.PROMPTS * (healing.NEW_TOKENS - 1)  # the prompt's first token left out
    assert cached["mean_depth_cached"] == cached["mean_depth_teacher_forced"] == healing.EXIT_MIN_STEPS
    monkeypatch.setattr(healing, "EXIT_THRESHOLD", -1.0)  # never settles: every token runs all steps
    never = healing.exit_depths(tmp_path / "model", str(workspace / "math"), rows=4)
    assert never["mean_depth"] == healing.EXIT_MAX
    cached = healing.cached_exit_depths(tmp_path / "model", str(workspace / "math"))
    assert cached["mean_depth_cached"] == cached["mean_depth_teacher_forced"] == healing.EXIT_MAX
    assert torch.isfinite(torch.tensor(never["loss_full"]))


def test_a_restarting_chain_from_before_is_not_taken_as_done(tmp_path):
    """adapter-then-all runs trained when the second run restarted the schedule stop the study, naming the fix."""
    healing = study()
    first = tmp_path / "runs" / "adapter-then-all-s0-adapter"
    first.mkdir(parents=True)
    (first / "config.yaml").write_text(yaml.safe_dump({"steps": 5, "model": {"trainable": ["adapter"]}}))
    with pytest.raises(
        SystemExit, match="trained as a chain that restarts its schedule .*delete it and its evaluations"
    ):
        healing.train(Path("recipe.yaml"), tmp_path, "adapter-then-all", 0, 20, 5)
    (first / "config.yaml").write_text(yaml.safe_dump({"steps": 20, "stop_at": 5}))
    second = tmp_path / "runs" / "adapter-then-all-s0"
    second.mkdir()
    (second / "config.yaml").write_text(yaml.safe_dump({"steps": 15, "model": {"init_from": str(first)}}))
    with pytest.raises(SystemExit, match=r"model.continue_schedule: None, not True"):
        healing.train(Path("recipe.yaml"), tmp_path, "adapter-then-all", 0, 20, 5)
