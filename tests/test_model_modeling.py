"""Tests of `recurfit/model/modeling.py`."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    GREEDY_TOKENS,
    AdapterProducts,
    close,
    gradient_close,
    model_with_state,
    placed,
    prompts,
    tiny_parent,
    token_batch,
)
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.utils import ModelOutput

import recurfit
from recurfit.model.compat import enable_activation_checkpointing
from recurfit.surgery.retrofit import retrofit


def trained_like(model_type="llama", **kwargs):
    """A retrofit whose adapter reads the state (random init), so depth and s_0 change the output."""
    kwargs = {"adapter_init": "random", "state_init_std": 0.0, **kwargs}
    return recurfit.retrofit(tiny_parent(model_type), shape=(2, 2, 1), **kwargs)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_auto_model_returns_a_model_output_with_the_depth_run(tmp_path):
    model = model_with_state(mean_recurrence=3)
    model.save_pretrained(tmp_path)
    body = placed(AutoModel.from_pretrained(tmp_path))
    assert isinstance(body, recurfit.RecurrentModel)
    ids = prompts()[0]
    with torch.no_grad():
        out = body(ids)
        expected = model(ids, output_hidden_states=True)
    assert isinstance(out, ModelOutput)
    assert out.num_steps == (0, 3) and out.steps_per_token.tolist() == [3, 3]  # the model's mean recurrence
    torch.testing.assert_close(model.lm_head(out.last_hidden_state), expected.logits, **close(1.3e-6, 1e-5))


def test_truncated_backprop_equals_restarting_from_the_detached_state():
    """(n, k): the n no-grad steps act as a constant initial state for the k steps that get gradient."""
    model = trained_like().train()
    ids = token_batch()
    s0 = placed(torch.randn(2, 12, 64) * 0.01)
    model(ids, labels=ids, num_steps=(3, 2), initial_state=s0).loss.backward()
    truncated = grads(model)
    model.zero_grad()
    # s_3 as training computes it (inference adds the adapter's e-half once, to float32 rounding of this)
    s3 = model(ids, num_steps=3, initial_state=s0, output_hidden_states=True).hidden_states[-1].detach()
    model(ids, labels=ids, num_steps=2, initial_state=s3).loss.backward()
    restarted = grads(model)
    assert truncated.keys() == restarted.keys()
    assert any(k.startswith("model.prelude") for k in truncated)  # the prelude learns through e
    for name in truncated:
        expected = restarted[name]
        torch.testing.assert_close(truncated[name], expected, **gradient_close(expected, 1e-5, 1e-7), msg=name)


def test_no_grad_steps_change_the_output_but_not_the_graph():
    model = trained_like().train()
    ids = token_batch()
    shallow = model(ids, labels=ids, num_steps=(0, 2))
    deep = model(ids, labels=ids, num_steps=(6, 2))
    assert deep.num_steps == (6, 2) and not torch.allclose(shallow.logits, deep.logits)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = trained_like("qwen3").train()
    ids = token_batch()
    model(ids, labels=ids, num_steps=(1, 3)).loss.backward()
    plain = grads(model)
    model.zero_grad()
    enable_activation_checkpointing(model)
    model(ids, labels=ids, num_steps=(1, 3)).loss.backward()
    checkpointed = grads(model)
    assert checkpointed.keys() == plain.keys() == dict(model.named_parameters()).keys()  # every parameter learns
    for name, grad in checkpointed.items():
        torch.testing.assert_close(grad, plain[name], **gradient_close(plain[name], 1e-5, 1e-7), msg=name)


def test_default_depth_is_sampled_in_training_and_the_mean_in_eval():
    model = trained_like(mean_recurrence=6, backprop_depth=2)
    ids = token_batch()
    torch.manual_seed(0)
    model.train()
    drawn = {model(ids).num_steps for _ in range(20)}
    assert len(drawn) > 1 and all(k == min(2, n + k) for n, k in drawn)
    model.eval()
    with torch.no_grad():
        assert model(ids).num_steps == (0, 6)


def test_hidden_states_are_the_state_after_every_step():
    model = trained_like()
    ids = token_batch()
    with torch.no_grad():
        out = model(ids, num_steps=5, output_hidden_states=True)
        four = model(ids, num_steps=4, output_hidden_states=True)
    assert len(out.hidden_states) == 5
    torch.testing.assert_close(out.hidden_states[3], four.hidden_states[-1])


def test_loss_follows_the_hf_convention_and_ignores_padding():
    model = trained_like()
    ids = token_batch()
    with torch.no_grad():
        out = model(ids, labels=ids, num_steps=2)
        manual = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, 97), ids[:, 1:].reshape(-1))  # loss in fp32
        torch.testing.assert_close(out.loss, manual)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        padded = model(ids, attention_mask=mask, labels=ids, num_steps=2)
        labels = ids.clone()
        labels[0, :5] = -100
        explicit = model(ids, attention_mask=mask, labels=labels, num_steps=2)
    torch.testing.assert_close(padded.loss, explicit.loss)


@pytest.mark.parametrize("bad", [0, -1, (0, 0), (2, -1), 1.5, True, (1, 2, 3), "4"])
def test_bad_num_steps_is_a_clear_error(bad):
    model = trained_like()
    with pytest.raises(ValueError, match="num_steps"):
        model(token_batch(), num_steps=bad)


@pytest.mark.parametrize("model_type", ["llama", "olmo3"])
def test_save_and_load_round_trip(tmp_path, model_type):
    model = trained_like(model_type, mean_recurrence=5)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "recurfit"
    again = placed(AutoModelForCausalLM.from_pretrained(tmp_path))
    assert isinstance(again, recurfit.RecurrentForCausalLM) and not again.training
    assert again.config.source_layers == model.config.source_layers and again.config.mean_recurrence == 5
    assert isinstance(AutoConfig.from_pretrained(tmp_path), recurfit.RecurrentConfig)
    ids = token_batch()
    with torch.no_grad():
        # exact in float32; in bf16 the reloaded RoPE frequencies round differently
        torch.testing.assert_close(model.eval()(ids, num_steps=3).logits, again(ids, num_steps=3).logits, **close(0, 0))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_generate_greedy_matches_manual_argmax_decoding():
    model = trained_like().eval()
    ids = token_batch(1, 6)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, num_steps=3, pad_token_id=0)
    manual = ids
    with torch.no_grad():
        for _ in range(5):
            next_token = model(manual, num_steps=3).logits[:, -1].argmax(-1, keepdim=True)
            manual = torch.cat([manual, next_token], dim=1)
    assert torch.equal(out, manual)


def test_importing_the_model_registers_it_with_the_auto_classes_and_import_recurfit_stays_torch_free(tmp_path):
    import subprocess
    import sys

    trained_like().save_pretrained(tmp_path)
    code = "\n".join(
        [
            "import sys",
            "import recurfit",
            "print('torch after import recurfit:', 'torch' in sys.modules)",
            "import recurfit.model.modeling",
            "from transformers import AutoModelForCausalLM",
            f"print(type(AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})).__name__)",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["torch after import recurfit: False", "RecurrentForCausalLM"]


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.float32_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
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


# bf16's unit roundoff: one round-to-nearest changes a value by at most this fraction of it. The state's relative
# error measured 1.7e-3 to 2.4e-3 on an AMD EPYC with AVX512-BF16 (no AMX), natively and under
# ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2 (1.6x below the bound).
BF16_UNIT_ROUNDOFF = 2**-8


@pytest.mark.float32_only("builds its own bf16 model and float32 reference")
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma"])
def test_bf16_weights_keep_the_state_within_one_rounding_of_float32(model_type):
    """Slow state updates (each core layer adds about a thousandth of the stream, as in a recurrence near its
    fixed point) are where a bf16 stream fails: each residual add rounds to bf16's resolution, coarser than the
    update. A bf16 model keeps its stream and state in float32 (only the adapter rounds, once per
    step), so at every step of r = 32 its state stays within one bf16 rounding (relative 2**-8) of the float32
    computation with the same weights. Measured: up to 0.62 of the bound; a bf16 stream: up to 1.24 of it."""
    float32 = model_with_state(model_type)
    with torch.no_grad():
        for name, weight in float32.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.mul_(1e-3)  # the layers' updates to the stream: about 1e-3 of it
    float32 = float32.to(torch.bfloat16).float()  # the rounded weights, so only the computation differs
    bf16 = copy.deepcopy(float32).to(torch.bfloat16)
    ids, mask = prompts()
    with torch.no_grad():
        expected = float32(ids, attention_mask=mask, num_steps=32, output_hidden_states=True).hidden_states
        served = bf16(ids, attention_mask=mask, num_steps=32, output_hidden_states=True).hidden_states
    real = mask.bool()
    for step, (state, reference) in enumerate(zip(served, expected, strict=True), 1):
        assert state.dtype == torch.float32
        error = (state - reference)[real].norm() / reference[real].norm()
        assert error <= BF16_UNIT_ROUNDOFF, f"step {step}: relative state error {error:.2e}"


@pytest.mark.parametrize("adapter_init", ["random", "identity"])
def test_inference_multiplies_the_adapters_embedded_half_once_per_forward(adapter_init):
    """A([s; e]) = W_s s + W_e e and e is the same at every step: a forward without gradient computes W_e e once and
    W_s s at each of its r steps (r + 1 products of width h, not r of width 2h), with the output of the product over
    [s; e] to float32 rounding. A forward with gradient (training) keeps the one product over [s; e] per step, its
    steps without gradient (truncated backprop's first n) included."""
    model = model_with_state(adapter_init=adapter_init)
    hidden, r = model.config.text_config.hidden_size, 5
    ids, mask = prompts()
    with torch.no_grad(), AdapterProducts(model.model.adapter) as products:
        split = model(ids, attention_mask=mask, num_steps=r).logits
    assert products.widths == [hidden] * (r + 1)
    with AdapterProducts(model.model.adapter) as products:
        joint = model(ids, attention_mask=mask, num_steps=r).logits
    assert products.widths == [2 * hidden] * r
    torch.testing.assert_close(split, joint.detach(), **close(1e-5, 1e-5))
    with AdapterProducts(model.model.adapter) as products:
        model(ids, attention_mask=mask, num_steps=(3, 2))
    assert products.widths == [2 * hidden] * 5


def test_readouts_while_decoding_are_the_token_stopped_at_each_step_and_leave_the_cache_as_it_was():
    """With a cache, `readout_steps` reads what an exit rule reads: the new token's logits had its recurrence stopped
    at step s (the earlier tokens' final coda entries), which a forward at r = s on a copy of the cache computes, and
    the cache afterwards is the cache without readouts: the next token's logits are the same. The same operations in
    the same order on both sides, so the float32 bound is exact."""
    from recurfit.model.cache import RecurrentCache
    from recurfit.model.compat import cache_kwargs

    model = model_with_state("llama")
    ids = token_batch(1, 9)
    prefilled = RecurrentCache(model.config)
    with torch.no_grad():
        model(ids[:, :7], num_steps=5, **cache_kwargs(prefilled))
        read, plain = copy.deepcopy(prefilled), copy.deepcopy(prefilled)
        out = model(ids[:, 7:8], num_steps=5, readout_steps=[1, 2, 3, 4], **cache_kwargs(read))
        assert len(out.readout_logits) == 4
        for step, logits in enumerate(out.readout_logits, start=1):
            stopped = model(ids[:, 7:8], num_steps=step, **cache_kwargs(copy.deepcopy(prefilled))).logits
            torch.testing.assert_close(logits, stopped, **close(0, 0))
        torch.testing.assert_close(out.logits, model(ids[:, 7:8], num_steps=5, **cache_kwargs(plain)).logits)
        after_readouts, after_plain = (model(ids[:, 8:9], num_steps=5, **cache_kwargs(c)).logits for c in (read, plain))
    torch.testing.assert_close(after_readouts, after_plain, **close(0, 0))
