"""`RecurfitForCausalLM`: a recurfit folder served by vLLM, built from vLLM's own layers for the parent family.

    e   = prelude(embed(x))
    s_0 = 0                                    (state_init_std = 0; else a fresh truncated-normal draw)
    s_i = core(adapter([s_{i-1}; e]))          i = 1..r
    p   = lm_head(norm(coda(s_r)))

`RecurrentModel` runs the recurrence above, embedding to final norm: its body is the family's vLLM model
(LlamaModel, Qwen2Model, …) built on the recurfit folder's `text_config`, whose layers are the prelude, core and
coda in execution order; only its embedding, layers and final norm are used, in the order above, and its own
compiled forward is switched off. OLMo-2 and OLMo-3, for which vLLM has no model of their own, run on the
attention layers of vLLM's OLMo Hybrid model (`OlmoHybridModel`), which are OLMo-2's, with OLMo-3's sliding
windows and per-kind rotary embeddings set on its sliding layers. Each request names its r
(`recurfit.serving.depth`; default `mean_recurrence`, at most `max_recurrence`), and each token runs to its own
request's r:

Step s computes the tokens still short of their depth only (gathered, computed, scattered back), their
attention included (`RecurringRequests`: vLLM's CPU attention backend; with another backend, attention runs for
every token up to the batch's deepest). vLLM compiles three pieces (its default mode; `--enforce-eager` runs them
as they are): the prelude, one core step and the coda, each once whatever the depths served. A core layer's
attention is one opaque op (`recurfit::stepped_attention`) that runs the current step's vLLM `Attention` when it
is called, so one compiled core step serves every step and every depth. On a GPU the pieces are captured as
vLLM's piecewise CUDA graphs: a step over the whole batch replays them, reading its inputs from buffers of fixed
address (`Pieces`); a step over fewer tokens runs the compiled pieces without graphs.

KV cache, `cache_policy` "all" (default): each core layer's attention runs through r vLLM `Attention` layers,
one per step (its own name, hence its own paged KV cache): a token at step s attends to the earlier tokens'
step-s keys, which is what recurfit's `generate` computes with its `all` policy. `cache_policy` "latest"
(`--hf-overrides '{"cache_policy": "latest"}'`): one `Attention` per core layer, which every step overwrites,
as recurfit's `latest` policy; KV memory is that of a (P + R + C)-layer model instead of (P + R·r + C).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
from collections.abc import Iterable, Iterator

import torch
import vllm
from torch import nn
from vllm.compilation.backends import set_model_tag
from vllm.compilation.decorators import ignore_torch_compile, support_torch_compile
from vllm.config import CUDAGraphMode, VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available, override_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.v1.attention.backend import CommonAttentionMetadata

from ..defaults import ADAPTERS, CACHE_POLICIES
from ..model.families import attention_types
from ..model.modeling import _truncated_normal_by_inverse_cdf as truncated_normal_by_inverse_cdf
from . import check_vllm_version
from .depth import STEPPED_ATTENTION, Limits, table_for

# The parent families vLLM has layers for: model_type -> (vLLM module, the family's body class, its CausalLM
# class, whose weight mapper loads the body where the body has no `load_weights` of its own).
VLLM_FAMILIES = {
    "llama": ("vllm.model_executor.models.llama", "LlamaModel", "LlamaForCausalLM"),
    "mistral": ("vllm.model_executor.models.mistral", "MistralModel", "MistralForCausalLM"),
    "qwen2": ("vllm.model_executor.models.qwen2", "Qwen2Model", "Qwen2ForCausalLM"),
    "qwen3": ("vllm.model_executor.models.qwen3", "Qwen3Model", "Qwen3ForCausalLM"),
    "gemma": ("vllm.model_executor.models.gemma", "GemmaModel", "GemmaForCausalLM"),
    # vLLM has no OLMo-2/3 model: OLMo Hybrid's attention layers are OLMo-2's (q/k norms over all heads, norms
    # after attention and MLP), and none of its Gated DeltaNet layers is built where layer_types names none.
    "olmo2": ("vllm.model_executor.models.olmo_hybrid", "OlmoHybridModel", "OlmoHybridForCausalLM"),
    "olmo3": ("vllm.model_executor.models.olmo_hybrid", "OlmoHybridModel", "OlmoHybridForCausalLM"),
}
OLMO_HYBRID = {"olmo2", "olmo3"}  # families served by OlmoHybridModel's layers
# Settings OlmoHybridModel's layers fix (no biases, SiLU MLP), with the value they fix them to.
OLMO_HYBRID_FIXED = {"attention_bias": False, "hidden_act": "silu"}
# Families whose vLLM layers take one attention kind for every layer (vLLM asserts max_window_layers = layers).
ONE_ATTENTION_KIND = {"qwen2", "qwen3"}
SCALED_EMBEDDINGS = {"gemma"}  # families whose token embeddings are multiplied by sqrt(hidden_size)
# Attention metadata `RecurringRequests` narrows to some of a batch's requests (its fields read, its builder run, as
# the tests check); a backend not named here attends over every token of the batch at every step.
NARROWED_METADATA = {"CPUAttentionMetadata"}


def check_servable(config) -> None:
    """A ValueError in one line naming the setting when vLLM cannot serve this recurfit config as trained."""
    family = config.text_config.model_type
    if family not in VLLM_FAMILIES:
        raise ValueError(
            f"recurfit on vLLM: text_config.model_type {family!r} has no vLLM layers here; "
            f"served families: {', '.join(VLLM_FAMILIES)}."
        )
    kinds = set(getattr(config.text_config, "layer_types", None) or [])
    if family in ONE_ATTENTION_KIND and len(kinds) > 1:
        raise ValueError(
            f"recurfit on vLLM: text_config.layer_types mixes {sorted(kinds)}, which vLLM's {family} layers do not "
            "serve (the parent's use_sliding_window with max_window_layers below the layer count)."
        )
    if family in OLMO_HYBRID:
        _check_olmo_hybrid(config.text_config)
    policy = getattr(config, "cache_policy", "all")
    if policy not in CACHE_POLICIES:
        raise ValueError(f"recurfit on vLLM: cache_policy must be one of {CACHE_POLICIES}, got {policy!r}.")
    if not (isinstance(config.mean_recurrence, int) and config.mean_recurrence >= 1):
        raise ValueError(f"recurfit on vLLM: mean_recurrence must be an integer >= 1, got {config.mean_recurrence!r}.")
    if config.adapter not in ADAPTERS:
        raise ValueError(f"recurfit on vLLM: adapter {config.adapter!r} is not served ({', '.join(ADAPTERS)}).")


def _check_olmo_hybrid(text) -> None:
    """A ValueError naming the first OLMo setting that OlmoHybridModel's layers would silently compute otherwise."""
    for name, value in OLMO_HYBRID_FIXED.items():
        if getattr(text, name, value) != value:
            raise ValueError(f"recurfit on vLLM: text_config.{name} must be {value!r} for {text.model_type}.")
    head_dim = text.hidden_size // text.num_attention_heads
    if (getattr(text, "head_dim", None) or head_dim) != head_dim:
        raise ValueError(f"recurfit on vLLM: text_config.head_dim must be hidden_size / heads for {text.model_type}.")


