"""Training part of a model (`model.trainable`) and LoRA through PEFT (`lora:`): what is frozen stays bit-equal
and holds no optimizer state, what trains changes, resume is exact, and the exported model is merged."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import names_in_optimizers, short, state_of, tiny_config, tiny_parent
from safetensors.torch import load_file

from recurfit import retrofit
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_model
from recurfit.train import Trainer, load_config, train
from recurfit.train.lora import merged
from recurfit.train.parts import select_parts

pytestmark = pytest.mark.cpu_only("CPU runs of the tiny parent: what freezes does not depend on the device")


def lora_config(workspace, out, *overrides):
    return short(workspace, out, "optimizer.name=adamw", "lora.rank=4", "lora.parts=[core]", *overrides)


def test_lora_trains_only_its_matrices_resumes_exactly_and_exports_merged(tmp_path, workspace):
    config = lora_config(workspace, tmp_path / "run", "lora.targets=[q_proj, v_proj, down_proj]")
    trainer = Trainer(config)
    before = state_of(trainer.model)
    lora = {n for n in before if ".lora_" in n}
    assert len(lora) == 2 * 2 * 3  # A and B of three modules in each of the 2 core layers
    assert all(n.startswith("model.core.") for n in lora)
    assert names_in_optimizers(trainer) == lora
    result = trainer.run()
    after = state_of(trainer.model)
    for name in before:  # B starts at zero, so both factors move from the first step's second update on
        assert torch.equal(before[name], after[name]) == (name not in lora), name
    # Exact resume of a LoRA run from its step-2 checkpoint.
    cut = Trainer(lora_config(workspace, tmp_path / "cut", "lora.targets=[q_proj, v_proj, down_proj]"))
    cut.train_step(), cut.train_step()
    cut.checkpoint()
    cut.close()
    assert train(cut.config, resume=True).losses == result.losses[2:]
    # final/ holds plain weights (no PEFT keys), loads without PEFT, and computes what the unmerged model did.
    final = tmp_path / "run" / "final"
    keys = load_file(final / "model.safetensors").keys()
    assert not any("lora" in k or "base_layer" in k for k in keys)
    assert "peft" not in json.loads((final / "config.json").read_text()).get("architectures", [""])[0].lower()
    exported = load_model(str(final), dtype=torch.float32)
    assert set(exported.state_dict()) == set(retrofit(tiny_parent("llama"), (2, 2, 2)).state_dict())
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    state = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = trainer.model(ids, num_steps=3, initial_state=state).logits
        got = exported(ids, num_steps=3, initial_state=state).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merged_logits_equal_the_unmerged_models(tmp_path, workspace):
    """On a tiny random model with LoRA on every layer part, B drawn away from zero (so the adapters matter)."""
    config = load_config(
        None, ["optimizer.name=adamw", "lora.rank=4", "lora.alpha=8"], base=tiny_config(workspace, tmp_path)
    )
    model = select_parts(retrofit(tiny_parent("llama"), (2, 2, 2)), config).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    plain = merged(model)
    assert not any(".lora_" in n for n, _ in plain.named_parameters())
    assert any(".lora_" in n for n, _ in model.named_parameters())  # the training model is left as it was
    ids = torch.randint(3, 97, (2, 10), generator=generator)
    state = torch.randn(2, 10, 64, generator=generator)
    with torch.no_grad():
        want = model(ids, num_steps=4, initial_state=state).logits
        got = plain(ids, num_steps=4, initial_state=state).logits
        base = retrofit(tiny_parent("llama"), (2, 2, 2)).eval()(ids, num_steps=4, initial_state=state).logits
    assert (want - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lora_targets_that_match_nothing_name_the_modules(tmp_path, workspace):
    config = lora_config(workspace, tmp_path / "run", "lora.targets=[qproj]")
    with pytest.raises(RecurfitError, match="lora.targets: 'qproj' is no linear module of the layers of core; they"):
        Trainer(config)
