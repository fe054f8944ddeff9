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
attention included (`RecurringRequests`, on the backends of `NARROWED_BACKENDS`; with another backend, attention
runs for every token up to the batch's deepest). vLLM compiles three pieces (its default mode; `--enforce-eager`
runs them as they are): the prelude, one core step and the coda, each once whatever the depths served. A core layer's
attention is one opaque op (`recurfit::stepped_attention`) that runs the current step's vLLM `Attention` when it
is called, so one compiled core step serves every step and every depth. On a GPU the pieces are captured as
vLLM's piecewise CUDA graphs: every step replays them, reading its inputs from buffers of fixed address (`Pieces`),
a step over fewer tokens than the batch padded to the next size vLLM captured, as vLLM pads a batch.

KV cache, `cache_policy` "all" (default): each core layer's attention runs through r vLLM `Attention` layers,
one per step (its own name, hence its own paged KV cache): a token at step s attends to the earlier tokens'
step-s keys, which is what recurfit's `generate` computes with its `all` policy. `cache_policy` "latest"
(`--hf-overrides '{"cache_policy": "latest"}'`): one `Attention` per core layer, which every step overwrites,
as recurfit's `latest` policy; KV memory is that of a (P + R + C)-layer model instead of (P + R·r + C).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterable

import torch
import vllm
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

from ..model.modeling import _truncated_normal_by_inverse_cdf as truncated_normal_by_inverse_cdf
from . import check_vllm_version
from .attention import NARROWED_BACKENDS, RecurringRequests, SteppedAttention, check_v1_backend
from .depth import Limits, TokenDepths, engine_limits, runs_model_runner_v2, table_for
from .engine import SCHEDULER
from .exit import TokenExits, TokenRules
from .families import (
    OLMO_HYBRID,
    SCALED_EMBEDDINGS,
    VLLM_FAMILIES,
    attention_like,
    body_config,
    check_servable,
    fit_sliding_layers,
    olmo_hybrid_config,
    uncompiled,
)
from .pieces import Pieces, split_at_stepped_attention
from .steps import recur

# Under vLLM's logger, so that the line shows in a server's log with vLLM's own start lines.
logger = logging.getLogger(f"vllm.{__name__}")


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
        body_class = uncompiled(getattr(importlib.import_module(module), body))
        hybrid = text.model_type in OLMO_HYBRID
        body_text = olmo_hybrid_config(text) if hybrid else text
        self.body = body_class(vllm_config=body_config(vllm_config, body_text), prefix=body_prefix)
        if hybrid:
            fit_sliding_layers(self.body, text, vllm_config)
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
                    attention_like(own, f"{body_prefix}.recurrence.{total + (step - 2) * R + i}.attn", vllm_config)
                    for step in range(2, self.max_recurrence + 1)
                ]
            attn_holder.attn = SteppedAttention(steps, vllm_config)
        # In the module tree, where vLLM looks for compiled code (Model Runner V2's CUDA graphs, the engine's cleanup);
        # they hold this module outside theirs, so the state dict has no cycle and no names of theirs.
        self.pieces = Pieces(self, vllm_config)

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
        exits: TokenExits | None = None,
    ) -> torch.Tensor:
        """Embedding to final norm, each token recurring to its own `depths` (`recurfit.serving.steps`), or to the
        step its request's exit rule stops it at (`exits`); `stops` are the batch's distinct depths (on the host),
        None for vLLM's runs without requests (profiling, warm-up, graph capture), which run one step: the compiled
        pieces are the same at every step."""
        pieces = self.pieces
        state, part = pieces.prelude(input_ids, positions, inputs_embeds)
        state, part = pieces.fixed("state", state), pieces.fixed("part", part)
        state = recur(self, positions, state, part, depths, stops or (1,), exits)
        return pieces.final(positions, state)

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