def _rope_for(text, kind: str) -> dict:
    """A layer kind's rotary parameters: OLMo-3 keeps one set per kind, OLMo-2 one for all."""
    return text.rope_parameters.get(kind, text.rope_parameters)


def _olmo_hybrid_config(text):
    """OLMo-2/3's config as OlmoHybridModel reads it: a `layer_types` with no "linear_attention" (its Gated
    DeltaNet kind), so every layer is an attention one, and one flat `rope_parameters`, the full-attention
    layers' (`_fit_sliding_layers` gives OLMo-3's sliding layers theirs)."""
    body = copy.copy(text)
    body.layer_types = attention_types(text)
    body.rope_parameters = _rope_for(text, "full_attention")
    return body


def _fit_sliding_layers(body: nn.Module, text, vllm_config: VllmConfig) -> None:
    """OlmoHybridModel builds each attention layer without a window and with one rotary embedding: OLMo-3's
    sliding layers get a new `Attention` with their window under the same name (a window is fixed when the
    Attention is built, and each attention backend keeps it in its own form) and their kind's rotary embedding."""
    registered = get_current_vllm_config().compilation_config.static_forward_context
    for layer, kind in zip(body.layers, attention_types(text)):
        if kind != "sliding_attention":
            continue
        attention = layer.self_attn
        name = attention.attn.layer_name
        del registered[name]  # the new Attention registers itself under this name
        attention.attn = _attention_like(attention.attn, name, vllm_config, window=text.sliding_window)
        attention.rotary_emb = get_rope(
            attention.head_dim, attention.max_position_embeddings, rope_parameters=_rope_for(text, kind)
        )


