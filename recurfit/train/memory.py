"""The memory plan: the peak memory of one training process, predicted from the config and the model's shapes
(a meta-device model: no weights), before anything is loaded. `recurfit train CONFIG --dry-run` prints it.

Per process (device), in bytes; N: parameters (fp32 master weights), T = micro-batch × seq_len tokens, V the
vocabulary, h the hidden size, i the MLP's, q/kv the query and key-value widths, H the heads, c the bytes of
an activation (2 under bf16 autocast, 4 in fp32), W the world size:

    parameters        4·N                       (FSDP2: 4·N / W)
    gradients         4·N_trained               (FSDP2: / W)
    optimizer         Muon: 4 per hidden matrix weight (momentum; FSDP2: / W, each process its shard);
                      AdamW: 8 per weight it updates (two moments; FSDP2: / W)
    DDP buckets       4·N_trained (DDP keeps the reduced gradients in buckets of its own), W > 1
    FSDP2 gathered    g × the recurrent body and the head (a tied head: with the token embeddings), gathered
                      from their forward to the backward's final callback; g = 2 under bf16 (`fsdp_units`'
                      MixedPrecisionPolicy: param_dtype bf16, reduce_dtype fp32), else 4. By layer, the body's
                      rest (adapter, final norm) in place of the body. FSDP2's other terms: below
    teacher           its weights, 2 or 4 bytes each (distill.dtype), / W under FSDP2
    autocast copies   2 per trained matrix weight (bf16 copies cached for the forward, kept for backward),
                      2 per frozen one per use that gradient flows through (checkpointed layers: one layer's);
                      none under FSDP2, whose bf16 gathered weights autocast uses as they are
    activations       T × [P·L(fp32 stream) + k·(R·L(s) + A) + C·L(s) + F + 8]   (8: the token ids)
    readouts          (m - 1) × T × (C·L(s) + F): depth supervision's extra readouts (m supervised depths)
    logits and loss   the head's loss (head.HeadLoss) never holds whole logits: one chunk of 2**24 elements'
                      logits at a time, B bytes per element (float32 logits and softmax, 8, the bf16 logits
                      under autocast, c, and five float32 buffers for the KL, 20),
                      the head weight's gradient (a float32 sum, and one chunk's product, c: V·h·(4 + c)),
                      the head input's gradient (T·h·4), and with a teacher its final hidden states (T·h
                      in its dtype)
    optimizer step    AdamW's foreach temporaries on a GPU (4 per weight), Newton-Schulz's chunk (24 bytes
                      per element of the largest): a separate peak, after backward has freed the activations
    validation        a forward without gradient at micro-batch × seq_len tokens (validation_loss.py), read
                      out at D = the eval.steps' depths: D × T·h·4 final hidden states, the prelude's output and
                      the state (T·h each), one layer's activations L(s) as a bound on its working set, one
                      chunk of the head's logits (c, its float32 upcast, one more float32 buffer); under eval
                      autocast the head's bf16 copy and one layer's (2 per weight); FSDP2 gathers its units as
                      training does (counted above). A
                      separate peak: gradients are freed after each step (counted all the same)

with the saved activations of one decoder layer per token (what autograd keeps for backward: transformers'
layers with SDPA attention, SiLU-gated MLP and RMSNorm; measured in tests/test_train_memory.py), s the bytes of
the residual stream entering the layer (fp32 from the embeddings; bf16 after a linear adapter under autocast):

    fp32:      L = 4·(6h + 2q + 2kv + 4i) + 4H + 8
    autocast:  L = 2·(4 + s)·h + 5·2h + 4q + 4kv + 8i + 4H + 8
               (each norm keeps a float32 input and its normalised output; each of the 5 projections reading a
               norm's output keeps its own bf16 copy; SDPA keeps q, k, v, out and its log-sum-exp; the MLP keeps
               gate, SiLU(gate), up and their product)
    A = 2h·c   the adapter's input [s; e] (when the adapter trains)
    F = (4 + s)·h + c·h + 4: the final norm and the head's input

k is the largest backprop depth the sampler can draw, min(k̄, r̄) (`sampling.split_depth`): a step's k never
exceeds it. A part whose gradient is not needed (a frozen prelude under frozen embeddings) keeps nothing;
frozen parts that gradient flows through are counted as trained (a slight overestimate). With gradient
checkpointing each layer keeps only its input (s·h per token), plus one layer's activations while recomputing.

    peak = parameters + gradients + optimizer + teacher
           + max(held + activations + readouts + FSDP2's all-gather buffer,           (the forward's end)
                 held + autocast copies + activations + readouts + logits and loss,  (the loss)
                 held + whole gradients + what is beside them,                       (FSDP2's backward)
                 FSDP2's final reduce,
                 optimizer step (+ DDP's buckets),
                 held + validation + FSDP2's all-gather buffer)

with held = DDP's buckets or FSDP2's gathered units.

FSDP2, as torch's `_fully_shard` allocates (torch/distributed/fsdp/_fully_shard/, per process, g as above):

    all-gather buffer  foreach_all_gather gathers a unit into one flat buffer of g × its weights, which
                      foreach_all_gather_copy_out splits into the unit's parameters; the flat buffer is freed only at
                      the next unit's copy-out (FSDPParamGroup.wait_for_unshard) or the root's post-forward. The
                      recurrent body is the last unit gathered in forward, so its flat copy is held through the whole
                      recurrence: g × the body. By layer, the last layer's flat buffer and its copy: 2g × a layer
    whole gradients   autograd computes and sums a gathered weight's gradient in its dtype (g), into one buffer for
                      all its uses; FSDP2's post_backward reduces it once it exists. The head, the body and the
                      token embeddings take token ids (the root, the body) or read them: no backward hook runs
                      for them, and their gradients wait for the final callback (the head's from the loss's
                      backward on). By layer, every core layer's gradient too, whole from the last step's backward
                      to the first's
    beside them       the larger of: the activations left once the last step's backward is done (k - 1 steps, the
                      prelude) and the next unit prefetched (FSDPParamGroup._backward_prefetch: its flat buffer;
                      by layer, 3 layers: the one in use, the next and one ahead, as the default prefetch follows
                      the forward's uses, those without gradient too); a once-per-forward layer's backward (the
                      prelude's activations, its weights and gradients, the next prefetched and its reduce-scatter
                      input: foreach_reduce copies a unit's gradients into one buffer of 4 bytes per weight,
                      reduce_dtype, before freeing them); by layer, the coda's backward (every activation, no core
                      gradient yet)
    final reduce      the final callback (FSDPState._root_post_backward_final_callback) runs post_backward for
                      the head, the body and the token embeddings in that order: each reshards its weights, then
                      foreach_reduce holds its gradients and their 4-byte reduce-scatter input at once, while the
                      units after it still hold their weights and gradients; the activations are gone. For a large
                      body this is the peak: (g + 4) × the body's trained weights. A CPU process group (gloo)
                      adds a copy of the whole input in its reduce_scatter_tensor: the plan of a CPU run counts it

Gradients are counted during the forward: they persist from one micro-batch into the next whenever a process
runs two or more per step (a process with a single micro-batch peaks a little lower). The plan is checked
against measured peaks in benchmarks/memory_plan.py (docs/results/cpu-training.md and, for FSDP2 in bf16 and fp32
by both unit layouts, docs/results/cpu-fsdp.md: "The memory plan against measured peaks"). A GPU's caching
allocator adds fragmentation that no term here counts: the fit leaves a tenth of the device for it
(memory_fit.USABLE_FRACTION).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..model.sampling import split_depth
from .config import TrainConfig
from .distributed import fsdp_shard_size, sharding_units
from .head import chunk_rows
from .initial_model import is_recurrent
from .losses import supervised_steps, teacher_dtype
from .optim import NS_BATCH_ELEMENTS, split_parameters, trains_in_bf16
from .parts import decoder_layers, part_modules

# The parents of the paper recipes and of the large-parent ones (their Hub configs, written out): their plans need
# no download.
PLANNED_PARENTS = {
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
    ),
    "allenai/OLMo-2-0425-1B": dict(
        model_type="olmo2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=100352, tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.1-8B": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-14B": dict(
        model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-32B": dict(
        model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.1-70B": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes per device, part by part (module docstring), and what they were computed for."""

    parameters: int
    gradients: int
    optimizer_muon: int
    optimizer_adamw: int
    distributed: int  # DDP buckets or FSDP2's gathered weights
    teacher: int
    autocast_copies: int
    activations: int
    readouts: int
    logits_and_loss: int
    optimizer_step: int
    validation: int
    # FSDP2 (module docstring, "FSDP2"): its transient buffers, and the phases of a micro-batch they peak in
    body_all_gather: int  # the body's flat all-gather output beside its gathered weights, at the forward's start
    all_gather_buffer: int  # the last unit's flat all-gather output, kept to the forward's end (and a layer's copy)
    unsharded_gradients: int  # the gathered units' whole gradients, once backward has been through the recurrence
    beside_gradients: int  # what else is held then: activations not yet freed, per-use units and their buffers
    reduce_scatter_buffer: int  # the final callback's reduce: the gradients still whole and one unit's fp32 input
    micro: int
    seq_len: int
    k: int
    world: int
    strategy: str
    autocast: bool

    RESIDENT = ("parameters", "gradients", "optimizer_muon", "optimizer_adamw", "distributed", "teacher")
    FORWARD_BACKWARD = ("autocast_copies", "activations", "readouts", "logits_and_loss")

    # peaks apart from the loss's
    LATER = (
        "body_all_gather",
        "all_gather_buffer",
        "unsharded_gradients",
        "beside_gradients",
        "reduce_scatter_buffer",
        "optimizer_step",
        "validation",
    )

    @property
    def fsdp(self) -> bool:
        return self.strategy == "fsdp" and self.world > 1

    def phases(self) -> dict[str, int]:
        """The peak of each phase above the sharded resident parts (parameters, gradients, optimizer, teacher).
        FSDP2's gathered units (`distributed`) are held from the forward to the backward's final callback, which
        frees them unit by unit as it reduces (counted in `reduce_scatter_buffer`); DDP's buckets always."""
        held = self.distributed
        activations = self.activations + self.readouts
        return {
            "forward's start": held + self.body_all_gather,
            "forward's end": held + self.all_gather_buffer + self.autocast_copies + activations,
            "loss": held + self.autocast_copies + activations + self.logits_and_loss,
            "backward": held + self.autocast_copies + self.unsharded_gradients + self.beside_gradients,
            "final callback": self.reduce_scatter_buffer,
            "optimizer step": self.optimizer_step + (0 if self.fsdp else held),
            "validation": held + self.all_gather_buffer + self.validation,
        }

    @property
    def peak(self) -> int:
        sharded = sum(getattr(self, name) for name in self.RESIDENT if name != "distributed")
        return sharded + max(self.phases().values())

    def parts(self) -> dict[str, int]:
        names = [*self.RESIDENT, *self.FORWARD_BACKWARD, *self.LATER]
        return {name: getattr(self, name) for name in names}


