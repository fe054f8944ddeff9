"""`RecurrentForCausalLM`: prelude → (adapter + core) × r → coda, built from a parent family's own layers.

    e   = prelude(embed(x))
    s_0 ~ TruncNormal(0, σ², ±3σ)             (zeros when σ = 0)
    s_i = core(adapter([s_{i-1}; e]))          i = 1..r
    p   = lm_head(norm(coda(s_r)))

The decoder layers are the parent family's classes from transformers (LlamaDecoderLayer, Olmo2DecoderLayer,
…), so attention backends, RoPE variants, QK-norm and post-norm behave exactly as in the parent. The
attention masks and rotary embeddings are computed once per forward and shared by every layer and step.

With bf16 (or fp16) weights the residual stream, e and the state stay in float32 and the layers' matrix products
run in the weights' dtype under autocast, as in training (float32 weights under bf16 autocast); the state is
rounded only in the adapter, once per step. (Without gradient the adapter's W_e e is computed once per token and
W_s s at each step: each rounds once and their sum stays float32.) A pure bf16 stream would round it at each of the
P + r·R + C residual adds (264 at r = 32 for a (4, 8, 4) shape), losing updates smaller than bf16's resolution. The
body's final hidden states come back in the weights' dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .adapter import AddAdapter, LinearAdapter
from .attention import PACKED_SDPA
from .cache import RecurrentCache
from .compat import CACHE_ARG, cache_kwargs, take_cache
from .compiled import decoding_cache, decoding_loop, loop_may_run
from .config import RecurrentConfig
from .families import FAMILIES, attention_types
from .layer_inputs import positions_from_mask, select_rows
from .sampling import parse_num_steps, sample_depth
from .static_cache import StaticRecurrentCache

_MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


@dataclass
class RecurrentModelOutput(BaseModelOutputWithPast):
    """The body's output: `last_hidden_state` (after the final norm) plus the depth run, as in
    `RecurrentCausalLMOutput`."""

    num_steps: tuple[int, int] | None = None
    steps_per_token: torch.LongTensor | None = None
    readout_hidden_states: tuple[torch.Tensor, ...] | None = None  # final hidden states after each `readout_steps`


@dataclass
class RecurrentCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the depth actually run: `num_steps = (n, k)`.

    With `output_hidden_states=True`, `hidden_states` holds the recurrent state after every step (r tensors).
    """

    num_steps: tuple[int, int] | None = None
    steps_per_token: torch.LongTensor | None = None  # per row: steps its last position ran (adaptive depth)
    readout_logits: tuple[torch.Tensor, ...] | None = None  # the logits after each of `readout_steps`


class RecurrentPreTrainedModel(PreTrainedModel):
    config_class = RecurrentConfig
    config: RecurrentConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = [CACHE_ARG]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: RecurrentConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # PreTrainedModel settles the attention backend on the top config only, but the family's layers read
        # it from text_config: without this, a loaded model would silently fall back to eager attention.
        config.text_config._attn_implementation_internal = config._attn_implementation

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, FAMILIES[self.config.text_config.model_type].rotary_embedding):
            # RoPE frequencies are non-persistent buffers, never loaded: recompute them the family's own way
            # (the generic init misses families with one set per layer type, like OLMo-3).
            for name, value in type(module)(config=module.config).named_buffers():
                module.get_buffer(name).copy_(value)
        if isinstance(module, LinearAdapter):
            # At init the adapter passes the prelude output through, so the state starts out ignored.
            module.reset_to_identity()


