"""The memory plan (recurfit/train/memory.py, `train --dry-run`) and the chunked losses it counts on."""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import pytest
import torch
from conftest import plan, tiny_plan_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from recurfit.model.compat import enable_activation_checkpointing


def test_the_peak_is_the_resident_parts_and_the_larger_transient_one():
    config, model = tiny_plan_model(**{"depth.supervise": "{last: 2}", "distill": "{alpha: 0.5}"})
    result = plan(config, model, world=4, teacher_parameters=1000)
    parts = result.parts()
    resident = sum(parts[name] for name in result.RESIDENT)
    transient = sum(parts[name] for name in result.FORWARD_BACKWARD)
    assert result.peak == resident + max(transient, parts["optimizer_step"], parts["validation"])
    assert all(parts[name] > 0 for name in ("distributed", "teacher", "readouts", "autocast_copies"))
    assert parts["gradients"] == parts["parameters"]  # every part trains
    assert parts["distributed"] == parts["gradients"]  # DDP's buckets: a second copy of the gradients


def test_the_plan_grows_with_k_and_the_micro_batch():
    peaks = {}
    for k in (1, 2, 4, 8):
        config, model = tiny_plan_model(**{"depth.mean_recurrence": 8, "depth.backprop_depth": k})
        peaks[k] = [plan(config, model, micro=micro).peak for micro in (1, 2, 4, 8)]
    for k, by_micro in peaks.items():
        assert by_micro == sorted(set(by_micro)), k
    assert [peaks[k][0] for k in (1, 2, 4, 8)] == sorted(set(peaks[k][0] for k in (1, 2, 4, 8)))


def test_k_is_the_largest_the_sampler_draws():
    config, model = tiny_plan_model(**{"depth.mean_recurrence": 4, "depth.backprop_depth": 8})
    assert plan(config, model).k == 4  # k = min(k̄, r̄): the sampler never gives more
    config, model = tiny_plan_model(**{"depth.mean_recurrence": 32, "depth.backprop_depth": 8})
    assert plan(config, model).k == 8


def test_frozen_parts_have_no_gradients_or_optimizer_state():
    config, model = tiny_plan_model(**{"model.trainable": "[adapter]"})
    result = plan(config, model)
    adapter = sum(p.numel() for p in model.model.adapter.parameters())
    assert result.gradients == 4 * adapter and result.optimizer_muon == 4 * adapter and result.optimizer_adamw == 0


def test_fsdp_shards_what_it_shards():
    config, model = tiny_plan_model(distributed="fsdp")
    one, four = plan(config, model, world=1), plan(config, model, world=4)
    assert four.parameters == one.parameters // 4 and four.gradients == one.gradients // 4
    assert four.optimizer_muon == one.optimizer_muon // 4  # BatchedMuon keeps each process's shard of momentum