# ---------------------------------------------------------------- the model's shapes


@dataclass(frozen=True)
class LayerShape:
    """The widths of one decoder layer that its saved activations scale with."""

    hidden: int
    query: int
    key_value: int
    intermediate: int
    heads: int
    qk_norm: bool


def layer_shape(model: nn.Module) -> LayerShape:
    layer = decoder_layers(model)[0]
    attention, mlp = layer.self_attn, layer.mlp
    config = model.config.get_text_config()
    return LayerShape(
        hidden=config.hidden_size,
        query=attention.q_proj.out_features,
        key_value=attention.k_proj.out_features,
        intermediate=mlp.up_proj.out_features,
        heads=config.num_attention_heads,
        qk_norm=hasattr(attention, "q_norm"),
    )


def layer_bytes(shape: LayerShape, autocast: bool, stream: int) -> int:
    """Bytes one decoder layer keeps for backward per token (module docstring: L)."""
    h, q, kv, i = shape.hidden, shape.query, shape.key_value, shape.intermediate
    small = 4 * shape.heads + 8  # SDPA's log-sum-exp per head, the norms' reciprocal RMS
    if not autocast:
        total = 4 * (6 * h + 2 * q + 2 * kv + 4 * i) + small
        norms = 4 * 2 * (q + kv) if shape.qk_norm else 0
    else:
        total = 2 * (4 + stream) * h + 5 * 2 * h + 4 * q + 4 * kv + 8 * i + small
        norms = (4 + 2) * (q + kv) if shape.qk_norm else 0
    return total + norms