def _body_config(vllm_config: VllmConfig, text_config) -> VllmConfig:
    """`vllm_config` seen by the family's body: the same settings, with the parent family's config as hf_config."""
    inner = copy.copy(vllm_config)
    model_config = copy.copy(vllm_config.model_config)
    object.__setattr__(model_config, "hf_config", text_config)
    object.__setattr__(inner, "model_config", model_config)
    return inner


@torch.library.custom_op(STEPPED_ATTENTION, mutates_args=("output",))
def stepped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer: str
) -> None:
    """A core layer's attention at the current step, written into `output`: opaque to the compiler, so that one
    compiled core step runs whichever step's `Attention` (KV cache) the step loop chose (`SteppedAttention.step`)
    when it is called.

    It runs between two segments of vLLM's piecewise CUDA graphs, and a segment's graph replays reading the
    addresses it was captured with. So, as vLLM's own `unified_attention_with_output`, it returns nothing and writes
    into an `output` allocated inside the compiled region (a fixed address under graphs); a tensor it returned would
    be allocated anew at each replay, and the next segment would read the one of its capture."""
    output.copy_(get_forward_context().no_compile_layers[layer].attend(query, key, value))


@stepped_attention.register_fake
def _(query, key, value, output, layer) -> None:
    return None


class SteppedAttention(nn.Module):
    """Stands in for a core layer's vLLM `Attention`: runs the one for the current step (`step`, 0-based), through
    `stepped_attention`, which finds it by its `layer_name` in the engine's forward context.

    A step that runs the core on some rows only (`rows`: the tokens not yet at their depth) gets their queries,
    keys and values; where the backend's metadata is not narrowed, attention runs on every token of the batch, the
    other tokens with the keys and values they had at their last step (`keep`), so what they write is what they
    wrote then (recurfit's latest-step rule), and only the rows' outputs go back."""

    def __init__(self, steps: list[nn.Module], vllm_config: VllmConfig):
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.layer_name = f"{steps[0].layer_name}.stepped"
        vllm_config.compilation_config.static_forward_context[self.layer_name] = self
        self.step = 0
        self.rows: torch.Tensor | None = None
        self.keep: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tracking = False  # keep each token's latest keys and values (steps on some rows only, not narrowed)

    def forward(self, query, key, value):
        output = torch.empty_like(query)  # attention's output has the queries' shape (heads × head size)
        stepped_attention(query, key, value, output, self.layer_name)
        return output

    def attend(self, query, key, value):
        attention = self.steps[self.step]
        if self.rows is None:
            if self.tracking:
                self.keep = (key, value)
            return attention(query, key, value)
        rows, (kept_key, kept_value) = self.rows, self.keep
        key = kept_key.index_copy(0, rows, key)
        value = kept_value.index_copy(0, rows, value)
        self.keep = (key, value)
        full_query = query.new_zeros((key.shape[0], *query.shape[1:])).index_copy(0, rows, query)
        return attention(full_query, key, value)[rows]


