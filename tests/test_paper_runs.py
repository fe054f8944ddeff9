"""What the paper's experiments need beyond a plain run: chained runs (two-phase training, cooldowns), an
untied non-recurrent parent, ShortGPT-pruned baselines, the random-init arm's embedding scale, and the
authors' curricula."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import pruned, tiny_parent, token_batch
from safetensors.torch import load_file
from test_train import tiny_config

from recurfit.errors import RecurfitError
from recurfit.model.init import scaled_init_
from recurfit.model.sampling import Curriculum
from recurfit.surgery.layer_scores import block_influence
from recurfit.surgery.pruning import prune_layers, untie_embeddings
from recurfit.surgery.retrofit import retrofit
from recurfit.train import Trainer, load_config, train
from recurfit.train.initial_model import build_model
from recurfit.train.step_plan import depth_schedule


def small_run(workspace, out, steps=3, **overrides) -> dict:
    config = tiny_config(workspace, out, steps=steps, checkpoint={"every": 0, "keep": 1}, **overrides)
    config["data"]["phases"] = [{"sources": [str(workspace / "prose")]}]
    config["optimizer"].update(warmup=1, decay=1)
    return config


# ---------------------------------------------------------------- chained runs


def test_a_chained_run_starts_from_the_previous_runs_final_weights(tmp_path, workspace):
    first = load_config(None, [], base=small_run(workspace, tmp_path / "phase1"))
    train(first)
    second = load_config(
        None,
        ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'phase1'}"],
        base=small_run(workspace, tmp_path / "phase2"),
    )
    trainer = Trainer(second)

    saved = load_file(str(tmp_path / "phase1" / "final" / "model.safetensors"))
    state = trainer.model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[key], state[key]) for key in saved)
    result = trainer.run()
    assert result.counters.step == 3 and (tmp_path / "phase2" / "final" / "config.json").is_file()
    # The second phase runs its own schedule from its step 0.
    assert trainer.schedulers[0].last_epoch == 3


def test_a_chained_run_whose_parent_run_is_missing_fails_before_any_compute(tmp_path, workspace):
    config = load_config(
        None,
        ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'never-ran'}"],
        base=small_run(workspace, tmp_path / "phase2"),
    )
    with pytest.raises(RecurfitError, match=r"model.init_from: .*never-ran holds no finished run"):
        Trainer(config)
    assert not (tmp_path / "phase2").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.init_from=runs/a"], "model.init_from continues a run's final model; drop model.path"),
        (["model.path=null", "model.init_from=runs/a"], "drop model.shape/prelude/core/coda"),
        (["model.shape=null", "model.prune_to=3"], "set model.select=shortgpt"),
        (["model.shape=null", "model.prune_to=3", "model.select=shortgpt"], "set model.calibration"),
        (["model.prune_to=3", "model.select=shortgpt", "model.calibration=x"], "model.prune_to makes a non-recurrent"),
        (["model.embedding_scale=-1"], "model.embedding_scale must be > 0"),
    ],
)
def test_contradictory_model_settings_name_the_key(tmp_path, workspace, overrides, message):
    with pytest.raises(RecurfitError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(None, overrides, base=small_run(workspace, tmp_path / "run"))


# ---------------------------------------------------------------- baselines


def test_untying_keeps_the_outputs_and_lets_the_head_train_on_its_own(tmp_path):
    parent = tiny_parent("llama", tie_word_embeddings=True)
    assert parent.lm_head.weight is parent.model.embed_tokens.weight
    ids = token_batch()
    before = parent(ids).logits
    untie_embeddings(parent)
    assert parent.lm_head.weight is not parent.model.embed_tokens.weight
    assert torch.equal(parent(ids).logits, before)
    parent.lm_head.weight.data.add_(1.0)
    assert not torch.equal(parent.lm_head.weight, parent.model.embed_tokens.weight)
    parent.save_pretrained(tmp_path / "untied")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "untied")
    assert not reloaded.config.tie_word_embeddings
    assert torch.equal(reloaded.lm_head.weight, parent.lm_head.weight)
    assert torch.equal(reloaded.model.embed_tokens.weight, parent.model.embed_tokens.weight)


def test_the_untied_non_recurrent_baseline_trains_two_matrices(tmp_path, workspace):
    parent = tiny_parent("llama", tie_word_embeddings=True)
    parent.save_pretrained(tmp_path / "tied")
    config = small_run(workspace, tmp_path / "run")
    config["model"] = {"path": str(tmp_path / "tied"), "untie_embeddings": True}
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, 0)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_shortgpt_pruning_keeps_the_highest_influence_layers_and_computes_the_pruned_parent(family):
    parent = tiny_parent(family, num_layers=6)
    ids = token_batch(length=10)
    scores = block_influence(parent, ids)
    kept = sorted(sorted(range(6), key=lambda i: -scores[i])[:3])
    reference = pruned(parent, kept)
    model = prune_layers(copy.deepcopy(parent), 3, ids)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # Kept layers are renumbered, so the KV cache works: cached greedy decoding equals uncached.
    prompt = ids[:1, :6]
    cached = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_a_shortgpt_baseline_from_a_config(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run")
    config["model"] = {
        "path": str(workspace / "parent"),
        "prune_to": 4,
        "select": "shortgpt",
        "calibration": str(workspace / "prose"),
    }
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, 0)
    assert model.config.num_hidden_layers == 4 and not hasattr(model.config, "num_core_layers")
    retrofit_config = small_run(workspace, tmp_path / "run2")
    retrofit_config["model"].update(select="shortgpt", calibration=str(workspace / "prose"))
    loaded = load_config(None, [], base=retrofit_config)
    assert build_model(loaded.model, loaded.depth, 0).config.shape == (2, 2, 2)


# ---------------------------------------------------------------- random init


def test_embedding_scale_multiplies_the_token_embeddings_and_is_saved(tmp_path):
    model = retrofit(tiny_parent("llama"), (2, 2, 2))
    ids = token_batch()
    embedded = model.model.embed(ids)
    model.config.embedding_scale = math.sqrt(64)
    torch.testing.assert_close(model.model.embed(ids), embedded * 8)
    model.save_pretrained(tmp_path / "scaled")
    from recurfit.model.modeling import RecurrentForCausalLM

    reloaded = RecurrentForCausalLM.from_pretrained(tmp_path / "scaled")
    assert reloaded.model.embed_scale == 8
    torch.testing.assert_close(reloaded(ids, num_steps=2).logits, model(ids, num_steps=2).logits)


def test_the_scaled_init_gives_the_glu_linear_half_the_depth_scaled_std():
    model = retrofit(tiny_parent("llama", num_layers=6, hidden_size=256, intermediate_size=512), (2, 2, 2))
    model.config.mean_recurrence = 8
    scaled_init_(model, torch.Generator().manual_seed(0))
    std = math.sqrt(2 / (5 * 256))
    small = std / math.sqrt(2 * (2 + 8 * 2 + 2))
    mlp = model.model.core[0].mlp
    truncated = 0.9866  # the std of a normal cut at ±3σ, in units of σ
    assert abs(mlp.gate_proj.weight.std().item() - std * truncated) < 0.05 * std
    for weight in (mlp.up_proj.weight, mlp.down_proj.weight, model.model.core[0].self_attn.o_proj.weight):
        assert weight.abs().max() <= 3 * small + 1e-7
        assert abs(weight.std().item() - small * truncated) < 0.05 * small


# ---------------------------------------------------------------- curricula as the authors computed them


def test_curricula_follow_the_authors_scheduler(tmp_path, workspace):
    from transformers import get_wsd_schedule

    def authors(target, fraction, steps, start_ratio, values_wanted=None):
        # The authors drive each curriculum with transformers' WSD scheduler on a dummy optimizer whose LR is
        # the target depth: warmup ceil(fraction · steps), no decay, `min_lr_ratio` the starting fraction.
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(target))
        schedule = get_wsd_schedule(
            optimizer, math.ceil(fraction * steps), 0, num_training_steps=steps, min_lr_ratio=start_ratio
        )
        values = []
        for _ in range(values_wanted or steps):
            values.append(schedule.get_last_lr()[0])
            optimizer.step()  # no gradients: a no-op, in the order torch expects
            schedule.step()
        return values

    config = load_config(
        None,
        [
            "depth.mean_recurrence=32",
            "depth.backprop_depth=8",
            "depth.curriculum=linear",
            "depth.curriculum_fraction=0.25",
            "depth.backprop_curriculum=linear",
            "depth.backprop_curriculum_fraction=0.1",
        ],
        base=small_run(workspace, tmp_path / "run", steps=200),
    )
    schedule = depth_schedule(config)
    mean = [max(1, math.ceil(v)) for v in authors(32, 0.25, 200, 0.0)]
    # Their backprop scheduler starts at 1/k̄ of k̄ and is stepped once before the first training step.
    backprop = [math.ceil(v) for v in authors(8, 0.1, 200, 1 / 8, values_wanted=201)[1:]]
    assert [schedule.mean_recurrence.at(t) for t in range(200)] == mean
    # (Stepped once ahead, their scheduler runs off its end on the last step and falls back to 1; not copied.)
    assert [schedule.backprop_depth.at(t) for t in range(199)] == backprop[:199]
    assert backprop[0] == 2 and mean[0] == 1 and mean[-1] == 32
    assert Curriculum(8, "linear", 20, start=1, lead=1).at(0) == 2