def vocab_size(model: nn.Module) -> int:
    return model.get_output_embeddings().out_features


def layer_counts(model: nn.Module) -> dict[str, int]:
    """Decoder layers per part: prelude, core, coda (a baseline: its layers as a prelude)."""
    body = model.model
    if is_recurrent(model):
        return {"prelude": len(body.prelude), "core": len(body.core), "coda": len(body.coda)}
    return {"prelude": len(body.layers), "core": 0, "coda": 0}


# ---------------------------------------------------------------- which parts train, and what flows


def _numel(parameters) -> int:
    return sum(p.numel() for p in {id(p): p for p in parameters}.values())


def part_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    return {part: [p for m in modules for p in m.parameters()] for part, modules in part_modules(model).items()}


def gradient_flows(model: nn.Module) -> dict[str, bool]:
    """Per part, whether backward runs through it: some part at or before it in the forward trains."""
    flows, upstream = {}, False
    for part, parameters in part_parameters(model).items():  # part_modules lists the parts in forward order
        upstream = upstream or any(p.requires_grad for p in parameters)
        flows[part] = upstream
    return flows


# ---------------------------------------------------------------- the plan


def plan_memory(
    config: TrainConfig,
    model: nn.Module,
    seq_len: int,
    *,
    world: int = 1,
    device: str = "cuda",
    micro: int | None = None,
    teacher_parameters: int = 0,
) -> MemoryPlan:
    """The plan of a run of `config` training `model` (meta device is fine; its frozen parts `requires_grad`
    False, as `parts.select_parts` leaves them) on rows of `seq_len` tokens, per device of a `device` type, one
    of `world` processes; `micro` replaces the config's micro-batch, `teacher_parameters` sizes the teacher."""
    micro = micro or config.batch.micro
    autocast = trains_in_bf16(config.precision, device)
    fsdp = config.distributed == "fsdp" and world > 1
    shard = sharding_processes(config, world) if fsdp else 1
    k = split_depth(config.depth.mean_recurrence, config.depth.backprop_depth)[1] if is_recurrent(model) else 1
    trained = [p for p in model.parameters() if p.requires_grad]
    muon, adamw = _optimizer_bytes(config, model)
    tokens = micro * seq_len
    resident = dict(
        parameters=4 * _numel(model.parameters()) // shard,
        gradients=4 * _numel(trained) // shard,
        optimizer_muon=muon // shard,
        optimizer_adamw=adamw // shard,
        distributed=_distributed_bytes(config, model, world, autocast),
        teacher=_teacher_bytes(config, teacher_parameters, device) // shard,
    )
    step = _step_bytes(config, model, device, shard)
    return MemoryPlan(
        **resident,
        # FSDP2 gathers bf16 weights under bf16: autocast's cast of a bf16 weight is the weight itself, no copy
        autocast_copies=0 if fsdp else _autocast_copies(model, k, autocast, config.model.gradient_checkpointing),
        activations=tokens * _activation_bytes(config, model, k, autocast),
        readouts=tokens * _readout_bytes(config, model, k, autocast),
        logits_and_loss=_loss_bytes(config, model, tokens, autocast, device),
        optimizer_step=step,
        validation=validation_bytes(config, model, tokens, device),
        **(_fsdp_phase_bytes(config, model, tokens, k, autocast, shard, device) if fsdp else _NO_FSDP),
        micro=micro,
        seq_len=seq_len,
        k=k,
        world=world,
        strategy=config.distributed,
        autocast=autocast,
    )