class RecurringRequests:
    """Recurrence steps' attention over the requests still short of their depth only (eager forwards).

    vLLM describes a batch to its attention backend once per forward: per layer, in the forward context, the
    backend's metadata (requests' query offsets, context lengths, block tables) and the cache slot of each token.
    Once some requests have reached their depth (`narrow_to`), `only` puts in place a description of the others,
    built from the batch's by the backend's own metadata builder: the requests past their depth then neither attend
    nor write keys and values, and their caches keep what their last step wrote (recurfit's cache policies: a step
    past a request's depth is never read by it, and a cached prefix is never shared between depths)."""

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.builders: dict = {}
        self.narrowed: dict[int, object] = {}  # per KV cache group (its layers share metadata and slots), built once
        self.depths = self.rows = None
        self.step = 0

    @staticmethod
    def narrowable(layer_name: str) -> bool:
        """Whether this forward's metadata for `layer_name` is of a backend `only` can narrow."""
        metadata = get_forward_context().attn_metadata
        return isinstance(metadata, dict) and type(metadata.get(layer_name)).__name__ in NARROWED_METADATA

    def narrow_to(self, depths: torch.Tensor, step: int, rows: torch.Tensor) -> None:
        """From now on, `only` describes the requests deeper than `step` (their tokens: `rows`)."""
        self.depths, self.step, self.rows, self.narrowed = depths, step, rows, {}

    @contextlib.contextmanager
    def only(self, layer_names: list[str]) -> Iterator[None]:
        """Within the block, `layer_names` attend for the requests `narrow_to` chose."""
        context = get_forward_context()
        metadata, slots = context.attn_metadata, context.slot_mapping
        saved = {name: (metadata[name], slots.get(name)) for name in layer_names}
        try:
            for name, (whole, slot) in saved.items():
                if id(whole) not in self.narrowed:
                    self.narrowed[id(whole)] = self._narrow(name, whole, self.depths, self.step, self.rows)
                metadata[name] = self.narrowed[id(whole)]
                if slot is not None:
                    if id(slot) not in self.narrowed:
                        self.narrowed[id(slot)] = slot[self.rows]
                    slots[name] = self.narrowed[id(slot)]
            yield
        finally:
            for name, (whole, slot) in saved.items():
                metadata[name] = whole
                if slot is not None:
                    slots[name] = slot

    def _narrow(self, layer_name: str, whole, depths: torch.Tensor, step: int, rows: torch.Tensor):
        """`whole`'s metadata for the requests whose depth exceeds `step` (each request's tokens are contiguous, and
        `rows` lists them in order)."""
        starts = whole.query_start_loc
        requests = (depths[starts[:-1]] > step).nonzero().squeeze(1)
        lengths = (starts[1:] - starts[:-1])[requests]
        query_start_loc = starts.new_zeros(requests.numel() + 1)
        torch.cumsum(lengths, 0, out=query_start_loc[1:])
        seq_lens = whole.seq_lens[requests]
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc.cpu(),
            seq_lens=seq_lens,
            num_reqs=requests.numel(),
            num_actual_tokens=rows.numel(),
            max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=whole.block_table[requests],
            slot_mapping=whole.slot_mapping[rows],
            causal=whole.causal,
        )
        return self._builder(layer_name, whole).build(common_prefix_len=0, common_attn_metadata=common)

    def _builder(self, layer_name: str, whole):
        """The backend's metadata builder for layers like `layer_name` (one per metadata type and window)."""
        layer = get_forward_context().no_compile_layers[layer_name]
        key = (type(whole), layer.sliding_window)
        if key not in self.builders:
            spec = layer.get_kv_cache_spec(self.vllm_config)
            builder = layer.attn_backend.get_builder_cls()
            self.builders[key] = builder(spec, [layer_name], self.vllm_config, whole.query_start_loc.device)
        return self.builders[key]


def _attention_like(attention: Attention, prefix: str, vllm_config: VllmConfig, window: int | None = None) -> Attention:
    """A new vLLM `Attention` with `attention`'s shape and window (or `window`), registered under `prefix` (its
    own KV cache)."""
    return Attention(
        attention.num_heads,
        attention.head_size,
        attention.impl.scale,
        num_kv_heads=attention.num_kv_heads,
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        logits_soft_cap=getattr(attention.impl, "logits_soft_cap", None),
        per_layer_sliding_window=window or attention.sliding_window,
        prefix=prefix,
        attn_type=attention.attn_type,
    )


