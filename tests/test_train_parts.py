"""Training part of a model (`model.trainable`) and LoRA through PEFT (`lora:`): what is frozen stays bit-equal
and holds no optimizer state, what trains changes, resume is exact, and the exported model is merged."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    names_in_optimizers,
    one_and_two_processes,
    short,
    state_of,
    tiny_config,
    tiny_parent,
)
from safetensors.torch import load_file

from recurfit import retrofit
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_model
from recurfit.train import Trainer, load_config, train
from recurfit.train.checkpoint import checkpoint_folders
from recurfit.train.initial_model import check_plan
from recurfit.train.metrics import read_log
from recurfit.train.parts import part_modules, select_parts

pytestmark = pytest.mark.cpu_only("CPU runs of the tiny parent: what freezes does not depend on the device")


def part_of(name: str) -> str:
    for part in ("embed_tokens", "prelude", "adapter", "core", "coda", "norm", "lm_head"):
        if f"{part}." in name:
            return part
    raise AssertionError(name)


def trainer_name(trainer, parameter) -> str:
    return next(n for n, p in trainer.model.named_parameters() if p is parameter)


def test_bad_part_names_are_one_line_errors_listing_the_parts(tmp_path, workspace):
    base = tiny_config(workspace, tmp_path / "run")
    with pytest.raises(RecurfitError, match="model.trainable: unknown part 'adaptor'; the parts are embeddings, pre"):
        load_config(None, ["model.trainable=[adaptor]"], base=base)
    with pytest.raises(RecurfitError, match="model.trainable is empty"):
        load_config(None, ["model.trainable=[]"], base=base)
    with pytest.raises(RecurfitError, match="lora.parts: unknown part 'head'; the parts are prelude, core, coda"):
        load_config(None, ["optimizer.name=adamw", "lora.parts=[head]"], base=base)
    with pytest.raises(RecurfitError, match="optimizer.name=muon with lora: .* set optimizer.name=adamw"):
        load_config(None, ["lora.rank=4"], base=base)
    with pytest.raises(RecurfitError, match="model.trainable and lora.parts both name 'core'"):
        load_config(None, ["optimizer.name=adamw", "lora.parts=[core]", "model.trainable=[core]"], base=base)
    # The kind of model decides the parts: a recurrent one has no `layers`, a baseline no `core`.
    config = load_config(None, ["model.trainable=[layers]"], base=base)
    with pytest.raises(RecurfitError, match="a recurrent model has no part 'layers'; its parts are embeddings, prel"):
        select_parts(retrofit(tiny_parent("llama"), (2, 2, 2)), config)
    with pytest.raises(RecurfitError, match="a recurrent model has no part 'layers'"):
        check_plan(config)  # --dry-run says so too, from the parent's config alone
    config = load_config(None, ["model.trainable=[core]"], base=base)
    with pytest.raises(RecurfitError, match="a non-recurrent baseline has no part 'core'; its parts are embeddings,"):
        select_parts(tiny_parent("llama"), config)


def test_every_parameter_belongs_to_one_part_and_tied_halves_are_refused(tmp_path, workspace):
    model = retrofit(tiny_parent("llama"), (2, 2, 2))
    covered = [id(p) for modules in part_modules(model).values() for m in modules for p in m.parameters()]
    assert sorted(covered) == sorted(id(p) for p in model.parameters())  # each exactly once
    assert any(p is model.model.norm.weight for p in part_modules(model)["coda"][1].parameters())
    parent = tiny_parent("llama", tie_word_embeddings=True)
    assert parent.lm_head.weight is parent.model.embed_tokens.weight
    config = load_config(None, ["model.trainable=[embeddings, layers]"], base=tiny_config(workspace, tmp_path))
    with pytest.raises(RecurfitError, match="embeddings and head share one matrix .* model.untie_embeddings=true"):
        select_parts(parent, config)
    config = load_config(None, ["model.trainable=[embeddings, head]"], base=tiny_config(workspace, tmp_path))
    assert [n for n, p in select_parts(parent, config).named_parameters() if p.requires_grad] == [
        "model.embed_tokens.weight"
    ]


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_frozen_parts_stay_bit_equal_and_hold_no_optimizer_state(tmp_path, workspace, optimizer):
    config = short(workspace, tmp_path / "run", "model.trainable=[adapter, coda]", f"optimizer.name={optimizer}")
    trainer = Trainer(config)
    before = state_of(trainer.model)
    trainer.run()
    after = state_of(trainer.model)
    trains = {"adapter", "coda", "norm"}  # the final norm goes with the coda
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (part_of(name) in trains), name
    held = names_in_optimizers(trainer)
    assert held == {name for name in before if part_of(name) in trains}
    assert all(n in held for o in trainer.optimizers for n in [trainer_name(trainer, p) for p in o.state])
    if optimizer == "muon":  # the adapter and coda matrices under Muon, the coda's norms under AdamW
        muon, adamw = (
            {trainer_name(trainer, p) for g in o.param_groups for p in g["params"]} for o in trainer.optimizers
        )
        assert "model.adapter.weight" in muon and all("norm" in n for n in adamw)
    saved = torch.load(checkpoint_folders(tmp_path / "run" / "checkpoints")[-1] / "optimizer.pt", weights_only=True)
    assert {key.partition(".")[0] for o in saved["optimizers"] for key in o["state"]} == {"model"}
    assert all(part_of(key) in trains for o in saved["optimizers"] for key in o["state"])


@pytest.mark.two_processes
def test_fsdp2_with_frozen_parts_matches_one_process(tmp_path, workspace):
    """Frozen and trained parameters in the same FSDP2 units (the coda's layers beside the frozen prelude, the
    core's beside the trained adapter): 2 gloo processes give one process's losses and the same final weights,
    the frozen ones the parent's bit for bit (AdamW: no bf16 Newton-Schulz rounding to amplify)."""
    optimizer = {"name": "adamw", "lr": 0.003, "warmup": 2}
    base = tiny_config(workspace, tmp_path / "x", steps=4, checkpoint={"every": 0, "keep": 1}, optimizer=optimizer)
    base["model"]["trainable"] = ["adapter", "coda"]
    one, two = one_and_two_processes(tmp_path, base, {"distributed": "fsdp"})
    expected, got = ([r["loss"] for r in read_log(run) if r["kind"] == "train"] for run in (one, two))
    assert len(got) == 4 and got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    start = retrofit(load_model(base["model"]["path"]), tuple(base["model"]["shape"])).state_dict()
    single, sharded = (load_file(run / "final" / "model.safetensors") for run in (one, two))
    for name, tensor in sharded.items():
        assert torch.allclose(tensor, single[name], rtol=1e-4, atol=1e-6), name
        if part_of(name) not in {"adapter", "coda", "norm"}:
            assert torch.equal(tensor, start[name]), name


def test_adapter_only_run_resumes_exactly_and_chains_into_a_full_run(tmp_path, workspace):
    whole = train(short(workspace, tmp_path / "whole", "model.trainable=[adapter]"))
    cut = short(workspace, tmp_path / "cut", "model.trainable=[adapter]", "steps=4")
    trainer = Trainer(cut)
    trainer.train_step(), trainer.train_step()
    trainer.checkpoint()
    trainer.close()
    resumed = train(cut, resume=True)
    assert resumed.losses == whole.losses[2:]
    # Phase 2 starts from phase 1's final model with every part training.
    phase1 = load_model(str(tmp_path / "whole" / "final"), dtype=torch.float32)
    sections = {"model": {"init_from": str(tmp_path / "whole")}}
    second = Trainer(short(workspace, tmp_path / "all", **sections))
    torch.testing.assert_close(second.model.state_dict(), phase1.state_dict(), rtol=0, atol=0)
    assert all(p.requires_grad for p in second.model.parameters())
    second.close()
    # Phase 1's optimizer state holds the adapter's moments only: it cannot continue a run training everything.
    carried = {"model": {"init_from": str(tmp_path / "whole"), "carry_state": True}}
    with pytest.raises(RecurfitError, match=r"model.carry_state carries optimizer state for the same trained parts"):
        Trainer(short(workspace, tmp_path / "carried", **carried))