class RecurfitForCausalLM(nn.Module):
    """A recurfit folder (model_type "recurfit") as a vLLM model; see the module docstring."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        check_vllm_version(vllm.__version__)  # here, not at plugin load: other models in the same vLLM still serve
        config = vllm_config.model_config.hf_config
        check_servable(config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("recurfit on vLLM: pipeline_parallel_size > 1 is not served (the core loops over itself).")
        split_at_stepped_attention(vllm_config.compilation_config)
        self.config = config
        self.vllm_config = vllm_config  # its engine's key to the V1 runner's depth table (`table_for`)
        self.limits = engine_limits(vllm_config)
        self.one_depth: TokenDepths | None = None  # every token at `limits.only`, when the engine has one depth
        text = config.text_config
        module, _, causal_lm = VLLM_FAMILIES[text.model_type]
        self.body_mapper = getattr(getattr(importlib.import_module(module), causal_lm), "hf_to_vllm_mapper", None)
        self.model = RecurrentModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.body.embed_tokens)
        self.logits_processor = LogitsProcessor(text.vocab_size)
        backend = self.model.body.layers[config.shape[0]].self_attn.attn.steps[0].attn_backend.get_name()
        check_v1_backend(vllm_config, self.limits.only is None, backend)
        logger.info("%s", start_line(vllm_config, self.limits, self.model))

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
        token_rules: TokenRules | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """vLLM's call (its other keyword arguments unused), each token at the depth of the request it belongs to.
        Model Runner V2 passes the depths (`RecurfitModelState.prepare_inputs`; `depth_stops` None for a batch of
        no request); otherwise they come from `token_depths`, and each token's exit rule from the same table
        (`token_rules`, recurfit.serving.exit)."""
        if token_depths is None:
            token_depths, depth_stops = self.token_depths(positions.shape[-1])
            if self.limits.only is None and depth_stops is not None:
                token_rules = table_for(self.vllm_config).rules
        exits = TokenExits.of(token_rules, positions, token_depths, self.compute_logits)
        hidden = self.model(input_ids, positions, inputs_embeds, token_depths, depth_stops, exits)
        if exits is not None:
            exits.log()
        return hidden

    def token_depths(self, num_tokens: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """Under the V1 runner: each token's depth and the batch's distinct depths (None for a batch without
        requests), from the depths the engine's `RequestDepth` keeps per batch row; in an engine of one depth
        (`depth.one_depth_engine`: a draft model, or speculation on the V1 runner), every token at that depth."""
        if self.limits.only is not None:
            if self.one_depth is None:
                device = self.lm_head.weight.device
                self.one_depth = TokenDepths(self.vllm_config.scheduler_config.max_num_batched_tokens, device)
            return self.one_depth.every_token_at(self.limits.only, num_tokens), (self.limits.only,)
        meta = get_forward_context().attn_metadata if is_forward_context_available() else None
        first = next(iter(meta.values())) if isinstance(meta, dict) and meta else None
        if first is None:
            return table_for(self.vllm_config).token_depths(None, num_tokens)
        return table_for(self.vllm_config).token_depths(first.query_start_loc, num_tokens, first.max_query_len)

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


def start_line(vllm_config: VllmConfig, limits: Limits, recurrence: RecurrentModel) -> str:
    """What the engine runs, in one line of its start-up log: the runner, CUDA graphs and their capture sizes,
    whether the pieces compile, the attention backend and whether recurfit narrows its metadata, the depths, and
    whether prefix caching is kept apart by depth. A GPU user's first log then tells whether graphs are on."""
    compilation, cache = vllm_config.compilation_config, vllm_config.cache_config
    graphs = compilation.cudagraph_mode.name if compilation.cudagraph_mode is not None else "NONE"
    if graphs != "NONE":
        graphs += f" (capture sizes {compilation.cudagraph_capture_sizes})"
    compiled = "eager" if vllm_config.model_config.enforce_eager else f"compiled ({compilation.mode.name})"
    attention = recurrence.body.layers[recurrence.shape[0]].self_attn.attn.steps[0].attn_backend.get_name()
    narrowed = "narrowed to the requests still recurring" if attention in NARROWED_BACKENDS else "over every token"
    if not cache.enable_prefix_caching:
        salt = "prefix caching off"
    elif vllm_config.scheduler_config.scheduler_cls == SCHEDULER:
        salt = "prefix cache kept apart by depth (recurfit's scheduler)"
    else:
        salt = "prefix cache NOT kept apart by depth"
    runner = "Model Runner V2" if runs_model_runner_v2(vllm_config) else "V1 runner"
    if vllm_config.model_config.runner_type == "draft":
        depths = f"speculative draft, every token at depth {limits.only}"
    elif limits.only is not None:
        depths = f"every request at depth {limits.only} (speculation on the V1 runner: no depth per request)"
    else:
        depths = f"depths 1..{limits.maximum} (default {limits.default})"
    return (
        f"recurfit on vLLM: {runner}; CUDA graphs {graphs}; pieces {compiled}; attention {attention}, {narrowed}; "
        f"{depths}, cache policy {limits.policy}; {salt}."
    )


def _copy_loader(param: torch.Tensor, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