def _uncompiled(body_class: type) -> type:
    """The family's body class without its own `@support_torch_compile`: `RecurrentModel` compiles the recurrence
    that calls its layers, and the body's forward never runs."""
    return ignore_torch_compile(type(f"Uncompiled{body_class.__name__}", (body_class,), {}))


class RecurrentModel(nn.Module):
    """prelude -> steps x (adapter + core) -> coda -> norm, each step on the tokens still short of their depth
    only, through the compiled `Pieces`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        text = config.text_config
        self.shape = P, R, C = config.shape
        self.max_recurrence = Limits.of(config).maximum
        self.policy = getattr(config, "cache_policy", "all")
        self.state_init_std = float(config.state_init_std)
        self.requests = RecurringRequests(vllm_config)
        module, body, _ = VLLM_FAMILIES[text.model_type]
        body_prefix = maybe_prefix(prefix, "body")
        body_class = _uncompiled(getattr(importlib.import_module(module), body))
        hybrid = text.model_type in OLMO_HYBRID
        body_text = _olmo_hybrid_config(text) if hybrid else text
        self.body = body_class(vllm_config=_body_config(vllm_config, body_text), prefix=body_prefix)
        if hybrid:
            _fit_sliding_layers(self.body, text, vllm_config)
        # Pre-norm bodies (Llama's, …) carry the residual apart, added by the next layer's norm; OLMo's post-norm
        # layers add it inside and return the whole state.
        self.residual_apart = "residual" in inspect.signature(self.body.layers[0].forward).parameters
        scale = config.embedding_scale
        if scale is None and text.model_type in SCALED_EMBEDDINGS:
            scale = text.hidden_size**0.5
        self.embed_scale = scale
        hidden = text.hidden_size
        # The linear adapter W [s; e] = W_s s + W_e e as its two halves: e, so W_e e, is the same at every step and
        # is multiplied once per forward (checkpoint's `adapter.weight` split as it loads). None: the Add adapter.
        self.adapter_state = self.adapter_embedded = None
        if config.adapter == "linear":
            self.adapter_state, self.adapter_embedded = (
                ReplicatedLinear(hidden, hidden, bias=False, prefix=maybe_prefix(prefix, f"adapter_{half}"))
                for half in ("state", "embedded")
            )
        # One Attention per (core layer, step): step 1 is the layer's own, steps 2..r are new ones whose names
        # carry one integer each, after the P + R + C layers' (vLLM orders KV caches by that integer).
        total = P + R + C
        for i in range(R):
            attn_holder = self.body.layers[P + i].self_attn
            own = attn_holder.attn
            steps = [own]
            if self.policy == "all":
                steps += [
                    _attention_like(own, f"{body_prefix}.recurrence.{total + (step - 2) * R + i}.attn", vllm_config)
                    for step in range(2, self.max_recurrence + 1)
                ]
            attn_holder.attn = SteppedAttention(steps, vllm_config)
        # Outside the module tree (they hold this module, not weights of their own)
        self.__dict__["pieces"] = Pieces(self, vllm_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.body.embed_tokens(input_ids)
        if self.embed_scale is not None:
            embedded = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        return embedded

    def _apply_layers(self, first: int, count: int, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Layers first..first+count-1 of the body, from and to a full hidden state (residual added)."""
        residual = None
        for layer in self.body.layers[first : first + count]:
            hidden, residual = self._layer(layer, positions, hidden, residual)
        return hidden if residual is None else hidden + residual

    def _layer(self, layer: nn.Module, positions, hidden, residual) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One body layer as (hidden, residual), their sum the state; a layer that adds the residual itself gets
        and gives the whole state in `hidden` (residual None)."""
        if self.residual_apart:
            return layer(positions, hidden, residual)
        return layer(positions, hidden), None

    def initial_state(self, e: torch.Tensor) -> torch.Tensor:
        """s_0: zeros when state_init_std is 0, else TruncNormal(0, σ², ±3σ) drawn here by the inverse CDF, as
        recurfit's compiled decoding draws it (`nn.init.trunc_normal_` branches on the data, which vLLM's compiled
        graph cannot hold); vLLM's RNG stream, not recurfit's: outputs then match recurfit's only in distribution."""
        if self.state_init_std == 0:
            return torch.zeros_like(e)
        return truncated_normal_by_inverse_cdf(e, self.state_init_std)

    def _embedded_part(self, e: torch.Tensor) -> torch.Tensor:
        """W_e e, computed once per forward (the Add adapter's part: e itself)."""
        return e if self.adapter_embedded is None else self.adapter_embedded(e)[0]

    def _adapt(self, state: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """The adapter's output at a step, W_s s + `part` (`_embedded_part`)."""
        return state + part if self.adapter_state is None else self.adapter_state(state)[0] + part

    def prelude(self, input_ids, positions, inputs_embeds) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding and prelude: s_0 and the adapter's embedded part (`_embedded_part`)."""
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        e = self._apply_layers(0, self.shape[0], positions, hidden)
        return self.initial_state(e), self._embedded_part(e)

    def core_step(self, positions, state, part) -> torch.Tensor:
        """One recurrence: adapter and core (each core layer's attention the step its `SteppedAttention` is at)."""
        P, R, _ = self.shape
        return self._apply_layers(P, R, positions, self._adapt(state, part))

    def coda(self, positions, state) -> torch.Tensor:
        P, R, C = self.shape
        return self.body.norm(self._apply_layers(P + R, C, positions, state))

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        depths: torch.Tensor,
        stops: tuple[int, ...] | None,
    ) -> torch.Tensor:
        """Embedding to final norm, each token recurring to its own `depths`; `stops` are the batch's distinct depths
        (on the host), None for vLLM's runs without requests (profiling, warm-up, graph capture), which run one
        step: the compiled pieces are the same at every step."""
        pieces = self.pieces
        state, part = pieces.prelude(input_ids, positions, inputs_embeds)
        state, part = pieces.fixed("state", state), pieces.fixed("part", part)
        state = self._recur(positions, state, part, depths, stops or (1,))
        return pieces.coda(positions, pieces.fixed("state", state))

    def _recur(self, positions, state, part, depths, stops: tuple[int, ...]) -> torch.Tensor:
        """Steps 1..max(stops), each on the tokens not yet at their depth only: the batch pays each request's own
        depth, attention included where the backend's metadata narrows (`RecurringRequests`), else attention for
        every token up to the deepest. Each time some tokens reach their depth, the others (`rows`) are gathered
        with their adapter parts and positions, and the states of all scattered back. A step over the whole batch
        reads and writes the pieces' fixed buffers (its CUDA graphs replay); a step over fewer tokens runs
        without graphs."""
        P, R, _ = self.shape
        pieces = self.pieces
        core = [self.body.layers[P + i].self_attn.attn for i in range(R)]
        layers = [[attention.layer_name for attention in stepped.steps] for stepped in core]
        narrow = RecurringRequests.narrowable(layers[0][0])
        rows = None  # the running tokens (None: all)
        running, running_part, running_positions, running_depths = state, part, positions, depths
        try:
            for stepped in core:
                stepped.tracking = not narrow
            for step in range(stops[-1]):
                if step in stops:
                    state = running if rows is None else state.index_copy(0, rows, running)
                    kept = (running_depths > step).nonzero().squeeze(1)
                    rows = kept if rows is None else rows[kept]
                    running, running_part, running_depths = running[kept], running_part[kept], running_depths[kept]
                    running_positions = positions[..., rows]
                    if narrow:
                        self.requests.narrow_to(depths, step, rows)
                slot = step if self.policy == "all" else 0
                for stepped in core:
                    stepped.step = slot
                    stepped.rows = None if narrow else rows
                if rows is None:
                    running = pieces.fixed("state", pieces.core_step(running_positions, running, running_part))
                    continue
                names = [names[slot] for names in layers]
                with self.requests.only(names) if narrow else contextlib.nullcontext(), without_cuda_graphs():
                    running = pieces.core_step(running_positions, running, running_part)
        finally:
            for stepped in core:
                stepped.step, stepped.tracking, stepped.rows, stepped.keep = 0, False, None, None
        return running if rows is None else state.index_copy(0, rows, running)

    # ------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], body_mapper) -> set[str]:
        """recurfit's tensors without their `model.` prefix: the adapter here, the rest through the body's loader
        (its q/k/v and gate/up stacking); returns the names loaded, relative to this module."""
        loaded: set[str] = set()
        body_weights = []
        for name, tensor in weights:
            if name == "adapter.weight" and self.adapter_state is not None:
                for half, columns in zip(("state", "embedded"), tensor.chunk(2, dim=1)):
                    param = getattr(self, f"adapter_{half}").weight
                    getattr(param, "weight_loader", _copy_loader)(param, columns.contiguous())
                    loaded.add(f"adapter_{half}.weight")
                continue
            body_name = self._body_name(name)
            if body_name is None:
                raise ValueError(f"recurfit on vLLM: unexpected tensor 'model.{name}' in the checkpoint.")
            body_weights.append((body_name, tensor))
        if hasattr(self.body, "load_weights"):
            body_loaded = self.body.load_weights(body_weights)
        else:  # GemmaModel: its CausalLM class loads it, with the q/k/v and gate/up stacking in its mapper
            body_loaded = AutoWeightsLoader(self.body).load_weights(body_weights, mapper=body_mapper)
        return loaded | {f"body.{name}" for name in body_loaded}

    def _body_name(self, name: str) -> str | None:
        """recurfit's `{prelude,core,coda}.i.…` as the body's `layers.j.…` (j in execution order)."""
        P, R, _ = self.shape
        parts = name.split(".")
        if parts[0] in ("prelude", "core", "coda"):
            offset = {"prelude": 0, "core": P, "coda": P + R}[parts[0]]
            return ".".join(["layers", str(offset + int(parts[1])), *parts[2:]])
        if parts[0] in ("embed_tokens", "norm"):
            return name
        return None


