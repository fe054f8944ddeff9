"""model.continue_schedule: a run stopped early (`stop_at`) and a run continuing it are one run: the same rows in
the same order, the same LRs, curricula and depth draws, and the same counters, as one run of all the steps."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from test_train import tiny_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from recurfit.data import RowStream
from recurfit.errors import RecurfitError
from recurfit.train import Trainer, load_config, train
from recurfit.train.checkpoint import newest_readable
from recurfit.train.metrics import read_log

STEPS, STOP = 8, 3  # the tiny config's first data phase ends at step 4, its warmup at 2, its depth ramp at 4
# What each step's log record says of the schedule and the counters: all equal in the one run and the chain.
SCHEDULED = ("step", "lr", "muon_lr", "n", "k", "mean_recurrence", "backprop_depth", "tokens", "phase")
COUNTED = ("flops", "flops_paper")


def config(workspace, out, *overrides):
    base = tiny_config(workspace, out, steps=STEPS, checkpoint={"every": 0, "keep": 1})
    return load_config(None, list(overrides), base=base)


def continuing(workspace, out, first, *overrides):
    chained = ["model.path=null", "model.shape=null", f"model.init_from={first}", "model.continue_schedule=true"]
    return config(workspace, out, *chained, *overrides)


@pytest.fixture
def rows_read(monkeypatch):
    """The rows each training step reads, as (stream position, hash of the rows), in order."""
    read = []
    next_batch = RowStream.next_batch

    def spy(self, *args):
        position = self.position
        rows = next_batch(self, *args)
        read.append((position, hashlib.sha256(rows.numpy().tobytes()).hexdigest()))
        return rows

    monkeypatch.setattr(RowStream, "next_batch", spy)
    return read


def trained_steps(out) -> list[dict]:
    return [r for r in read_log(out) if r["kind"] == "train"]


def training_record(out) -> dict:
    return json.loads((out / "final" / "training.json").read_text())


def test_a_stopped_run_and_its_continuation_are_one_run(tmp_path, workspace, rows_read):
    train(config(workspace, tmp_path / "one"))
    whole = list(rows_read)
    rows_read.clear()
    first, second = tmp_path / "adapter", tmp_path / "all"
    train(config(workspace, first, f"stop_at={STOP}", "model.trainable=[adapter]"))
    checkpoint = newest_readable(first / "checkpoints")
    assert checkpoint.step == STOP == training_record(first)["step"]
    trainer = Trainer(continuing(workspace, tmp_path / "inspected", first))
    # The step count, data position and LR are where the first run stopped, as in the one run after STOP steps.
    assert trainer.counters.step == STOP and trainer.stream.position == checkpoint.trainer["stream"]["position"]
    one = trained_steps(tmp_path / "one")
    assert [s.get_last_lr()[0] for s in trainer.schedulers] == [one[STOP]["muon_lr"], one[STOP]["lr"]]
    # Optimizer state: the adapter's moments (trained in both) carry over, every part new here starts afresh.
    muon, adamw = trainer.optimizers
    full = StateDictOptions(full_state_dict=True)
    carried = get_optimizer_state_dict(trainer.model, muon, options=full)["state"]
    saved = checkpoint.optimizer["optimizers"][0]["state"]
    assert set(carried) == set(saved) and saved and all(name.startswith("model.adapter") for name in saved)
    for name, values in saved.items():
        assert all(torch.equal(carried[name][key], value) for key, value in values.items())
    assert not adamw.state and len(muon.param_groups[0]["params"]) > len(saved)
    trainer.close()
    train(continuing(workspace, second, first))

    # The same rows in the same order, and every step's LRs, depths, phase and counters the one run's.
    assert rows_read == whole and len(whole) == STEPS
    chain = trained_steps(first) + trained_steps(second)
    assert [r["step"] for r in chain] == list(range(1, STEPS + 1))
    for key in SCHEDULED:
        assert [r[key] for r in chain] == [r[key] for r in one], key
    for key in COUNTED:
        assert [r[key] for r in chain] == pytest.approx([r[key] for r in one], rel=1e-12), key
    # FLOPs are counted once: the continued run's counters hold the first run's; `earlier` names it, adds nothing.
    record, alone = training_record(second), training_record(tmp_path / "one")
    assert (record["step"], record["tokens"]) == (alone["step"], alone["tokens"]) == (STEPS, chain[-1]["tokens"])
    assert record["flops_paper"] == pytest.approx(alone["flops_paper"], rel=1e-12)
    assert record["earlier"] == {
        "runs": ["adapter"],
        "tokens": 0,
        "flops": 0,
        "flops_paper": 0,
        "flops_teacher": 0,
        "continued": "adapter",
    }


def test_an_inconsistent_continuation_is_a_one_line_error(tmp_path, workspace):
    first = tmp_path / "first"
    train(config(workspace, first, f"stop_at={STOP}", "model.trainable=[adapter]"))
    cases = [
        (["steps=10"], r"give the same steps \(8 there, 10 here\) \(steps is the length of the whole schedule"),
        (["optimizer.warmup=3"], r"give the same optimizer.warmup \(2.0 there, 3.0 here\)"),
        (["seed=1"], r"give the same seed \(0 there, 1 here\)"),
        ([f"stop_at={STOP}"], rf"already ran to step {STOP} of its {STEPS}-step schedule"),
        (["optimizer.name=adamw"], "give the same optimizer.name"),
        (["optimizer.name=adamw", "lora.rank=4", "lora.parts=[core]"], "LoRA's .* cannot be continued"),
    ]
    for number, (overrides, message) in enumerate(cases):
        with pytest.raises(RecurfitError, match=message) as error:
            Trainer(continuing(workspace, tmp_path / f"bad{number}", first, *overrides))
        assert "\n" not in str(error.value)
    whole = tmp_path / "whole"
    train(config(workspace, whole, "steps=2"))
    with pytest.raises(RecurfitError, match=r"already ran to step 2 of its 2-step schedule"):
        Trainer(continuing(workspace, tmp_path / "after-whole", whole, "steps=2"))
    shutil.rmtree(first / "checkpoints")
    with pytest.raises(RecurfitError, match="model.continue_schedule: .* has no checkpoint to carry the state from"):
        Trainer(continuing(workspace, tmp_path / "no-checkpoint", first))
    with pytest.raises(RecurfitError, match=r"stop_at must be a step from 1 to steps \(8\), got 9"):
        config(workspace, tmp_path / "x", "stop_at=9")
    with pytest.raises(RecurfitError, match="model.continue_schedule continues a run: set model.init_from"):
        config(workspace, tmp_path / "x", "model.continue_schedule=true")


def test_a_continued_run_resumes_exactly(tmp_path, workspace):
    first = tmp_path / "first"
    train(config(workspace, first, f"stop_at={STOP}", "model.trainable=[adapter]"))
    whole = train(continuing(workspace, tmp_path / "whole", first))
    cut = continuing(workspace, tmp_path / "cut", first)
    trainer = Trainer(cut)
    trainer.train_step(), trainer.train_step()
    trainer.checkpoint()
    trainer.close()
    resumed = train(cut, resume=True)
    assert resumed.counters.step == STEPS and resumed.losses == whole.losses[2:]
    lrs = {r["step"]: r["lr"] for r in trained_steps(tmp_path / "whole")}
    assert {r["step"]: r["lr"] for r in trained_steps(tmp_path / "cut")} == {
        s: lrs[s] for s in range(STOP + 3, STEPS + 1)
    }
    assert training_record(tmp_path / "cut")["earlier"] == training_record(tmp_path / "whole")["earlier"]
