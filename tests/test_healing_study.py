"""The healing study's script end to end on a tiny parent: every arm trains, is evaluated over training, and
the report compares them (the real study runs the same code on the embedded SmolLM2: docs/healing.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_config

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
    next_batch, train_step = RowStream.next_batch, Trainer.train_step

    def reading(self, *args):
        position, rows = self.position, next_batch(self, *args)
        read.setdefault(running[-1].out.name, []).append(
            (running[-1].counters.step + 1, position, hashlib.sha256(rows.numpy().tobytes()).hexdigest())
        )
        return rows

    def stepping(self):
        running.append(self)
        try:
            return train_step(self)
        finally:
            running.pop()

    monkeypatch.setattr(RowStream, "next_batch", reading)
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
    arms = "ce-identity,distill,adapter-then-all,lora,depth-supervision,parent"
    argv = ["--recipe", recipe, "--out", out, "--arms", arms, "--seeds", "0,1", "--steps", "8"]
    healing.main([str(a) for a in [*argv, "--snapshot-every", "4", "--rows", "4", "--baseline", workspace / "parent"]])

    results = json.loads((out / "results.json").read_text())
    assert set(results) == set(arms.split(","))
    assert {arm: set(by_seed) for arm, by_seed in results.items()} == {
        arm: {"0"} if arm in healing.FIRST_SEED_ONLY else {"0", "1"} for arm in arms.split(",")
    }
    plain, distilled = results["ce-identity"]["0"], results["distill"]["0"]
    # Distillation's teacher forwards count: 2·N(parent) per token more than the same retrofit's training.
    assert distilled["flops"] > plain["flops"]
    for arm in ("ce-identity", "distill", "depth-supervision"):
        row = results[arm]["0"]
        assert 2 <= row["mean_depth"] <= 16 and set(row["prose_by_r"]) == {"1", "2", "4", "8", "16", "32"}
        # The second seed's final model is evaluated at the training mean only: it gives the seed spread.
        assert set(results[arm]["1"]["prose_by_r"]) == {str(config["depth"]["mean_recurrence"])}
    assert "mean_depth" not in results["parent"]["0"]
    # Every arm starts from the paper's rates, whatever the recipe says (its arms change only what they name).
    settings = yaml.safe_load((out / "runs" / "distill-s1" / "config.yaml").read_text())["optimizer"]
    assert (
        (settings["muon_lr"], settings["lr"])
        == (1e-3, 5e-5)
        != (config["optimizer"]["muon_lr"], config["optimizer"]["lr"])
    )
    # The chained arm: an adapter-only run, then everything from its final model, continuing its schedule.
    first = out / "runs" / "adapter-then-all-s0-adapter"
    assert (first / "final").is_dir() and (out / "runs" / "adapter-then-all-s0" / "final").is_dir()
    # Every arm reads the same rows in the same order, step by step: the chained arm's two runs together too.
    for seed in (0, 1):
        reference = rows_read[f"ce-identity-s{seed}"]
        assert [step for step, *_ in reference] == list(range(1, 9))
        chain = rows_read[f"adapter-then-all-s{seed}-adapter"] + rows_read[f"adapter-then-all-s{seed}"]
        assert len(rows_read[f"adapter-then-all-s{seed}-adapter"]) == 2 and chain == reference
        for arm in set(arms.split(",")) - {"adapter-then-all"}:
            if seed == 0 or arm not in healing.FIRST_SEED_ONLY:
                assert rows_read[f"{arm}-s{seed}"] == reference, arm
    assert rows_read["ce-identity-s0"] != rows_read["ce-identity-s1"]  # the seed sets the data order
    # Its compute and time count once each: the second run's counters go on from the first's.
    chained, alone = results["adapter-then-all"]["0"], results["ce-identity"]["0"]
    assert chained["flops"] == pytest.approx(alone["flops"], rel=1e-12)
    logs = [read_log(out / "runs" / name) for name in ("adapter-then-all-s0-adapter", "adapter-then-all-s0")]
    assert chained["seconds"] == pytest.approx(sum(r["seconds"] for log in logs for r in log if r["kind"] == "train"))
    report = (out / "report.md").read_text()
    assert "| distill | 0,1 |" in report and "gap closed" in report and "the seed spread" in report
    for store in ("prose", "math"):
        assert (out / "figures" / store / "loss_over_training.png").is_file()
        assert (out / "figures" / f"{store}-without-random-adapter" / "loss_final.png").is_file()


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
    monkeypatch.setattr(healing, "EXIT_THRESHOLD", -1.0)  # never settles: every token runs all steps
    never = healing.exit_depths(tmp_path / "model", str(workspace / "math"), rows=4)
    assert never["mean_depth"] == healing.EXIT_MAX
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