def cuda_graphs_replay() -> bool:
    """Whether this forward runs under vLLM's CUDA graphs (captured or replayed; never on a CPU)."""
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


@contextlib.contextmanager
def without_cuda_graphs() -> Iterator[None]:
    """Within the block, compiled pieces run without CUDA graphs: a graph is captured per batch size (vLLM's
    batch descriptor), and a step over some of the batch's tokens has another size than the batch."""
    if not cuda_graphs_replay():
        yield
        return
    context = dataclasses.replace(get_forward_context(), cudagraph_runtime_mode=CUDAGraphMode.NONE)
    with override_forward_context(context):
        yield


class Piece(nn.Module):
    """A piece of `RecurrentModel` for vLLM to compile: each subclass has a forward (a code object, hence a compiled
    graph) of its own, and its token dimension, which vLLM compiles as dynamic, in its decorator."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", recurrence: RecurrentModel):
        super().__init__()
        self.recurrence = recurrence


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class CompiledPrelude(Piece):
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None):
        return self.recurrence.prelude(input_ids, positions, inputs_embeds)


@support_torch_compile(dynamic_arg_dims={"positions": -1, "state": 0, "part": 0})
class CompiledCoreStep(Piece):
    def forward(self, positions: torch.Tensor, state: torch.Tensor, part: torch.Tensor):
        return self.recurrence.core_step(positions, state, part)


@support_torch_compile(dynamic_arg_dims={"positions": -1, "state": 0})
class CompiledCoda(Piece):
    def forward(self, positions: torch.Tensor, state: torch.Tensor):
        return self.recurrence.coda(positions, state)


class Pieces:
    """The recurrence's three pieces as vLLM compiles them (each once, on its first call, whatever the depths served;
    under `--enforce-eager` they run as they are), and the buffers whose addresses their CUDA graphs read.

    Under vLLM's piecewise CUDA graphs a piece's graph replays reading the input addresses it was captured with,
    and its outputs live in a pool later graphs reuse. The core step runs several times per forward on the
    previous step's output, so every piece reads its state from a buffer of fixed address, and each output is
    copied there before the next piece runs (`fixed`; on a CPU, without graphs, nothing is copied)."""

    def __init__(self, recurrence: RecurrentModel, vllm_config: VllmConfig):
        self.size = vllm_config.scheduler_config.max_num_batched_tokens
        self.buffers: dict[str, torch.Tensor] = {}
        for name, cls in (("prelude", CompiledPrelude), ("core_step", CompiledCoreStep), ("coda", CompiledCoda)):
            with set_model_tag(f"recurfit_{name}"):  # its compiled artifacts cached apart from the others'
                setattr(self, name, cls(vllm_config=vllm_config, recurrence=recurrence))

    def fixed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the first rows of the buffer `name` while CUDA graphs run, else `tensor` itself."""
        if not cuda_graphs_replay():
            return tensor
        buffer = self.buffers.get(name)
        if buffer is None:  # vLLM's batches hold at most max_num_batched_tokens tokens: allocated once
            size = max(self.size, tensor.shape[0])
            buffer = self.buffers[name] = tensor.new_empty((size, *tensor.shape[1:]))
        view = buffer[: tensor.shape[0]]
        return view if view.data_ptr() == tensor.data_ptr() else view.copy_(tensor)


