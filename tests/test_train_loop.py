"""Tests of `recurfit/train/loop.py`."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    char_tokenizer,
    config_for,
    run_cli,
    small_run,
    tiny_config,
    tiny_parent,
    write_documents,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import AutoModelForCausalLM

import recurfit
import recurfit.train.loop
import recurfit.train.validation_loss
from recurfit.data import RowStream, TokenStore, prepare
from recurfit.errors import RecurfitError
from recurfit.model.accounting import paper_training_flops, training_flops_per_token
from recurfit.train import Trainer, load_config, train
from recurfit.train.checkpoint import newest_readable
from recurfit.train.head import final_hidden_states
from recurfit.train.metrics import read_log
from recurfit.train.step_plan import depth_schedule

# The largest |difference| of a final hidden state, relative to the largest |state|, between the validation's
# forward and the test's, over the same micro-batches. Two fp32 forwards: 0.0 measured (the same kernels on the same
# shapes); 1e-5 is ~170 float32 roundings (2**-24), room for other kernels' summation orders. An fp32 against a
# bf16 autocast forward: every bf16 matmul rounds its output to 8 significant bits (up to 2**-9 ≈ 2e-3 of it), and
# among thousands of elements some carry that rounding through the layers: 0.0122 measured natively on an AMD EPYC
# (AVX512-BF16, no AMX) and under ONEDNN_MAX_CPU_ISA=AVX512_CORE, 0.0133 under AVX2. 1e-3, half of one rounding of
# the largest element, is 12x below the smallest measured and 100x above the fp32 bound.
HIDDEN_FP32 = 1e-5
HIDDEN_BF16 = 1e-3
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
    next_rows = RowStream.next_rows

    def spy(self, *args):
        position = self.position
        rows, masks = next_rows(self, *args)
        read.append((position, hashlib.sha256(rows.numpy().tobytes()).hexdigest()))
        return rows, masks

    monkeypatch.setattr(RowStream, "next_rows", spy)
    return read


def trained_steps(out) -> list[dict]:
    return [r for r in read_log(out) if r["kind"] == "train"]


def training_record(out) -> dict:
    return json.loads((out / "final" / "training.json").read_text())


def _copy_store(workspace: Path, tmp_path: Path, edit) -> Path:
    store = tmp_path / "store"
    shutil.copytree(workspace / "prose", store)
    meta = json.loads((store / "meta.json").read_text())
    edit(store, meta)
    (store / "meta.json").write_text(json.dumps(meta))
    return store


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
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


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
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


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
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


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_a_runs_flops_paper_field_is_the_papers_accounting(tmp_path, workspace, rounding):
    config = small_run(workspace, tmp_path / "run", steps=5)
    config["depth"] = {"mean_recurrence": 4, "backprop_depth": 2, "curriculum": "linear", "curriculum_fraction": 0.6}
    config["depth"]["paper_ramp_rounding"] = rounding
    train(load_config(None, [], base=config))
    steps = [record for record in read_log(tmp_path / "run" / "log.jsonl") if record.get("kind") == "train"]
    counts = recurfit.count_parameters(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final"))
    tokens_per_step = steps[0]["tokens"]
    for record in steps:
        expected = paper_training_flops(
            counts,
            record["step"],
            tokens_per_step,
            total_steps=5,
            mean_recurrence=4,
            backprop_depth=2,
            curriculum="linear",
            curriculum_fraction=0.6,
            ramp_rounding=rounding,
        )
        assert record["flops_paper"] == expected
    # The two roundings give this ramp (3 steps to depth 4) different depths: the setting reached the count.
    other = paper_training_flops(
        counts,
        5,
        tokens_per_step,
        total_steps=5,
        mean_recurrence=4,
        backprop_depth=2,
        curriculum="linear",
        curriculum_fraction=0.6,
        ramp_rounding="ceil" if rounding == "floor" else "floor",
    )
    assert steps[-1]["flops_paper"] != other
    assert steps[-1]["flops_paper"] != steps[-1]["flops"]  # the drawn depths are the other measure


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_validation_in_fp32_as_the_authors_measured(tmp_path, workspace, monkeypatch):
    """A bf16 run's validation forward runs in fp32: the final hidden states its loss is read from are those of an
    fp32 forward, and far from those of a bf16 autocast one.

    The comparison is of the largest difference per element, not of the mean loss: the mean over ~500 tokens
    averages bf16's rounding errors, which cancel by chance (an AMD EPYC's bf16 loss was within 1.1e-5 of the fp32
    one), so no threshold on it separates the precisions on every CPU. See HIDDEN_FP32 and HIDDEN_BF16."""
    read = []
    real = recurfit.train.validation_loss.final_hidden_states
    monkeypatch.setattr(
        recurfit.train.validation_loss, "final_hidden_states", lambda *a, **k: read.append(real(*a, **k)) or read[-1]
    )
    config = small_run(workspace, tmp_path / "run", steps=2, precision="bf16")
    config["model"]["state_init_std"] = 0.0
    config["data"]["validation"] = [str(workspace / "prose")]
    config["eval"] = {"steps": [1, 3], "rows": 4, "precision": "fp32"}
    train(load_config(None, [], base=config))
    record = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r.get("kind") == "eval"][-1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32).eval()
    rows = torch.from_numpy(TokenStore(workspace / "prose", "val")[:4].astype("int64"))
    chunks = rows.split(config["batch"]["micro"])
    # the last validation's, by depth
    validated = [torch.cat(depth) for depth in zip(*(r.hidden for r in read[-len(chunks) :]))]

    def hidden(autocast: bool) -> list[torch.Tensor]:  # by depth, the micro-batches' states concatenated
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            each = [
                final_hidden_states(model, model, c[:, :-1], num_steps=(0, 3), readout_steps=[1]).hidden for c in chunks
            ]
        return [torch.cat(depth) for depth in zip(*each)]

    def largest_difference(states: list[torch.Tensor]) -> float:
        return max((a.float() - b).abs().max().item() / b.abs().max().item() for a, b in zip(states, validated))

    assert largest_difference(hidden(autocast=False)) <= HIDDEN_FP32
    assert largest_difference(hidden(autocast=True)) >= HIDDEN_BF16  # a bf16 validation would fail the line above
    for r in (1, 3):
        loss = torch.nn.functional.cross_entropy(
            model(rows[:, :-1], num_steps=r).logits.flatten(0, 1), rows[:, 1:].flatten()
        ).item()
        assert record[f"prose/loss@{r}"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_nonfinite_apply_updates_every_step_and_never_stops(tmp_path, workspace, monkeypatch):
    real = recurfit.train.loop.global_grad_norm

    def non_finite(*args, **kwargs):  # every step reports a NaN gradient norm
        return real(*args, **kwargs) * float("nan")

    monkeypatch.setattr(recurfit.train.loop, "global_grad_norm", non_finite)
    config = small_run(workspace, tmp_path / "apply", steps=3, max_bad_steps=1, nonfinite="apply")
    train(load_config(None, [], base=config))
    steps = [r for r in read_log(tmp_path / "apply" / "log.jsonl") if r.get("kind") == "train"]
    assert [r["skipped"] for r in steps] == [0, 0, 0]
    with pytest.raises(RecurfitError, match="non-finite losses or gradients in a row"):
        train(load_config(None, [], base=small_run(workspace, tmp_path / "skip", steps=3, max_bad_steps=1)))


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_one_depth_draw_per_micro_batch_as_the_authors_loop(tmp_path, workspace, monkeypatch):
    used = []
    real = recurfit.train.loop.Trainer._micro_batch_loss

    def spy(self, rows, num_steps, first_row, *rest):
        if self.model.training:
            used.append(num_steps)
        return real(self, rows, num_steps, first_row, *rest)

    monkeypatch.setattr(recurfit.train.loop.Trainer, "_micro_batch_loss", spy)
    config = small_run(workspace, tmp_path / "run", steps=3)
    config["depth"] = {"mean_recurrence": 6, "backprop_depth": 2, "draw": "micro_batch"}
    loaded = load_config(None, [], base=config)
    train(loaded)
    schedule = depth_schedule(loaded)
    micro, rows = loaded.batch.micro, loaded.batch.global_
    expected = [schedule.at(step, offset) for step in range(3) for offset in range(0, rows, micro)]
    assert used == expected and len(set(expected)) > 1
    steps = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r.get("kind") == "train"]
    assert [tuple(d) for r in steps for d in r["depths"]] == expected
    counts = recurfit.count_parameters(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final"))
    seq_len = steps[0]["tokens"] // rows
    flops = seq_len * micro * sum(training_flops_per_token(counts, depth) for depth in expected)
    assert steps[-1]["flops"] == flops
    assert load_config(None, [], base=small_run(workspace, tmp_path / "default")).depth.draw == "step"


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_bad_stores_are_refused_before_training(tmp_path, workspace):
    def no_training_rows(store, meta):
        meta["rows"]["train"] = meta["shards"][0]["tokens"]["train"] = 0
        (store / "shards" / "00000.train.bin").write_bytes(b"")

    def foreign_ids(store, meta):
        rows = np.fromfile(store / "shards" / "00000.train.bin", dtype=np.uint16)
        rows[33 * 5 + 7] = 200  # row 5 holds an id the 97-token model has no embedding for
        rows.tofile(store / "shards" / "00000.train.bin")

    for edit, message in (
        (no_training_rows, "has no training rows"),
        (foreign_ids, r"\(train row 5\) holds token id 200, but the model"),
        (lambda s, m: m.pop("rows"), r"meta.json: 'rows' is missing"),
        (lambda s, m: m.update(seq_len="32"), r"'seq_len' must be a whole number >= 1, got '32'"),
    ):
        store = _copy_store(workspace, tmp_path, edit)
        phases = [{"sources": [str(store)]}]
        with pytest.raises(RecurfitError, match=message):
            train(config_for(workspace, tmp_path / "run", "steps=8", data={"phases": phases, "validation": []}))
        shutil.rmtree(store)
        shutil.rmtree(tmp_path / "run", ignore_errors=True)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_run_that_reads_a_store_twice_warns_once_or_is_refused(tmp_path, workspace, capsys):
    rows = len(TokenStore(workspace / "prose"))
    steps = rows * 3 // 16  # 8 rows a step: about 1.5 passes over the store
    passes = f"({steps * 8 / rows:.2f} passes)"
    refused = load_config(None, [f"steps={steps}", "data.repeat=refuse"], base=small_run(workspace, tmp_path / "no"))
    with pytest.raises(RecurfitError, match=r"prose holds .* passes\), and data.repeat is refuse: prepare more"):
        Trainer(refused)
    Trainer(load_config(None, [f"steps={steps}"], base=small_run(workspace, tmp_path / "warned"))).close()
    said = " ".join(capsys.readouterr().err.split())
    assert said.count("warning: ") == 1 and f"{workspace / 'prose'} holds {rows * 32:,} training tokens" in said
    assert passes in said and "data.repeat=refuse stops such a run" in said


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_validation_stores_are_named_and_one_without_rows_is_refused(tmp_path, workspace, capsys):
    train(config_for(workspace, tmp_path / "run", "steps=2"))
    said = " ".join(capsys.readouterr().err.split())
    assert f"Validation: {workspace / 'prose'} (4 rows), {workspace / 'math'} (4 rows)." in said
    write_documents(tmp_path / "docs.jsonl", 60)
    prepare(
        char_tokenizer(), [str(tmp_path / "docs.jsonl")], 32, tmp_path / "no-val", val_fraction=0, show_progress=False
    )
    with pytest.raises(
        RecurfitError, match=r"no-val has no validation rows .*--val-fraction 0\).*drop it from data.validation"
    ):
        train(config_for(workspace, tmp_path / "other", "steps=2", f"data.validation=[{tmp_path / 'no-val'}]"))
    code, text = run_cli(
        capsys, "eval", "loss", workspace / "parent", "--data", tmp_path / "no-val", "--out", tmp_path / "e"
    )
    assert code == 2 and "no-val has no validation rows" in text and not (tmp_path / "e").exists()


@pytest.mark.not_under_isa_caps("names bfloat16 only as a value the log may hold; the tiny config's Muon is float32")
def test_tiny_run_learns_logs_and_exports(tmp_path, workspace):
    from transformers import AutoModelForCausalLM

    config = load_config(None, ["steps=30"], base=tiny_config(workspace, tmp_path / "run"))
    result = train(config)
    log = read_log(tmp_path / "run")
    steps = [r for r in log if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert log[0]["kind"] == "start" and log[0]["muon_dtype"] in ("bfloat16", "float32")
    assert all(0 < r["optimizer_s"] < r["seconds"] for r in steps)
    assert sum(r["loss"] for r in steps[-5:]) / 5 < steps[0]["loss"] - 1.0  # ~4.6 (uniform over 97) falls
    assert [r["phase"] for r in steps[:4]] == [0] * 4 and steps[-1]["phase"] == 1  # healing, then the mixture
    assert [r["mean_recurrence"] for r in steps[:15]] == sorted(r["mean_recurrence"] for r in steps[:15])
    assert steps[0]["mean_recurrence"] == 1 and steps[-1]["mean_recurrence"] == 4
    assert steps[-1]["tokens"] == 30 * 8 * 32 and steps[-1]["flops"] > 0 and steps[-1]["flops_paper"] > 0
    assert all(r["k"] <= min(2, r["mean_recurrence"]) for r in steps)
    evaluation = [r for r in log if r["kind"] == "eval"][-1]
    assert set(evaluation) >= {"prose/loss@1", "prose/loss@4", "math/loss@1", "math/loss@4"}
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == ["step-000028", "step-000030"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert model.config.model_type == "recurfit" and result.counters.step == 30


def test_flops_follow_the_drawn_depths(tmp_path, workspace):
    from recurfit.model.accounting import training_flops_per_token

    trainer = Trainer(load_config(None, ["steps=3"], base=tiny_config(workspace, tmp_path / "run")))
    trainer.run()
    records = [r for r in read_log(tmp_path / "run") if r["kind"] == "train"]
    expected = sum(8 * 32 * training_flops_per_token(trainer.parameter_counts, (r["n"], r["k"])) for r in records)
    assert records[-1]["flops"] == expected


def test_non_finite_losses_skip_the_update_then_stop(tmp_path, workspace, monkeypatch):
    config = load_config(
        None, ["steps=10", "max_bad_steps=3", "checkpoint.every=0"], base=tiny_config(workspace, tmp_path / "run")
    )
    trainer = Trainer(config)
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    real = trainer._micro_batch_loss
    monkeypatch.setattr(trainer, "_micro_batch_loss", lambda *a: real(*a) * float("nan"))
    for _ in range(2):
        assert not math.isfinite(trainer.train_step()["loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.counters.skipped == 2
    with pytest.raises(RecurfitError, match="3 non-finite losses or gradients in a row"):
        trainer.train_step()


def test_baselines_train_in_the_same_engine(tmp_path, workspace):
    parent = load_config(
        None, ["steps=6", "checkpoint.every=0", "model.shape=null"], base=tiny_config(workspace, tmp_path / "parent")
    )
    records = [r for r in (train(parent), read_log(tmp_path / "parent"))[1] if r["kind"] == "train"]
    assert records[-1]["loss"] < records[0]["loss"] and {(r["n"], r["k"]) for r in records} == {(0, 1)}
    random = load_config(
        None, ["steps=6", "checkpoint.every=0", "model.init=random"], base=tiny_config(workspace, tmp_path / "random")
    )
    train(random)
    first = [r for r in read_log(tmp_path / "random") if r["kind"] == "train"][0]
    assert first["loss"] == pytest.approx(math.log(97), abs=0.35)  # near-uniform: logit std ≈ 0.6 at h=64


def test_mismatched_vocabulary_and_existing_runs_are_refused(tmp_path, workspace):
    small = tiny_parent("llama", vocab_size=40, place=False)
    small.save_pretrained(tmp_path / "small")
    config = tiny_config(workspace, tmp_path / "run", model={"path": str(tmp_path / "small"), "shape": [2, 2, 2]})
    with pytest.raises(RecurfitError, match="46-token vocabulary .* larger than the model's 40"):
        Trainer(load_config(None, [], base=config))
    train(load_config(None, ["steps=3"], base=tiny_config(workspace, tmp_path / "done")))
    with pytest.raises(RecurfitError, match="already holds a finished run; pass --force"):
        Trainer(load_config(None, ["steps=3"], base=tiny_config(workspace, tmp_path / "done")))


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_validation_runs_every_n_steps_after_the_listed_steps_and_at_the_end(workspace, tmp_path):
    config = small_run(workspace, tmp_path / "run", steps=5)
    config["data"]["validation"] = [str(workspace / "prose")]
    config["eval"] = {"every": 2, "at": [1, 5], "steps": [1], "rows": 2}
    train(load_config(None, [], base=config))
    assert [r["step"] for r in read_log(tmp_path / "run") if r["kind"] == "eval"] == [1, 2, 4, 5]  # the end once
    for at in ("[0]", "[6]"):
        with pytest.raises(RecurfitError, match=r"eval.at must be optimizer steps from 1 to steps \(5\), got \["):
            load_config(None, [f"eval.at={at}"], base=config)


@pytest.mark.parametrize(
    "choice, device, compiled", [("auto", "cpu", False), ("auto", "cuda", True), (True, "cpu", True)]
)
def test_compile_auto_compiles_on_a_gpu_only_and_the_start_says_so(
    tmp_path, workspace, capsys, choice, device, compiled
):
    """`compile: auto` compiles the decoder layers where a compiled step pays (a GPU), runs eagerly on a CPU; the
    start record holds the choice and, for auto, the run's start line says which and why. A config that names
    true or false is obeyed anywhere."""
    from recurfit.train.loop import compiles_training

    assert compiles_training(choice, device) is compiled
    if device != "cpu":
        return
    setting = f"compile={str(choice).lower()}"
    config = load_config(None, ["steps=4", setting], base=tiny_config(workspace, tmp_path / "r"))
    assert config.compile == choice
    trainer = Trainer(config)
    layers = [m for m in trainer.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers) is compiled
    start = next(r for r in read_log(tmp_path / "r") if r["kind"] == "start")
    trainer.close()
    assert start["compiled"] is compiled
    if choice == "auto":
        assert "Decoder layers eager (auto: no GPU (cpu))." in capsys.readouterr().err
    with pytest.raises(RecurfitError, match="compile must be one of"):
        load_config(None, ["compile=sometimes"], base=tiny_config(workspace, tmp_path / "bad"))
