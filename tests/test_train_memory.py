"""The memory plan (recurfit/train/memory.py, `train --dry-run`) and the chunked losses it counts on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import REPO, plan, tiny_parent, tiny_plan_model
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


def test_hsdp_plans_each_process_as_fsdp2_over_its_shard_group(monkeypatch):
    """Under HSDP each process holds what FSDP2 over its group of `fsdp_shard_size` processes holds (a copy per
    group): on 2 nodes of 2, every part of the plan is FSDP2 over 2's, not over 4's; without the setting, torchrun's
    LOCAL_WORLD_SIZE (a node's processes) is the group, and a dry run with neither takes every process as one node."""
    config, model = tiny_plan_model(distributed="fsdp", precision="bf16")
    hsdp, _ = tiny_plan_model(distributed="fsdp", precision="bf16", fsdp_shard_size=2)
    two, four = plan(config, model, world=2).parts(), plan(config, model, world=4).parts()
    assert plan(hsdp, model, world=4).parts() == two != four
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert plan(config, model, world=4).parts() == two


def _size(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_plan_gathers_the_body_and_head_and_holds_their_gradients_in_the_gathered_dtype(world):
    """`fsdp_units: recurrence`: the recurrent body and the head gathered from forward to backward, their whole
    gradients in the dtype FSDP2 gathers in (param_dtype: bf16 under bf16), and at the final callback the body's
    gradients beside their float32 reduce-scatter input; none of it falls with the number of processes."""
    for precision, gathered in (("fp32", 4), ("bf16", 2)):
        config, model = tiny_plan_model(distributed="fsdp", precision=precision)
        body = model.model
        once = [model.get_input_embeddings(), *body.prelude]
        body_and_head = _size([model]) - _size(once)
        planned = plan(config, model, world=world)
        assert planned.distributed == gathered * body_and_head
        assert planned.unsharded_gradients == gathered * body_and_head
        assert planned.autocast_copies == 0  # autocast uses FSDP2's bf16 weights as they are
        body_alone = body_and_head - _size([model.get_output_embeddings()])
        assert planned.body_all_gather == gathered * body_alone  # its flat all-gather output beside its weights
        assert planned.all_gather_buffer == gathered * _size([body.prelude[-1]])  # the forward's last unit's
        assert planned.reduce_scatter_buffer >= (gathered + 4) * body_alone
    ddp = plan(*tiny_plan_model(precision="bf16"), world=world)
    assert ddp.autocast_copies > 0 and ddp.reduce_scatter_buffer == ddp.unsharded_gradients == 0


def test_fsdp_plan_by_layer_holds_the_cores_gradients_whole():
    """`fsdp_units: layer`: the head and the body's rest (adapter, final norm) gathered from forward to backward;
    whole gradients of those and of every core layer (FSDP2 reduces a unit used several times after its last
    use's backward), in bf16 under bf16."""
    config, model = tiny_plan_model(distributed="fsdp", fsdp_units="layer", precision="bf16")
    body = model.model
    layers = [*body.prelude, *body.core, *body.coda]
    rest = _size([model]) - _size([model.get_input_embeddings(), *layers])
    planned = plan(config, model, world=2)
    assert planned.distributed == 2 * rest
    assert planned.unsharded_gradients == 2 * (rest + _size(body.core))
    assert planned.all_gather_buffer == 2 * 2 * max(_size([layer]) for layer in layers)  # flat output and copy
    assert planned.peak < plan(*tiny_plan_model(distributed="fsdp", precision="bf16"), world=2).peak


def tied_plan_model(**overrides):
    """tiny_plan_model's retrofit of a tied parent, left tied."""
    from recurfit import retrofit
    from recurfit.train.initial_model import planned_parts

    config, _ = tiny_plan_model(**overrides)
    with torch.device("meta"):
        model = retrofit(tiny_parent("llama", place=False, tie_word_embeddings=True), (2, 2, 2), untie_embeddings=False)
    return config, planned_parts(model, config)


def test_fsdp_plan_of_a_tied_model_gathers_the_shared_matrix_once_with_the_body():
    """A head tied to the token embeddings: one FSDP2 unit of the two (torchtitan's grouping), gathered from the
    embeddings' forward to the backward's end: the shared matrix counted once, where untied the two are."""
    config, tied = tied_plan_model(distributed="fsdp", precision="bf16")
    untied = plan(*tiny_plan_model(distributed="fsdp", precision="bf16"), world=2)
    planned = plan(config, tied, world=2)
    body = _size([tied]) - _size(tied.model.prelude)  # the body, and the shared matrix once
    assert planned.distributed == planned.unsharded_gradients == 2 * body
    matrix = tied.get_input_embeddings().weight.numel()
    assert planned.parameters == untied.parameters - 4 * matrix // 2  # one matrix fewer, sharded over 2


@pytest.fixture(scope="module")
def fsdp_buffers(tmp_path_factory) -> dict:
    """tests/fsdp_buffers_probe.py's record of FSDP2's buffers in one bf16 micro-batch on 2 gloo processes."""
    out = tmp_path_factory.mktemp("fsdp-buffers") / "buffers.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, str(Path(__file__).parent / "fsdp_buffers_probe.py"), str(out)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# FSDP2 pads each weight's first dimension to a multiple of the processes before gathering it: the tiny vocabulary
# of 97 rows gathers as 98, 1 % more than the plan (which counts the weights) for the embeddings and the head.
PADDING = 0.02


@pytest.mark.two_processes
@pytest.mark.parametrize("layout", ["recurrence", "layer", "tied"])
def test_the_fsdp_plan_counts_the_buffers_fsdp2_allocates_in_bf16(fsdp_buffers, layout):
    """The plan's FSDP2 terms against what FSDP2 allocates in a bf16 micro-batch (weights gathered in bf16,
    gradients reduced in fp32), from the sizes its collectives receive: whole gradients in bf16, reduce-scatter
    inputs in fp32, the flat all-gather outputs, and the final callback's order of reductions."""
    found = fsdp_buffers[layout]
    overrides = dict(distributed="fsdp", precision="bf16", fsdp_units="layer" if layout == "layer" else "recurrence")
    config, model = tied_plan_model(**overrides) if layout == "tied" else tiny_plan_model(**overrides)
    planned = plan(config, model, world=2)  # a GPU's (NCCL's) plan: gloo's own copy aside (module docstring)
    reductions, gathers = found["reductions"], found["gathers"]
    assert {(r["gradient_itemsize"], r["reduce_itemsize"]) for r in reductions} == {(2, 4)}
    final = [r for r in reductions if r["final"]]  # the units whose forward reads token ids, in FSDP2's order
    expected = ["model", "model.embed_tokens, lm_head"] if layout == "tied" else ["root", "model", "model.embed_tokens"]
    assert [r["unit"] for r in final] == expected
    whole = sum(r["gradient_bytes"] for r in final if r["unit"] != "model.embed_tokens")
    whole += sum(r["gradient_bytes"] for r in reductions if ".core." in r["unit"])  # reduced after their last use
    assert planned.unsharded_gradients == whole
    gathered = {g["unit"]: g["bytes"] for g in gathers}
    assert planned.body_all_gather == gathered["model"]
    last = gathers[found["forward_gathers"] - 1]  # its flat output is held to the forward's end
    assert planned.all_gather_buffer == (2 if layout == "layer" else 1) * last["bytes"]  # by layer, with its copy
    # The final callback: each unit's gradients beside their float32 copy (twice their bf16 bytes), while the
    # units after it still hold their weights (not the embeddings': resharded after their forward) and gradients
    peak, after = 0, 0
    for reduction in reversed(final):
        peak = max(peak, after + 3 * reduction["gradient_bytes"])
        weights = 0 if reduction["unit"] == "model.embed_tokens" else gathered[reduction["unit"]]
        after += weights + reduction["gradient_bytes"]
    assert planned.reduce_scatter_buffer == pytest.approx(peak, rel=PADDING)


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