class RecurfitForCausalLM(nn.Module):
    """A recurfit folder (model_type "recurfit") as a vLLM model; see the module docstring."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        check_vllm_version(vllm.__version__)  # here, not at plugin load: other models in the same vLLM still serve
        config = vllm_config.model_config.hf_config
        check_servable(config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("recurfit on vLLM: pipeline_parallel_size > 1 is not served (the core loops over itself).")
        self.config = config
        self.vllm_config = vllm_config  # its engine's key to the V1 runner's depth table (`table_for`)
        self.limits = Limits.of(config)
        text = config.text_config
        module, _, causal_lm = VLLM_FAMILIES[text.model_type]
        self.body_mapper = getattr(getattr(importlib.import_module(module), causal_lm), "hf_to_vllm_mapper", None)
        self.model = RecurrentModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.body.embed_tokens)
        self.logits_processor = LogitsProcessor(text.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    @staticmethod
    def get_model_state_cls() -> type:
        """Model Runner V2's hook: the state that carries each request's depth to `forward`."""
        from .model_state import RecurfitModelState

        return RecurfitModelState

    def forward(
        self,
        input_ids,
        positions,
        intermediate_tensors=None,
        inputs_embeds=None,
        token_depths: torch.Tensor | None = None,
        depth_stops: tuple[int, ...] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """vLLM's call (its other keyword arguments unused), each token at the depth of the request it belongs to.
        Model Runner V2 passes the depths (`RecurfitModelState.prepare_inputs`; `depth_stops` None for a batch of
        no request); under the V1 runner they come from the engine's `RequestDepth`."""
        if token_depths is None:
            token_depths, depth_stops = self.token_depths(positions.shape[-1])
        return self.model(input_ids, positions, inputs_embeds, token_depths, depth_stops)

    def token_depths(self, num_tokens: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """Under the V1 runner: each token's depth and the batch's distinct depths (None for a batch without
        requests), from the depths the engine's `RequestDepth` keeps per batch row."""
        meta = get_forward_context().attn_metadata if is_forward_context_available() else None
        query_start_loc = next(iter(meta.values())).query_start_loc if isinstance(meta, dict) and meta else None
        return table_for(self.vllm_config).token_depths(query_start_loc, num_tokens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        model_weights = []
        for name, tensor in weights:
            if name.startswith("model."):
                model_weights.append((name.removeprefix("model."), tensor))
            elif name == "lm_head.weight":
                if not self.config.tie_word_embeddings:
                    getattr(self.lm_head.weight, "weight_loader", _copy_loader)(self.lm_head.weight, tensor)
                    loaded.add(name)
            else:
                raise ValueError(f"recurfit on vLLM: unexpected tensor {name!r} in the checkpoint.")
        model_loaded = self.model.load_weights(model_weights, self.body_mapper)
        return loaded | {f"model.{name}" for name in model_loaded}


def _copy_loader(param: torch.Tensor, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