@pytest.mark.parametrize("autocast, stream", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_a_layers_saved_activations_are_what_autograd_saves(autocast, stream):
    """L of the module docstring against the bytes autograd keeps for one llama decoder layer (SDPA)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recurfit.train.memory import layer_bytes, layer_shape

    parent_config = LlamaConfig(
        vocab_size=101, hidden_size=128, intermediate_size=320, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(parent_config).train()
    batch, length = 2, 16
    hidden = torch.randn(batch, length, 128, requires_grad=True)
    positions = torch.arange(length)[None]
    saved = {}

    def keep(tensor):
        if tensor.shape[:1] in ((batch,), (batch * length,)):  # activations, not weights or rotary tables
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        rotary = model.model.rotary_emb(hidden, positions)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model.model.layers[0](hidden.to(stream), position_embeddings=rotary, position_ids=positions)
    assert sum(saved.values()) == batch * length * layer_bytes(layer_shape(model), autocast, stream.itemsize)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_whole_models_saved_tensors_are_the_plans(autocast, checkpointing):
    """A (2, 2, 2) retrofit at (n, k) = (1, 3): what autograd keeps at the end of the forward and loss is the plan's
    activations, no logits (less, under checkpointing, the one layer backward recomputes at a time), and its
    bf16 weight copies are the plan's autocast copies (less that layer's)."""
    from conftest import tiny_parent

    from recurfit import retrofit
    from recurfit.train.head import final_hidden_states, head_losses
    from recurfit.train.memory import (
        _activation_bytes,
        _autocast_copies,
        layer_bytes,
        layer_shape,
        vocab_size,
    )
    from recurfit.train.parts import decoder_layers

    config, _ = tiny_plan_model(**({"model.gradient_checkpointing": "true"} if checkpointing else {}))
    model = retrofit(tiny_parent("llama", num_layers=6, place=False), (2, 2, 2)).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    batch, length, k = 3, 10, 3
    ids = torch.randint(0, vocab_size(model), (batch, length))
    activations, copies = {}, {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if tensor.shape[:1] in ((batch,), (batch * length,)):
            activations[storage.data_ptr()] = storage.nbytes()
        elif tensor.dtype == torch.bfloat16:  # weights cast by autocast
            copies[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden, weight = final_hidden_states(model, model, ids, num_steps=(1, k))
            head_losses(hidden[-1], weight, ids)
    recomputed_layer = layer_bytes(layer_shape(model), autocast, 4) if checkpointing else 0
    planned = _activation_bytes(config, model, k, autocast) - recomputed_layer  # the head's loss keeps no logits
    assert sum(activations.values()) == batch * length * planned
    layer_copies = 2 * sum(p.numel() for p in decoder_layers(model)[0].parameters() if p.ndim == 2)
    expected = _autocast_copies(model, k, autocast, checkpointing) - (layer_copies if checkpointing and autocast else 0)
    assert sum(copies.values()) == expected


@pytest.mark.parametrize(
    "text, size",
    [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("0.5 gb", 5 * 10**8), ("512MiB", 2**29), ("1000", 1000)],
)
def test_device_memory_sizes(text, size):
    from recurfit.train.memory_fit import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80 GBs", "eighty", "-1GB", "0GB", ""])
def test_a_bad_device_memory_is_a_one_line_error(text):
    from recurfit.errors import RecurfitError
    from recurfit.train.memory_fit import parse_size

    with pytest.raises(RecurfitError, match="--device-memory must be a size such as 80GB"):
        parse_size(text)


def test_the_fitting_micro_batch_keeps_the_global_batch():
    from recurfit.train.memory_fit import USABLE_FRACTION, verdict

    config, model = tiny_plan_model()

    def plan_of(micro):
        return plan(config, model, micro=micro)

    memory = int(plan_of(1).peak / USABLE_FRACTION) + 1  # micro-batch 1 fits, 2 (the config's) does not
    assert verdict(plan_of, config, 1, memory) == (
        False,
        f"Does not fit: predicted peak {plan_of(2).peak / 1e6:.1f} MB per device at micro-batch 2, more than the "
        f"{0.9 * memory / 1e6:.1f} MB usable of {memory / 1e6:.1f} MB; batch.micro=1 fits (the same global batch).",
    )
    assert verdict(plan_of, config, 1, 10**12)[0]
    assert (
        "no micro-batch fits; try model.gradient_checkpointing=true or distributed=fsdp."
        in verdict(plan_of, config, 1, 1000)[1]
    )
    for overrides, advice in (
        (dict(distributed="fsdp"), "try model.gradient_checkpointing=true or fsdp_units=layer."),
        (dict(distributed="fsdp", fsdp_units="layer"), "try model.gradient_checkpointing=true or more GPUs."),
    ):
        config, model = tiny_plan_model(**overrides)

        def plan_of(micro, config=config, model=model):
            return plan(config, model, micro=micro)

        assert advice in verdict(plan_of, config, 2, 1000)[1]


class LiveTensors(TorchDispatchMode):
    """The bytes of the tensors that the ops run under it create, alive at once: now, and at most (`peak`)."""

    def __init__(self):
        super().__init__()
        self.owners, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(output):
            # a view (or an op's result in place) holds its input's storage: counted where that was made, if here
            fresh = isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs
            if fresh and tensor.untyped_storage().nbytes():
                self._track(tensor)
        return output

    def _track(self, tensor: torch.Tensor) -> None:
        """A storage is alive while a tensor made under the mode holds it."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.owners:
            self.owners[key] = [0, storage.nbytes()]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.owners[key][0] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key) -> None:
        self.owners[key][0] -= 1
        if not self.owners[key][0]:
            self.now -= self.owners.pop(key)[1]