class RecurrentModel(RecurrentPreTrainedModel):
    """The body: embeddings, prelude, adapter, core, coda and final norm (no head)."""

    def __init__(self, config: RecurrentConfig):
        super().__init__(config)
        text = config.text_config
        family = FAMILIES[text.model_type]
        self._no_split_modules = [family.decoder_layer.__name__]
        self.family_embed_scale = text.hidden_size**0.5 if family.scale_embeddings else None
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size, getattr(text, "pad_token_id", None))
        # Each layer gets its position in execution order as `layer_idx`, so its config fields
        # (text_config.layer_types[i]) and KV-cache slot are its own.
        P, R, C = config.shape
        self.prelude = nn.ModuleList(family.decoder_layer(text, i) for i in range(P))
        self.adapter = LinearAdapter(text.hidden_size) if config.adapter == "linear" else AddAdapter()
        self.core = nn.ModuleList(family.decoder_layer(text, P + i) for i in range(R))
        self.coda = nn.ModuleList(family.decoder_layer(text, P + R + i) for i in range(C))
        self.norm = family.norm(text.hidden_size, eps=text.rms_norm_eps)
        self.rotary_emb = family.rotary_embedding(config=text)
        self.layer_attention = attention_types(text)
        # Some families (OLMo-3 in recent transformers) keep one RoPE setting per attention kind.
        self.rope_per_layer_type = isinstance(getattr(self.rotary_emb, "rope_type", None), dict)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @property
    def embed_scale(self) -> float | None:
        """The factor on token embeddings: the config's `embedding_scale`, else the family's own (or none)."""
        scale = self.config.embedding_scale
        return scale if scale is not None else self.family_embed_scale

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            embedded = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        return embedded

    def initial_state(self, embedded: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """s_0: truncated normal N(0, σ²) cut at ±3σ, or zeros when `config.state_init_std` is 0."""
        std = self.config.state_init_std
        state = torch.zeros_like(embedded)
        if std > 0 and torch.compiler.is_compiling():
            return _truncated_normal_by_inverse_cdf(state, std)
        if std > 0:
            nn.init.trunc_normal_(state, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        return state

    def _apply_layers(
        self, layers: nn.ModuleList, first: int, hidden: torch.Tensor, inputs: dict, **kwargs
    ) -> torch.Tensor:
        """Apply `layers` (the first has index `first` in execution order), each with its attention kind's inputs."""
        with self.low_precision_products():
            for index, layer in enumerate(layers, start=first):
                hidden = layer(hidden, **inputs[self.layer_attention[index]], **kwargs)
        return hidden

    def _autocasts_itself(self) -> bool:
        """bf16 or fp16 weights with no autocast on (a low-precision model at inference): the model enters autocast
        itself and keeps its stream in float32. Under an outer autocast (training; FSDP2's bf16-gathered weights) the
        numbers are training's."""
        weights = self.embed_tokens.weight
        return weights.dtype != torch.float32 and not torch.is_autocast_enabled(weights.device.type)

    def low_precision_products(self) -> contextlib.AbstractContextManager:
        """Autocast to the weights' dtype where the model autocasts itself: matrix products in that dtype, the float32
        stream kept (entered per layer block, never around a `yield`: autocast is thread state)."""
        if not self._autocasts_itself():
            return contextlib.nullcontext()
        weights = self.embed_tokens.weight
        return torch.autocast(weights.device.type, dtype=weights.dtype)

    def _rope(self, embedded, position_ids, *kind) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embeddings (cos, sin); where the model autocasts itself (bf16 or fp16 weights at inference), in
        the weights' dtype. The stream is float32, so RoPE would otherwise turn the queries and keys (from
        low-precision products) into float32 while the values stay in low precision, and an attention that
        autocast does not cover (flex_attention) would get two dtypes: on CUDA it then computes wrong logits. The
        parent in bf16 rotates in bf16 too. (Training's autocast casts SDPA's inputs to one dtype itself.)"""
        rope = self.rotary_emb(embedded, position_ids, *kind)
        if not self._autocasts_itself():
            return rope
        return tuple(part.to(self.embed_tokens.weight.dtype) for part in rope)

    def attention_inputs(self, embedded, attention_mask, position_ids, cache=None, masks=None) -> dict[str, dict]:
        """Mask and rotary embeddings for each attention kind present, computed once per forward (`masks`: the
        masks per kind, already built)."""
        text = self.config.text_config
        shared_rope = None if self.rope_per_layer_type else self._rope(embedded, position_ids)
        return {
            kind: {
                "attention_mask": masks[kind]
                if masks is not None
                else _MASK_BUILDERS[kind](
                    config=text,
                    inputs_embeds=embedded,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    **cache_kwargs(cache),
                ),
                "position_embeddings": shared_rope or self._rope(embedded, position_ids, kind),
            }
            for kind in set(self.layer_attention)
        }

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        num_steps=None,
        initial_state: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        cache: RecurrentCache | None = None,
        past_key_values: RecurrentCache | None = None,
        exit_rule=None,
        lm_head: nn.Module | None = None,
        warm_start: bool = False,
        readout_steps: Sequence[int] = (),
        **kwargs,
    ) -> RecurrentModelOutput:
        """e = prelude(embed(x)); s_i = core(adapter(s_{i-1}, e)) for i = 1..r; hidden = norm(coda(s_r)).

        With a `RecurrentCache`, `input_ids` are the new tokens and `attention_mask` covers past and new.
        Decoding one token at a time, `exit_rule` (see `recurfit.generation.exit`) may stop rows early, reading
        their next-token logits through `lm_head`; `warm_start` starts s_0 from the previous token's final state.
        `readout_steps` (each < n + k): also read the coda out after these recurrences, within the same pass
        (with gradient where the step has it: depth supervision), as `readout_hidden_states`; with a cache, each
        readout is what an exit rule reads (the earlier tokens' final coda entries; nothing kept in the cache)."""
        cache = take_cache(past_key_values, cache)
        n, k = self.resolve_num_steps(num_steps)
        if any(not 1 <= step < n + k for step in readout_steps):
            raise ValueError(f"readout_steps {list(readout_steps)} must lie in [1, {n + k}) for num_steps {(n, k)}")
        embedded, layer_kwargs = self._prepare(input_ids, inputs_embeds, attention_mask, position_ids, cache, kwargs)
        e = self._apply_layers(self.prelude, 0, embedded, **layer_kwargs)
        decoding = cache is not None and embedded.shape[1] == 1
        if initial_state is None and warm_start and decoding and cache.final_state is not None:
            initial_state = cache.final_state  # continuous compute: carry the previous token's s_r forward
        s0 = self.initial_state(e) if initial_state is None else initial_state
        tracker = exit_rule.start(s0.shape[0], s0.device) if exit_rule is not None and decoding else None
        states, hidden_at_readout_steps = [], []
        for step, state in enumerate(
            self.recur(s0, e, layer_kwargs, n + k, no_grad_steps=n, cache=cache, tracker=tracker, lm_head=lm_head),
            start=1,
        ):
            if output_hidden_states:
                states.append(state)
            if step in readout_steps:  # with a cache, a look that keeps nothing: the coda caches s_r's entries only
                hidden_at_readout_steps.append(
                    self._coda(state, layer_kwargs)
                    if cache is None
                    else self._coda_probe(state, cache, layer_kwargs, None, len(state))
                )
        if cache is not None:
            cache.keep_final_state(state)
            cache.end_forward()
        steps = tracker.steps if tracker is not None else torch.full(state.shape[:1], n + k, device=state.device)
        return RecurrentModelOutput(
            last_hidden_state=self._coda(state, layer_kwargs),
            **cache_kwargs(cache),
            hidden_states=tuple(states) if output_hidden_states else None,
            num_steps=(n, k),
            steps_per_token=steps,
            readout_hidden_states=tuple(hidden_at_readout_steps) if readout_steps else None,
        )

    def recur(self, state, e, layer_kwargs, steps, no_grad_steps=0, cache=None, tracker=None, lm_head=None):
        """The recurrence: yields s_i = core(adapter(s_{i-1}, e)) for i = 1..steps.

        The first `no_grad_steps` run without gradient (truncated backprop). The cache learns which step each
        core layer is in; with an exit `tracker`, rows that settled keep their state and drop out of the core's
        batch, or stay in it frozen (`tracker.frozen`), and the loop ends once every row has settled."""

        def next_token_logits(state_of_rows, rows):  # the exit rule's look at the distribution (kl, argmax)
            return float32_logits(lm_head, self._coda_probe(state_of_rows, cache, layer_kwargs, rows, batch))

        batch = state.shape[0]
        # Without gradient (inference), W_e e is computed here once: e, so W_e e, is the same at every step, and each
        # step multiplies only W_s s. A forward with gradient (training) multiplies [s; e] at every step, those
        # without gradient included, as it always has: its rounding, and the tensors the memory plan counts.
        part = None if torch.is_grad_enabled() else self.embedded_part(e)
        for step in range(1, steps + 1):
            rows = tracker.active if tracker is not None else None  # None: every row recurs
            frozen = tracker.frozen if tracker is not None else None  # rows that recur but keep their state
            if cache is not None:
                cache.begin_step(step, rows, frozen)
            if step == no_grad_steps + 1 and no_grad_steps and torch.is_grad_enabled():
                forget_gradless_casts(state.device.type)
            with torch.set_grad_enabled(torch.is_grad_enabled() and step > no_grad_steps):
                previous, state = state, self._core_step(state, e, layer_kwargs, rows, part)
            if frozen is not None:
                state = torch.where(frozen[:, None, None], previous, state)
            if tracker is not None:
                tracker.check(step, previous, state, next_token_logits)
            yield state
            if tracker is not None and tracker.finished(step):
                break
        if cache is not None:
            cache.end_core(step)

    @torch.no_grad()
    def final_hidden_states_at(
        self,
        input_ids: torch.LongTensor,
        steps: Sequence[int],
        attention_mask: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """`(r, final hidden states after r recurrences)` for each r in `steps`, in increasing order.

        One pass through the recurrence up to the largest r, reading the coda out on the way: the prelude runs
        once and the core max(steps) times, instead of once per r and sum(steps) times; every readout starts
        from the same s_0 (drawn with `generator` unless given). Each r's hidden states equal
        `forward(num_steps=r, initial_state=s_0)`'s."""
        embedded, layer_kwargs = self._prepare(input_ids, None, attention_mask, None, None, {})
        e = self._apply_layers(self.prelude, 0, embedded, **layer_kwargs)
        s0 = self.initial_state(e, generator) if initial_state is None else initial_state
        wanted = set(steps)
        for step, state in enumerate(self.recur(s0, e, layer_kwargs, max(wanted)), start=1):
            if step in wanted:
                yield step, self._coda(state, layer_kwargs)

    def _prepare(
        self, input_ids, inputs_embeds, attention_mask, position_ids, cache, kwargs
    ) -> tuple[torch.Tensor, dict]:
        """The embedded tokens, and what every layer receives: masks, rotary embeddings, positions, the cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        # The stream in float32 from the start, so rotary embeddings and masks are built as in training.
        embedded = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds).float()
        if isinstance(cache, StaticRecurrentCache):
            cache.check_device(embedded.device)
            # Positions and masks come from the cache's device-side bookkeeping: nothing here waits on the host.
            static_positions, masks = cache.begin_forward(
                attention_mask, embedded.shape[1], self.layer_attention, self._static_mask_format(embedded.dtype)
            )
            position_ids = static_positions if position_ids is None else position_ids
            inputs = self.attention_inputs(embedded, attention_mask, position_ids, cache, masks)
        else:
            if position_ids is None:
                past = cache.get_seq_length() if cache is not None else 0
                position_ids = positions_from_mask(attention_mask, embedded.shape[1], embedded.device, past)
            inputs = self.attention_inputs(embedded, attention_mask, position_ids, cache)
            if cache is not None:
                cache.begin_forward()
        if cache is not None:
            kwargs = dict(kwargs, **cache_kwargs(cache))
        return embedded, dict(inputs=inputs, position_ids=position_ids, **kwargs)

    def _static_mask_format(self, dtype: torch.dtype) -> torch.dtype:
        """The 4-D mask a static cache builds: booleans for SDPA, additive floats for eager attention."""
        backend = self.config.text_config._attn_implementation
        if backend == PACKED_SDPA:  # SDPA as compiled decoding runs it (recurfit.model.attention)
            backend = "sdpa"
        if backend not in ("sdpa", "eager"):
            raise ValueError(
                f"StaticRecurrentCache builds masks for sdpa and eager attention, not {backend!r}; load the model "
                "with attn_implementation='sdpa'."
            )
        return torch.bool if backend == "sdpa" else dtype

    def embedded_part(self, e: torch.Tensor) -> torch.Tensor:
        """The adapter's term in e alone (W_e e; e itself for the add adapter), in the stream's dtype: fixed across
        a token's steps, so computed once per forward for `_core_step`'s `part`."""
        with self.low_precision_products():
            part = self.adapter.embedded_part(e)
        return part.float() if self._autocasts_itself() else part

    def _core_step(self, state: torch.Tensor, e, layer_kwargs: dict, rows=None, part=None) -> torch.Tensor:
        """s_i = core(adapter(s_{i-1}, e)), computed for `rows` only when given (the others keep s_{i-1}). With
        `part` (`embedded_part(e)`, of the whole batch) the adapter adds it to W_s s and `e` is not read."""
        if rows is not None:
            running = self._core_step(
                state[rows],
                None if e is None else e[rows],
                select_rows(layer_kwargs, rows, len(state)),
                part=None if part is None else part[rows],
            )
            return state.index_copy(0, rows, running)
        upcast = self._autocasts_itself()
        with self.low_precision_products():
            mixed = self.adapter(state, e) if part is None else self.adapter.mix(state, part)
        if upcast:
            # Keep the core's stream in float32. (Training's autocast leaves it in bf16 after a linear adapter, as the
            # memory plan counts; a model at inference saves no activations.)
            mixed = mixed.float()
        return self._apply_layers(self.core, self.config.num_prelude_layers, mixed, **layer_kwargs)

    def _coda(self, state: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        """The final hidden states from s_r, in the weights' dtype (what the head multiplies)."""
        P, R, _ = self.config.shape
        with self.low_precision_products():
            hidden = self.norm(self._apply_layers(self.coda, P + R, state, **layer_kwargs))
        return hidden.to(self.embed_tokens.weight.dtype)

    def _coda_probe(self, state, cache, layer_kwargs, rows, batch: int):
        """The final hidden states of `rows` of the batch (None: all) if the recurrence stopped at `state`, which
        holds only those rows; nothing is kept in the cache."""
        with cache.probe(rows):
            return self._coda(state, layer_kwargs if rows is None else select_rows(layer_kwargs, rows, batch))

    def resolve_num_steps(self, num_steps) -> tuple[int, int]:
        """`num_steps` as `(n, k)`. Unset: a sampled depth in training, `config.mean_recurrence` otherwise."""
        if num_steps is not None:
            return parse_num_steps(num_steps)
        if self.training and torch.is_grad_enabled():
            return sample_depth(self.config.mean_recurrence, self.config.backprop_depth)
        return 0, self.config.mean_recurrence


# Head weights an exit probe upcasts to float32 at a time (16 MiB; a 128k x 2048 head whole would be 1 GiB).
PROBE_CHUNK_ELEMENTS = 1 << 22


def float32_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)` as float32: the exact products of the hidden states and a low-precision head's weights (a bf16
    times a bf16 is exact in float32), summed in float32 and not rounded back to the weights' dtype, a slice of the
    vocabulary at a time. An exit probe compares consecutive steps' distributions (KL against 5e-4 by default), so
    bf16 logits (relative rounding 2^-9) would add noise near its threshold; the model's output logits stay as they
    are. A head that is not a plain linear layer (an adapter-wrapped one) is called as it is."""
    weight = getattr(head, "weight", None)
    if (
        not isinstance(head, nn.Linear)
        or weight.dtype == torch.float32
        and not torch.is_autocast_enabled(weight.device.type)
    ):
        return head(hidden).float()
    bias = None if head.bias is None else head.bias.float()
    rows = max(1, PROBE_CHUNK_ELEMENTS // weight.shape[1])
    with torch.autocast(weight.device.type, enabled=False):
        hidden = hidden.float()
        chunks = [F.linear(hidden, part.float()) for part in weight.split(rows)]
        logits = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)
    return logits if bias is None else logits + bias


def _truncated_normal_by_inverse_cdf(like: torch.Tensor, std: float) -> torch.Tensor:
    """TruncNormal(0, std², ±3 std) by the inverse CDF: the distribution `nn.init.trunc_normal_` draws, without the
    data-dependent check in its sampler (`if not mask.any()` in recent torch), which no compiled graph can hold."""
    low = 0.5 * math.erfc(3 / math.sqrt(2))  # Φ(-3)
    uniform = torch.empty(like.shape, dtype=torch.float32, device=like.device).uniform_(low, 1 - low)
    return (std * math.sqrt(2) * torch.erfinv(2 * uniform - 1)).to(like.dtype)


def forget_gradless_casts(device_type: str) -> None:
    """Before the first recurrence with gradient: drop the weight casts autocast cached during the recurrences
    without it. torch 2.9 (measured on 2.9.1) caches a cast made under no_grad and hands the same gradient-less
    copy to the later steps, so weights cast there get no gradient (the adapter none at all: silent on one
    process, an error under DDP). Clearing costs one more cast of the core's weights per forward; on the torch
    releases that no longer cache casts made without gradient (2.13 here) it drops nothing that is reused."""
    if torch.is_autocast_enabled(device_type):
        torch.clear_autocast_cache()


class RecurrentForCausalLM(RecurrentPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # only when config.tie_word_embeddings

    def __init__(self, config: RecurrentConfig):
        super().__init__(config)
        self.model = RecurrentModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_state_dict(cls, config: RecurrentConfig, state: dict[str, torch.Tensor]) -> RecurrentForCausalLM:
        """Build the model around `state`'s tensors (adopted, not copied; no random init first)."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        # Non-persistent buffers (RoPE frequencies) are in no state dict. They are computed on the CPU, as a model
        # loaded from disk computes them, then moved where the weights live: a GPU's pow rounds differently, and a
        # retrofit made on a GPU would not equal itself saved and reloaded.
        with torch.device("cpu"):
            rotary = type(model.model.rotary_emb)(config=config.text_config)
        model.model.rotary_emb = rotary.to(state["model.embed_tokens.weight"].device)
        if config.tie_word_embeddings:
            model.tie_weights()
        return model

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # A DynamicCache has one slot per layer index; forward makes a RecurrentCache when use_cache is set.
        return False

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: RecurrentCache | None = None,
        past_key_values: RecurrentCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        num_steps=None,
        initial_state: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        exit_rule=None,
        warm_start: bool = False,
        steps_log: list | None = None,
        readout_steps: Sequence[int] = (),
        **kwargs,
    ) -> RecurrentCausalLMOutput:
        r"""
        cache (`RecurrentCache`, *optional*):
            The KV cache (`past_key_values` on transformers before 5.24, still accepted). With `use_cache=True` and
            none given, a `RecurrentCache` is made and returned on the output under the same name.
        num_steps (`int` or `(n, k)`, *optional*):
            Recurrences of the core: `r`, or `n` steps without gradient followed by `k` with gradient (truncated
            backprop). Unset: sampled from the Poisson-lognormal in training, `config.mean_recurrence` in eval.
        initial_state (`torch.Tensor` of shape `(batch, seq, hidden)`, *optional*):
            s_0; drawn from TruncNormal(0, config.state_init_std²) when unset.
        labels (`torch.LongTensor`, *optional*):
            Next-token targets, shifted inside (HF convention); positions where `attention_mask` is 0 are ignored.
        exit_rule (`recurfit.generation.ExitRule`, *optional*):
            Adaptive depth when decoding with a cache: each row stops recurring once the rule says its new token
            has settled (at most r steps), and the core runs only on the rows still recurring.
        warm_start (`bool`, *optional*):
            Decoding with a cache, start each new token's recurrence from the previous token's final state
            instead of a fresh s_0 ("continuous compute").
        steps_log (`list`, *optional*):
            Receives each call's `steps_per_token` (`generate` passes one to report the depth of every token).
        readout_steps (`Sequence[int]`, *optional*):
            Recurrences (each before the last) after which the state is also read out through coda, norm and head,
            in the same pass: `readout_logits` holds their logits in order (depth supervision).
        """
        cache = take_cache(past_key_values, cache)
        if cache is None and use_cache and not self.training:
            cache = RecurrentCache(self.config)
        if cache is not None and not isinstance(cache, (RecurrentCache, StaticRecurrentCache)):
            raise TypeError(
                f"recurfit models need a RecurrentCache (one slot per core layer per step), got "
                f"{type(cache).__name__}; pass recurfit.RecurrentCache(model.config) or use_cache=True."
            )
        step = getattr(cache, "compiled_step", None)
        if step is not None and not torch.compiler.is_compiling() and input_ids is not None and input_ids.shape[1] == 1:
            if readout_steps or output_hidden_states or labels is not None:
                raise ValueError("Compiled decoding gives logits only: drop readout_steps, labels, hidden states.")
            # One token per row: the compiled graph (recurfit.model.compiled). The cache tracks positions itself.
            new_real = attention_mask[:, -1:] if attention_mask is not None else torch.ones_like(input_ids)
            n, k = self.model.resolve_num_steps(num_steps)
            # Fresh contiguous inputs: a column of a growing mask has a stride that changes every token (a retrace).
            token, new_real = (t.clone(memory_format=torch.contiguous_format) for t in (input_ids, new_real))
            logits, steps = step(self, cache, token, new_real, n + k, warm_start, exit_rule)
            steps = torch.full(input_ids.shape[:1], n + k, device=input_ids.device) if steps is None else steps
            if steps_log is not None:
                steps_log.append(steps)
            return RecurrentCausalLMOutput(
                logits=logits, num_steps=(n, k), steps_per_token=steps, **cache_kwargs(cache)
            )
        body = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            num_steps=num_steps,
            initial_state=initial_state,
            output_hidden_states=output_hidden_states or self.config.output_hidden_states,
            cache=cache,
            exit_rule=exit_rule,
            lm_head=self.lm_head,
            warm_start=warm_start,
            readout_steps=readout_steps,
            **kwargs,
        )
        if steps_log is not None:
            steps_log.append(body.steps_per_token)
        hidden = body.last_hidden_state
        # logits_to_keep: 0 keeps all positions, an int n the last n, a tensor those indices (HF convention).
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            if attention_mask is not None and attention_mask.shape == labels.shape:
                labels = labels.masked_fill(attention_mask == 0, -100)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return RecurrentCausalLMOutput(
            loss=loss,
            logits=logits,
            **cache_kwargs(cache),
            hidden_states=body.hidden_states,
            num_steps=body.num_steps,
            steps_per_token=body.steps_per_token,
            readout_logits=None
            if body.readout_hidden_states is None
            else tuple(self.lm_head(h) for h in body.readout_hidden_states),
        )

    def generate(self, *args, compile: bool | str = False, **kwargs):
        """`GenerationMixin.generate`, plus `steps_per_token` (batch × new tokens: the recurrences that produced
        each token) on the output when `return_dict_in_generate=True`.

        `compile=True` decodes through a static cache and a compiled step (`recurfit.model.compiled`): the same
        tokens, one graph per batch size and r (traced on the first call, reused by later ones). Greedy decoding
        and plain sampling (temperature, top-k, top-p; EOS, max_new_tokens) run recurfit's own loop around the
        compiled step (`recurfit.model.compiled.decoding_loop`: one host sync per 16 tokens instead of one per
        token); a request with anything else (other logits processors or stopping criteria, a streamer, an
        assistant, `return_dict_in_generate`, …) runs transformers' loop around the same step, with the same tokens.
        The split is `compiled.loop_may_run` (the arguments) and `compiled._loop_decodes` (the prepared request).
        With an `exit_rule` each compiled token stops per row where uncompiled `generate`'s does, with the same
        tokens and `steps_per_token` (`compiled.CompiledDecoder`: settled rows stay in the batch, frozen)."""
        if compile:
            kwargs[CACHE_ARG] = self._compiled_decoding_cache(args, kwargs, compile)
            if loop_may_run(args, kwargs):
                kwargs["custom_generate"] = decoding_loop
        log = kwargs.setdefault("steps_log", [])
        output = super().generate(*args, **kwargs)
        if not isinstance(output, torch.Tensor) and log:
            output["steps_per_token"] = torch.stack(log, dim=1)
        return output

    def _compiled_decoding_cache(self, args, kwargs, compile) -> StaticRecurrentCache:
        if kwargs.get(CACHE_ARG) is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("generate(compile=True) makes its own cache: pass a cache or compile=True, not both.")
        if kwargs.get("num_beams", 1) > 1:
            raise ValueError("generate(compile=True) decodes one beam: drop num_beams.")
        ids = args[0] if args else kwargs["input_ids"]
        config = self.generation_config
        new_tokens = kwargs.get("max_new_tokens") or config.max_new_tokens
        length = (
            ids.shape[1] + new_tokens
            if new_tokens
            else max(kwargs.get("max_length") or config.max_length, ids.shape[1] + 1)
        )
        return decoding_cache(self, ids.shape[0], length, kwargs.get("num_steps"), compile=compile)


# Importing the model makes saved recurfit folders loadable by transformers' Auto classes (no trust_remote_code);
# importing .config above registered the config.
AutoModel.register(RecurrentConfig, RecurrentModel, exist_ok=True)
AutoModelForCausalLM.register(RecurrentConfig, RecurrentForCausalLM, exist_ok=True)
