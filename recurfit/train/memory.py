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
    FSDP2 gathered    g × (the recurrent body and the head: gathered from their forward to the end of their
                      backward) + g × the two largest consecutive once-per-forward units (token embeddings,
                      prelude layers: one gathered, the next prefetched), g = 2 when the units gather in bf16
                      (precision bf16), else 4; plus the unsharded gradients at the end of backward, 4 per
                      trained weight of the body and head (reduce-scattered last) and of the largest
                      once-per-forward unit (each reduce-scattered after its own backward)
    teacher           its weights, 2 or 4 bytes each (distill.dtype), / W under FSDP2
    autocast copies   2 per trained matrix weight (bf16 copies cached for the forward, kept for backward),
                      2 per frozen one per use that gradient flows through (checkpointed layers: one layer's)
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

    peak = parameters + gradients + optimizer + DDP/FSDP2 + teacher
           + max(autocast copies + activations + readouts + logits and loss, optimizer step, validation)

Gradients are counted during the forward: they persist from one micro-batch into the next whenever a process
runs two or more per step (a process with a single micro-batch peaks a little lower). The plan is checked
against measured peaks in benchmarks/memory_plan.py (docs/results/cpu-training.md, "The memory plan against
measured peaks").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..model.sampling import split_depth
from .config import TrainConfig
from .distributed import sharding_units
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
    unsharded_gradients: int  # FSDP2: the gathered units' whole gradients, at the end of backward
    activations_beside_them: int  # what forward saved and backward has not yet freed by then
    micro: int
    seq_len: int
    k: int
    world: int
    strategy: str
    autocast: bool

    RESIDENT = ("parameters", "gradients", "optimizer_muon", "optimizer_adamw", "distributed", "teacher")
    FORWARD_BACKWARD = ("autocast_copies", "activations", "readouts", "logits_and_loss")

    LATER = ("unsharded_gradients", "optimizer_step", "validation")  # peaks apart from the forward's

    @property
    def peak(self) -> int:
        resident = sum(getattr(self, name) for name in self.RESIDENT)
        transient = sum(getattr(self, name) for name in self.FORWARD_BACKWARD)
        backward = self.unsharded_gradients + self.autocast_copies + self.activations_beside_them
        return resident + max(transient, backward, self.optimizer_step, self.validation)

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
    shard = world if fsdp else 1
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
        autocast_copies=_autocast_copies(model, k, autocast, config.model.gradient_checkpointing),
        activations=tokens * _activation_bytes(config, model, k, autocast),
        readouts=tokens * _readout_bytes(config, model, k, autocast),
        logits_and_loss=_loss_bytes(config, model, tokens, autocast, device),
        optimizer_step=step,
        validation=validation_bytes(config, model, tokens, device),
        unsharded_gradients=_unsharded_gradient_bytes(config, model) if fsdp else 0,
        activations_beside_them=_activations_beside_gradients(config, model, tokens, k, autocast) if fsdp else 0,
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


def _distributed_bytes(config: TrainConfig, model: nn.Module, world: int, autocast: bool) -> int:
    if world <= 1:
        return 0
    if config.distributed == "ddp":
        return 4 * _numel(p for p in model.parameters() if p.requires_grad)
    units, _ = sharding_units(model, _by_layer(config))
    gathered = 2 if autocast else 4  # fsdp_units' MixedPrecisionPolicy
    return gathered * (_numel(_gathered_whole(model, units)) + _consecutive(units))


def _by_layer(config: TrainConfig) -> bool:
    return config.fsdp_units == "layer"


def _consecutive(units: list[nn.Module], trained: bool = False) -> int:
    """The weights (`trained`: the trained ones) of the two largest consecutive units: one gathered (or its
    gradients being reduced) while the next is prefetched (or computes its gradients)."""
    sizes = [_numel(p for p in unit.parameters() if p.requires_grad or not trained) for unit in units]
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))


def _gathered_whole(model: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    """FSDP2: the weights of the recurrent body and the head (what `units` leaves them), gathered from their
    forward to their backward."""
    in_units = {id(p) for unit in units for p in unit.parameters()}
    return [p for p in model.parameters() if id(p) not in in_units]


def _unsharded_gradient_bytes(config: TrainConfig, model: nn.Module) -> int:
    """FSDP2's whole gradients at their peak: of the recurrent body and the head (reduce-scattered last, as their
    forwards' inputs are token ids), at the end of backward, and of the largest once-per-forward unit (each
    reduce-scattered after its own backward). By layer, of the head, the body's rest, every core layer (FSDP2
    reduce-scatters a unit used several times once, after its last use's backward: the core's gradients are whole
    through the recurrence's backward) and two other layers."""
    units, _ = sharding_units(model, _by_layer(config))
    whole = _numel(p for p in _gathered_whole(model, units) if p.requires_grad)
    if _by_layer(config):
        core = {id(layer) for layer in model.model.core}
        once = [unit for unit in units if id(unit) not in core]
        recurring = _numel(p for layer in model.model.core for p in layer.parameters() if p.requires_grad)
        return 4 * (whole + recurring + _consecutive(once, trained=True))
    largest = max((_numel(p for p in unit.parameters() if p.requires_grad) for unit in units), default=0)
    return 4 * (whole + largest)


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


def _activations_beside_gradients(config: TrainConfig, model: nn.Module, tokens: int, k: int, autocast: bool) -> int:
    """FSDP2: what forward saved that is still held beside the unsharded gradients' peak: at the end of the
    recurrent unit's backward (module docstring); by layer, at any point of backward, all of it."""
    if _by_layer(config):
        return tokens * (_activation_bytes(config, model, k, autocast) + _readout_bytes(config, model, k, autocast))
    return tokens * _activation_bytes(config, model, k, autocast, beside_gradients=True)


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