@pytest.mark.cpu_only("measures the tensors of a CPU forward in float32")
def test_validation_peak_is_within_the_plans_validation_term(monkeypatch):
    """depth_losses of one micro-batch at 4 test recurrences: what its tensors take at once stays within the plan's
    validation term, and far below the logits of every depth (what validation held before, at once)."""
    from conftest import tiny_parent

    from recurfit import retrofit
    from recurfit.train import head
    from recurfit.train.distributed import Processes
    from recurfit.train.memory import validation_bytes, vocab_size
    from recurfit.train.validation_loss import depth_losses

    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 2**14)  # 4 positions per chunk: few, as at a 128 k vocabulary
    config, _ = tiny_plan_model(**{"eval.steps": "[1, 2, 4, 8]", "precision": "fp32"})
    model = retrofit(tiny_parent("llama", num_layers=6, place=False, vocab_size=4096), (2, 2, 2)).eval()
    rows, length = 4, 64
    ids = torch.randint(0, vocab_size(model), (rows, length + 1), generator=torch.Generator().manual_seed(0))
    tokens, vocab = rows * length, vocab_size(model)
    with torch.no_grad(), LiveTensors() as live:
        depth_losses(model, ids, [1, 2, 4, 8], 0, config, Processes(), True, lambda precision: nullcontext())
    planned = validation_bytes(config, model, tokens, "cpu")
    assert live.peak <= planned <= 2 * live.peak
    assert planned < tokens * vocab * 4  # less than one depth's float32 logits
    # more test recurrences add their final hidden states only
    more, _ = tiny_plan_model(**{"eval.steps": "[1, 2, 3, 4, 5, 6, 7, 8]", "precision": "fp32"})
    hidden = model.config.text_config.hidden_size
    assert validation_bytes(more, model, tokens, "cpu") - planned == 4 * tokens * hidden * 4


def test_the_dry_run_table_shows_the_validation_term():
    from rich.console import Console

    from recurfit.train.memory import gb
    from recurfit.train.memory_fit import plan_table

    config, model = tiny_plan_model()
    result = plan(config, model)
    console = Console(width=200, record=True)
    console.print(plan_table(result))
    row = next(line for line in console.export_text().splitlines() if line.startswith("│ validation "))
    assert gb(result.validation) in row and "validation forward, one chunk of logits" in row


@pytest.mark.cpu_only("measures the tensors of a CPU forward in float32 and bf16 autocast")
@pytest.mark.parametrize("distill", [False, True], ids=["ce", "distill"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_head_loss_peak_is_the_plans_logits_and_loss(monkeypatch, autocast, distill):
    """HeadLoss forward and backward over 8 chunks: its tensors alive at once are the plan's `logits_and_loss`
    to the byte but for a few scalars (under autocast also the head's bf16 copy and its bf16 input, which the
    plan counts as autocast copies and activations), and no whole logits: less than the T·V·2c of the logits and
    their gradient (and T·V·4 of the teacher's log-probabilities) that the loss held before."""
    from conftest import tiny_parent

    from recurfit import retrofit
    from recurfit.train import head
    from recurfit.train.initial_model import planned_parts
    from recurfit.train.memory import _loss_bytes, layer_shape, vocab_size

    config, _ = tiny_plan_model(**({"distill": "{alpha: 0.5}"} if distill else {}))
    with torch.device("meta"):
        model = planned_parts(retrofit(tiny_parent("llama", place=False, vocab_size=4096), (2, 2, 2)), config)
    vocab, width, tokens = vocab_size(model), layer_shape(model).hidden, 512
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", vocab * tokens // 8)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = torch.randn(vocab, width, generator=generator).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    with LiveTensors() as live:
        teacher = (torch.randn(tokens, width), torch.randn(vocab, width)[:, :]) if distill else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ce, kl = head.head_losses(hidden, weight, targets, teacher, 2.0)
        torch.autograd.grad(ce + kl, (hidden, weight))  # what backward hands on: to the norm, to .grad
    counted_elsewhere = 2 * (vocab + tokens) * width if autocast else 0
    teacher_weight = 4 * vocab * width if distill else 0  # the teacher's weights: a resident part of the plan
    measured = live.peak - counted_elsewhere - teacher_weight
    planned = _loss_bytes(config, model, tokens, autocast, "cpu")
    assert planned <= measured <= planned + 2**12  # and a few scalars and index vectors
    assert planned < tokens * vocab * (2 * (2 if autocast else 4) + (4 if distill else 0))