def _optimizer_bytes(config: TrainConfig, model: nn.Module) -> tuple[int, int]:
    """(Muon's momentum, AdamW's two moments) over the trained weights each updates."""
    if config.optimizer.name != "muon":
        return 0, 8 * _numel(p for p in model.parameters() if p.requires_grad)
    matrices, others = split_parameters(model)
    return 4 * _numel(matrices), 8 * _numel(others)


def sharding_processes(config: TrainConfig, world: int) -> int:
    """The processes that share one sharded copy of the model under FSDP2: all of them, or under HSDP
    (`fsdp_shard_size`, by default a node's processes: torchrun's LOCAL_WORLD_SIZE, all of them in a dry run) a
    group of them. Each process holds 1/that of the sharded states; the all-reduce across the groups reduces the
    gradients' shard in place."""
    return fsdp_shard_size(config.fsdp_shard_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _distributed_bytes(config: TrainConfig, model: nn.Module, world: int, autocast: bool) -> int:
    if world <= 1:
        return 0
    if config.distributed == "ddp":
        return 4 * _numel(p for p in model.parameters() if p.requires_grad)
    units, _ = sharding_units(model, _by_layer(config))
    return _gathered_bytes(autocast) * _numel(_gathered_whole(model, units))


def _by_layer(config: TrainConfig) -> bool:
    return config.fsdp_units == "layer"


def _gathered_bytes(autocast: bool) -> int:
    """Bytes of a gathered weight and of its whole gradient: FSDP2's param_dtype (`fsdp_units`'
    MixedPrecisionPolicy: bf16 under bf16), in which autograd computes and accumulates the gradient too."""
    return 2 if autocast else 4


REDUCE_BYTES = 4  # FSDP2's reduce_dtype: float32 under bf16 (MixedPrecisionPolicy), the gradients' own in fp32


def _gathered_whole(model: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    """FSDP2: the weights of the recurrent body and the head (what `units` leaves them; a head tied to the token
    embeddings with them: one unit), gathered from their forward to the backward's final callback."""
    in_units = {id(p) for unit in units for p in unit.parameters()}
    return [p for p in model.parameters() if id(p) not in in_units]


def _sizes(modules: list[nn.Module]) -> tuple[int, int]:
    """(weights, trained weights) of `modules`, each weight once."""
    parameters = [p for module in modules for p in module.parameters()]
    return _numel(parameters), _numel(p for p in parameters if p.requires_grad)


_NO_FSDP = dict.fromkeys(
    ("body_all_gather", "all_gather_buffer", "unsharded_gradients", "beside_gradients", "reduce_scatter_buffer"), 0
)


def _fsdp_phase_bytes(
    config: TrainConfig, model: nn.Module, tokens: int, k: int, autocast: bool, shard: int, device: str
) -> dict[str, int]:
    """FSDP2's own buffers and the whole gradients, as torch's `_fully_shard` allocates them (the module
    docstring, "FSDP2", gives the sequence), at the phases `MemoryPlan.phases` adds them in; `shard` processes
    share a copy."""
    g, r = _gathered_bytes(autocast), REDUCE_BYTES

    def reducing(trained: int) -> int:
        """A unit's reduction (foreach_reduce): its fp32 reduce-scatter input, beside its gradients until they are
        copied in, then beside the 1/W output (and, over gloo on a CPU, the copy of the whole input its
        reduce_scatter_tensor makes; NCCL makes none)."""
        copy = r * trained if device == "cpu" else 0
        return r * trained + max(g * trained, r * trained // shard + copy)

    by_layer = _by_layer(config)
    units, body = sharding_units(model, by_layer)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embedding.weight is head.weight
    core = [] if body is None else list(body.core)
    per_use = [unit for unit in units if unit is not embedding]  # gathered in backward again (embeddings: not)
    once = [unit for unit in per_use if not any(unit is layer for layer in core)]
    # The units the final callback reduces, in FSDP2's order of states (the modules' order: the root's head, the
    # body, the token embeddings, or the tied pair): those whose inputs are token ids, which no backward hook
    # reduces earlier. (weights still gathered then, trained weights) of each.
    rest = [p for p in _gathered_whole(model, units) if p is not head.weight]  # the body's own
    rest_sizes = (_numel(rest), _numel(p for p in rest if p.requires_grad))
    late = [(0, 0), rest_sizes, _sizes([head])] if tied else [_sizes([head]), rest_sizes, (0, _sizes([embedding])[1])]
    whole = g * sum(trained for _, trained in late[:2])  # the head's and the body's (or the tied pair's) gradients
    whole += g * late[2][1] if tied else 0
    whole += g * _sizes(core)[1] if by_layer else 0  # FSDP2 reduces a unit used k times after its last use
    largest = max((_sizes([unit])[0] for unit in per_use), default=0)
    # foreach_all_gather gathers a unit into one flat output, which foreach_all_gather_copy_out splits into its
    # weights; FSDPParamGroup.wait_for_unshard frees it at the next unit's copy-out, the last one's at the root's
    # post-forward. The body is gathered first (its forward calls the others): its flat output and its weights at
    # once, before any activation.
    body_all_gather = g * rest_sizes[0]
    if by_layer:
        # The forward ends in the last coda layer: its flat output and its weights; in backward, the layer in use,
        # the next prefetched (its flat output) and one more the default prefetch gathers ahead
        # (FSDPParamGroup._backward_prefetch follows post_forward_order, whose uses without gradient count too)
        all_gather = 2 * g * largest
        units_beside = 3 * g * largest
    else:
        # The forward ends with the last prelude layer's flat output (the embeddings' without a prelude); in
        # backward, the body's pre-backward prefetches that layer again (its flat output)
        last = (once or [unit for unit in units if unit is embedding])[-1:]
        all_gather = g * sum(_sizes([unit])[0] for unit in last)
        units_beside = g * sum(_sizes([unit])[0] for unit in once[-1:])
    # A once-per-forward layer's backward (prelude; coda by layer): its weights and gradients, its fp32
    # reduce-scatter input (foreach_reduce allocates it for the unit in one piece, then frees the gradients; the
    # previous unit's is freed first, reduce_scatter_states keeping one) and the unit before it, prefetched (the
    # embeddings are not: their backward reads no weight, set_unshard_in_backward(False))
    sizes = [_sizes([unit]) for unit in per_use]
    once_window = max(
        (
            g * w + reducing(t) + g * (sizes[i - 1][0] if i else 0)
            for i, (unit, (w, t)) in enumerate(zip(per_use, sizes))
            if not any(unit is layer for layer in core)
        ),
        default=0,
    )
    core_gradients = g * _sizes(core)[1] if by_layer else 0
    # In the recurrence's backward a core layer's gradient of one use exists apart before autograd adds it to the
    # sum of the later uses' (AccumulateGrad's input buffer)
    fresh = g * max((_sizes([layer])[1] for layer in core), default=0) if k > 1 else 0
    backward = [  # the backward's phases, above the gathered units: whole gradients and what is beside them
        # the recurrence's backward past its last step (every core weight has its whole gradient now)
        whole + units_beside + fresh + tokens * _activation_bytes(config, model, k, autocast, beside_gradients=True),
        # a prelude layer's backward: the recurrence's activations freed
        whole + once_window + tokens * _prelude_bytes(config, model, autocast),
    ]
    if by_layer:  # the coda's backward, before the core's gradients exist
        activations = _activation_bytes(config, model, k, autocast) + _readout_bytes(config, model, k, autocast)
        backward.append(whole - core_gradients + max(once_window, units_beside) + tokens * activations)
    # The final callback (root_post_backward_final_callback): each unit's post_backward reshards its weights,
    # then foreach_reduce copies its gradients into one fp32 reduce-scatter input and frees them; the units after
    # it still hold their weights and gradients.
    final = 0
    for i, (_, trained) in enumerate(late):
        after = late[i + 1 :]
        final = max(final, g * sum(w + t for w, t in after) + reducing(trained))
    return dict(
        body_all_gather=body_all_gather,
        all_gather_buffer=all_gather,
        unsharded_gradients=whole,
        beside_gradients=max(0, max(backward) - whole),
        reduce_scatter_buffer=final,
    )


def _prelude_bytes(config: TrainConfig, model: nn.Module, autocast: bool) -> int:
    """Per token, what the prelude's layers keep for backward (all of it: a bound on what is left during it)."""
    if not gradient_flows(model).get("prelude", False):
        return 0
    shape, counts = layer_shape(model), layer_counts(model)
    return _stack_bytes(shape, counts["prelude"], autocast, 4, config.model.gradient_checkpointing) + 8


def _teacher_bytes(config: TrainConfig, teacher_parameters: int, device: str) -> int:
    if config.distill is None:
        return 0
    return teacher_parameters * teacher_dtype(config.distill, torch.device(device)).itemsize


def _autocast_copies(model: nn.Module, k: int, autocast: bool, checkpointing: bool = False) -> int:
    """bf16 copies of the matrices the forward multiplies by: once each trained one (autocast caches it), per
    use each frozen one that gradient flows through (not cached, kept for backward each time). Checkpointed
    layers keep none: backward casts one layer's again while recomputing it."""
    if not autocast:
        return 0
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    in_layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    flows, total = gradient_flows(model), 0
    for part, parameters in part_parameters(model).items():
        uses = k if part in ("core", "adapter") else 1
        for p in parameters:
            if p.ndim != 2 or (p is embeddings and p is not head) or (checkpointing and id(p) in in_layers):
                continue
            total += 2 * p.numel() * (1 if p.requires_grad else uses if flows[part] else 0)
    if checkpointing:
        total += 2 * max(
            (_numel(p for p in layer.parameters() if p.ndim == 2) for layer in decoder_layers(model)), default=0
        )
    return total


def _stream_bytes(model: nn.Module, autocast: bool) -> int:
    """Bytes of the residual stream in the core and coda: bf16 after a linear adapter under autocast (the
    prelude's stays float32, from the float32 embeddings)."""
    linear_adapter = is_recurrent(model) and isinstance(model.model.adapter, nn.Linear)
    return 2 if autocast and linear_adapter else 4


def _stack_bytes(shape: LayerShape, layers: int, autocast: bool, stream: int, checkpointing: bool) -> int:
    """Per token, what `layers` decoder layers keep: their activations, or their inputs under checkpointing."""
    if checkpointing:
        return layers * stream * shape.hidden
    return layers * layer_bytes(shape, autocast, stream)


def _readout_head_bytes(shape: LayerShape, autocast: bool, stream: int) -> int:
    """F: the final norm (a float32 input and its normalised output) and the head's input, per token."""
    return (4 + stream) * shape.hidden + (2 if autocast else 4) * shape.hidden + 4


def _activation_bytes(
    config: TrainConfig, model: nn.Module, k: int, autocast: bool, beside_gradients: bool = False
) -> int:
    """Per token: what the prelude, k recurrences with gradient, the coda and the final readout keep.
    `beside_gradients`: what is left of it once backward has been through the head, the coda and the last
    recurrence, when every weight of the recurrent body has its gradient."""
    shape, counts, flows = layer_shape(model), layer_counts(model), gradient_flows(model)
    checkpointing = config.model.gradient_checkpointing
    stream = _stream_bytes(model, autocast)
    total = 0
    if flows.get("prelude", flows.get("layers")):
        total += _stack_bytes(shape, counts["prelude"], autocast, 4, checkpointing)
    if is_recurrent(model):
        adapter = model.model.adapter
        steps = k - 1 if beside_gradients else k
        if any(p.requires_grad for p in adapter.parameters()):
            total += steps * 2 * shape.hidden * (2 if autocast else 4)
        if flows["core"]:
            total += steps * _stack_bytes(shape, counts["core"], autocast, stream, checkpointing)
        if flows["coda"] and not beside_gradients:
            total += _stack_bytes(shape, counts["coda"], autocast, stream, checkpointing)
    if checkpointing:  # one layer's activations exist while backward recomputes it
        total += layer_bytes(shape, autocast, 4)
    if any(p.requires_grad for p in model.get_input_embeddings().parameters()):
        total += 8  # the token ids the embedding keeps
    if beside_gradients and is_recurrent(model):
        return total
    return total + _readout_head_bytes(shape, autocast, stream if is_recurrent(model) else 4)


def _readout_bytes(config: TrainConfig, model: nn.Module, k: int, autocast: bool) -> int:
    """Per token, depth supervision's extra readouts: the coda, final norm and head input each (the head's loss
    reads each depth a chunk at a time: no logits)."""
    if not is_recurrent(model) or config.depth.supervise is None:
        return 0
    extra = len(supervised_steps((0, k), config.depth.supervise)) - 1
    shape, stream = layer_shape(model), _stream_bytes(model, autocast)
    coda = _stack_bytes(shape, layer_counts(model)["coda"], autocast, stream, config.model.gradient_checkpointing)
    return extra * (coda + _readout_head_bytes(shape, autocast, stream))


def loss_bytes(
    tokens: int, vocab: int, hidden: int, autocast: bool, *, distill: bool, head_trained: bool, teacher_itemsize: int
) -> int:
    """The head's loss at the start of backward (module docstring: logits and loss)."""
    c = 2 if autocast else 4
    buffers = 2 * 4 + (c if autocast else 0) + (5 * 4 if distill else 0)
    chunk = min(tokens, chunk_rows(vocab)) * vocab * buffers
    head_gradient = vocab * hidden * (4 + c) if head_trained else 0
    teacher = tokens * hidden * teacher_itemsize if distill else 0
    return chunk + head_gradient + tokens * hidden * 4 + teacher


def _loss_bytes(config: TrainConfig, model: nn.Module, tokens: int, autocast: bool, device: str) -> int:
    distill = config.distill is not None
    return loss_bytes(
        tokens,
        vocab_size(model),
        layer_shape(model).hidden,
        autocast,
        distill=distill,
        head_trained=model.get_output_embeddings().weight.requires_grad,
        teacher_itemsize=teacher_dtype(config.distill, torch.device(device)).itemsize if distill else 0,
    )


def validation_bytes(config: TrainConfig, model: nn.Module, tokens: int, device: str) -> int:
    """The validation forward's peak over the resident parts (module docstring: validation), at `tokens` per
    micro-batch."""
    autocast = trains_in_bf16(config.eval.precision or config.precision, device)
    shape, vocab = layer_shape(model), vocab_size(model)
    depths = len(set(config.eval.steps)) if is_recurrent(model) else 1
    stream = _stream_bytes(model, autocast)
    c = 2 if autocast else 4
    per_token = depths * 4 * shape.hidden + (4 + stream) * shape.hidden + layer_bytes(shape, autocast, stream)
    head_chunk = min(tokens, chunk_rows(vocab)) * vocab * (c + 4 + 4)
    casts = 0
    if autocast:
        layers = decoder_layers(model)
        largest = max((_numel(p for p in layer.parameters() if p.ndim == 2) for layer in layers), default=0)
        casts = 2 * (vocab * shape.hidden + largest)
    return tokens * per_token + head_chunk + casts


def _step_bytes(config: TrainConfig, model: nn.Module, device: str, shard: int) -> int:
    """The optimizer step's temporaries: AdamW's foreach buffers (on a GPU), Newton-Schulz's largest chunk."""
    muon, adamw = _optimizer_bytes(config, model)
    foreach = adamw // 2 // shard if device == "cuda" else 0  # one float32 buffer per weight
    if not muon:
        return foreach
    matrices, _ = split_parameters(model)
    largest = max(p.numel() for p in matrices)
    return foreach + 24 * max(min(NS_BATCH_ELEMENTS, 4 * largest), largest)


# ---------------------------------------------------------------- sizes


def gb(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


# ---------------------------------------------------------------- the paper recipes' headers

# What a paper recipe's header states: its plan on one 80 GB GPU of several under DDP (a device's plan is the
# same at any world size of 2 or more), at the recipes' --seq-len 1024.
PAPER_GPU_MEMORY = 80 * 10**9
PAPER_WORLD = 8
PAPER_SEQ_LEN = 1024


def planned_model(config: TrainConfig, model_config=None) -> nn.Module:
    """The model `config` trains (or `model_config` describes), built on the meta device from PLANNED_PARENTS with
    its frozen parts frozen: no download, no weights."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .initial_model import _restructure, planned_parts

    model_config = model_config or config.model
    settings = dict(PLANNED_PARENTS[model_config.path])
    with torch.device("meta"):
        parent = AutoModelForCausalLM.from_config(CONFIG_MAPPING[settings.pop("model_type")](**settings))
    model = _restructure(parent, model_config, config.depth, "paper", None, config.seed)
    return planned_parts(model, dataclasses.replace(config, model=model_config))


def recipe_plan(path: Path, micro: int | None = None, seq_len: int = PAPER_SEQ_LEN) -> MemoryPlan:
    """The plan of a recipe on one of PAPER_WORLD GPUs (at `micro`, else its own micro-batch) without download.
    A chained recipe (model.init_from) trains the model of the recipe whose `out` it continues."""
    from .config import load_config

    config = load_config(path)
    model_config = config.model
    if model_config.init_from is not None:
        earlier = (load_config(other) for other in sorted(path.parent.glob("*.yaml")))
        model_config = next(c.model for c in earlier if c.out == model_config.init_from)
    return plan_memory(config, planned_model(config, model_config), seq_len, world=PAPER_WORLD, micro=micro)


def recipe_header(plan: MemoryPlan) -> str:
    """The header line of a recipe that states its plan (`scripts/recipe_memory.py` writes the paper recipes')."""
    if plan.strategy == "fsdp":
        return (
            f"# Memory (`recurfit train RECIPE --dry-run --device-memory 80GB --world-size {plan.world}`): predicted "
            f"peak {gb(plan.peak)} per 80 GB GPU at micro-batch {plan.micro} of {plan.seq_len:,} tokens, k = "
            f"{plan.k}, {'bf16 autocast' if plan.autocast else 'fp32'}, FSDP2."
        )
    return (
        f"# Memory (`recurfit train RECIPE --dry-run --device-memory 80GB`): predicted peak {gb(plan.peak)} per "
        f"80 GB GPU at micro-batch {plan.micro}, k = {plan.k}, bf16 autocast, DDP."
    )
