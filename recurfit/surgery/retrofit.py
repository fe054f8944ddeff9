"""Surgery: choose which parent layers become prelude, core and coda, and move their weights over.

    retrofit(parent, shape=(4, 8, 4))                                   # the paper's rule
    retrofit(parent, prelude=[0, 1], core=[4, 5, 6, 7], coda=[8, 9])    # explicit parent indices
    retrofit(parent, shape=(4, 8, 4), select="shortgpt", calibration=ids)  # keep high Block-Influence layers
    retrofit(parent, shape=(4, 8, 4), select="angular", calibration=ids)   # core from the angular "think" region
    retrofit(parent, select="angular", calibration=ids)                    # the knees choose P, R and C too

Works on a parent on the meta device too (plan shapes and FLOPs from a config alone).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from ..defaults import ADAPTER_INITS, BACKPROP_DEPTH, DEFAULT_SHAPE, DEFAULT_STATE_INIT_STD, MEAN_RECURRENCE, SELECTIONS
from ..errors import RecurfitError
from ..io.assets import public_name
from ..model.config import RecurrentConfig
from ..model.families import config_for_layers, family_of
from ..model.loading import load_model
from ..model.modeling import LinearAdapter, RecurrentForCausalLM, positions_from_mask
from .layer_scores import LayerScores, core_window, knees, measure

PARITY_TOLERANCE = 1e-4  # max |Δlogit| (fp32) under which a retrofit counts as equal to its pruned parent
PARITY_SAMPLES = (
    "Depth-recurrent language models loop a block of layers to think longer.",
    "The quick brown fox jumps over the lazy dog.",
)


@dataclass(frozen=True)
class LayerSelection:
    """Parent layer indices for each part, each strictly increasing, no index used twice."""

    prelude: tuple[int, ...]
    core: tuple[int, ...]
    coda: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.prelude), len(self.core), len(self.coda)

    @property
    def kept(self) -> list[int]:
        """Parent indices in execution order: prelude, core, coda."""
        return [*self.prelude, *self.core, *self.coda]

    def dropped(self, num_layers: int) -> list[int]:
        return sorted(set(range(num_layers)) - set(self.kept))

    def as_dict(self) -> dict[str, list[int]]:
        return {"prelude": list(self.prelude), "core": list(self.core), "coda": list(self.coda)}

    def part_of(self, layer: int) -> str | None:
        """The part (prelude, core or coda) a parent layer is kept in; None for a dropped layer."""
        return next((part for part, indices in self.as_dict().items() if layer in indices), None)

    @classmethod
    def explicit(cls, prelude: Sequence[int], core: Sequence[int], coda: Sequence[int], num_layers: int):
        """Validate user-given indices; a ValueError names the first problem found."""
        parts = {"prelude": list(prelude), "core": list(core), "coda": list(coda)}
        if not parts["core"]:
            raise ValueError("The core is empty: give at least one layer index for the recurrent core.")
        for name, indices in parts.items():
            if any(not isinstance(i, int) or isinstance(i, bool) for i in indices):
                raise ValueError(f"{name} indices must be integers, got {indices}.")
            outside = [i for i in indices if not 0 <= i < num_layers]
            if outside:
                raise ValueError(
                    f"{name} indices {outside} are out of range: "
                    f"the parent has {num_layers} layers (0..{num_layers - 1})."
                )
            if any(b <= a for a, b in zip(indices, indices[1:])):
                raise ValueError(
                    f"{name} indices {indices} must be strictly increasing (layers run in parent order, each once)."
                )
        seen: dict[int, str] = {}
        for name, indices in parts.items():
            for i in indices:
                if i in seen:
                    raise ValueError(f"Layer {i} is in both {seen[i]} and {name}: each parent layer can be used once.")
                seen[i] = name
        order = [i for indices in parts.values() for i in indices]
        if any(b <= a for a, b in zip(order, order[1:])):
            raise ValueError(
                f"prelude {parts['prelude']}, core {parts['core']} and coda {parts['coda']} must run in parent order: "
                "every prelude layer before every core layer, every core layer before every coda layer."
            )
        return cls(tuple(parts["prelude"]), tuple(parts["core"]), tuple(parts["coda"]))

    @classmethod
    def paper_rule(cls, shape: Sequence[int], num_layers: int):
        """Prelude = first P layers, coda = last C, core = the R layers just before the coda (the paper's §3)."""
        P, R, C = _check_shape(shape, num_layers)
        return cls(
            tuple(range(P)), tuple(range(num_layers - C - R, num_layers - C)), tuple(range(num_layers - C, num_layers))
        )

    @classmethod
    def from_scores(cls, shape: Sequence[int], scores: Sequence[float]):
        """Keep the P+R+C layers with the highest scores, in parent order, and split them into P, R, C."""
        P, R, C = _check_shape(shape, len(scores))
        kept = highest_scoring(scores, P + R + C)
        return cls(tuple(kept[:P]), tuple(kept[P : P + R]), tuple(kept[P + R :]))

    @classmethod
    def angular(cls, shape: Sequence[int] | None, angular: Sequence[float]):
        """From the parent's angular distances (`layer_scores.knees`): without a shape, the layers before the
        first knee, between the knees and after the last knee, dropping none; with one, the first P and last C
        layers and the core block `layer_scores.core_window` picks."""
        n = len(angular)
        first, end = knees(angular)
        if shape is None:
            return cls(tuple(range(first)), tuple(range(first, end)), tuple(range(end, n)))
        P, R, C = _check_shape(shape, n)
        core = core_window(angular, (P, R, C), (first, end))
        return cls(tuple(range(P)), tuple(core), tuple(range(n - C, n)))


def selections_by_rule(scores: LayerScores, shape: Sequence[int]) -> dict[str, LayerSelection]:
    """The layers each `select` rule keeps of a parent for `shape`, and under "knees" the split the angular
    distance's knees choose without a shape (`recurfit inspect --layers`)."""
    shape = tuple(shape)
    return {
        "paper": LayerSelection.paper_rule(shape, len(scores.angular)),
        "shortgpt": LayerSelection.from_scores(shape, scores.influence),
        "angular": LayerSelection.angular(shape, scores.angular),
        "knees": LayerSelection.angular(None, scores.angular),
    }


def highest_scoring(scores: Sequence[float], count: int) -> list[int]:
    """Indices of the `count` highest scores, in ascending (parent) order."""
    return sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:count])


def _check_shape(shape: Sequence[int], num_layers: int) -> tuple[int, int, int]:
    if len(shape) != 3 or any(not isinstance(x, int) or isinstance(x, bool) for x in shape):
        raise ValueError(f"shape must be three integers (prelude, core, coda), got {tuple(shape)}.")
    P, R, C = shape
    if min(P, C) < 0 or R < 1:
        raise ValueError(f"shape {tuple(shape)} needs a core of at least 1 layer and non-negative prelude and coda.")
    if P + R + C > num_layers:
        raise ValueError(f"shape {tuple(shape)} needs {P + R + C} layers but the parent has only {num_layers}.")
    return P, R, C


EMBEDDED_PROSE = "embedded:prose"  # calibration text without a file: the English passages recurfit bundles


@torch.no_grad()
def calibration_ids(tokenizer, path: Path | str, max_tokens: int = 2048) -> torch.Tensor:
    """The first `max_tokens` tokens of a plain-text file (or of the embedded prose, `embedded:prose`), as
    ShortGPT's and the angular distance's layer scores read them (1 × tokens)."""
    if str(path) == EMBEDDED_PROSE:
        text = _embedded_prose(chars=8 * max_tokens)  # English runs about 4 characters a token
    elif Path(path).is_file():
        text = Path(path).read_text()
    else:
        raise RecurfitError(f"Calibration file not found: {path}; give a plain-text file or {EMBEDDED_PROSE}.")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    if ids.numel() < 16:
        raise RecurfitError(f"{path} holds only {ids.numel()} tokens; give at least a paragraph of text.")
    return ids


def _embedded_prose(chars: int) -> str:
    """The first passages of `embedded:prose`, joined by blank lines, up to about `chars` characters."""
    from ..data.sources import embedded_prose

    passages, size = [], 0
    for passage in embedded_prose():
        passages.append(passage)
        size += len(passage) + 2
        if size >= chars:
            break
    return "\n\n".join(passages)


def block_influence(parent: PreTrainedModel, calibration) -> list[float]:
    """ShortGPT's Block Influence per parent layer: 1 - mean cosine(input, output) over real tokens.

    `calibration` is a LongTensor of token ids or a tokenizer output with `input_ids` / `attention_mask`.
    Layers that barely change the residual stream score low and are the first to be dropped.
    """
    return list(measure(parent, calibration).influence)


def retrofit(
    parent: PreTrainedModel,
    shape: Sequence[int] | None = None,
    *,
    prelude: Sequence[int] | None = None,
    core: Sequence[int] | None = None,
    coda: Sequence[int] | None = None,
    select: str = "paper",
    calibration=None,
    adapter: str = "linear",
    adapter_init: str = "identity",
    seed: int = 0,
    untie_embeddings: bool = True,
    state_init_std: float = DEFAULT_STATE_INIT_STD,
    mean_recurrence: int = MEAN_RECURRENCE,
    backprop_depth: int = BACKPROP_DEPTH,
) -> RecurrentForCausalLM:
    """Turn a pretrained causal LM into a `RecurrentForCausalLM` (see module docstring for the layer choices).

    With the identity adapter (`adapter="linear", adapter_init="identity"`), the result computes exactly the
    parent with the dropped layers removed, at every number of recurrences, until it is trained.
    `adapter_init="torch-default"` starts the adapter where the paper's runs started: `nn.Linear`'s default
    Kaiming-uniform draw, here from a generator seeded with `seed` (so the same seed gives the same model).
    """
    family_of(parent.config)  # a clear error for unsupported architectures, before any work
    num_layers = parent.config.num_hidden_layers
    selection = _select_layers(parent, num_layers, shape, prelude, core, coda, select, calibration)
    if adapter_init not in ADAPTER_INITS:
        raise ValueError(f"adapter_init must be one of {ADAPTER_INITS}, got {adapter_init!r}.")
    text = config_for_layers(parent.config, selection.kept)
    text.tie_word_embeddings = not untie_embeddings
    text.name_or_path = public_name(parent.config.name_or_path) or ""  # a local path is not saved (nor pushed)
    P, R, C = selection.shape
    config = RecurrentConfig(
        text_config=text,
        num_prelude_layers=P,
        num_core_layers=R,
        num_coda_layers=C,
        source_layers=selection.as_dict(),
        parent_name_or_path=public_name(parent.config.name_or_path),
        adapter=adapter,
        state_init_std=state_init_std,
        mean_recurrence=mean_recurrence,
        backprop_depth=backprop_depth,
        tie_word_embeddings=not untie_embeddings,
        dtype=parent.dtype,
    )
    config._attn_implementation = parent.config._attn_implementation
    model = RecurrentForCausalLM.from_state_dict(
        config, _transfer_weights(parent, selection, config, adapter_init, seed)
    )
    if parent.generation_config is not None:
        model.generation_config = copy.deepcopy(parent.generation_config)  # the parent's own stays untouched
    return model.train(parent.training)


def _select_layers(parent, num_layers, shape, prelude, core, coda, select, calibration) -> LayerSelection:
    indices_given = any(part is not None for part in (prelude, core, coda))
    if indices_given and shape is not None:
        raise ValueError("Give either shape=(P, R, C) or explicit prelude/core/coda indices, not both.")
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {SELECTIONS}, got {select!r}.")
    if indices_given:
        if select != "paper":
            raise ValueError(
                f"select={select!r} chooses layers from a shape; it cannot be combined with explicit indices."
            )
        return LayerSelection.explicit(prelude or [], core or [], coda or [], num_layers)
    if shape is not None:
        _check_shape(shape, num_layers)  # an impossible shape fails before the parent runs on calibration text
    if select == "angular":  # the knees choose the shape when none is given
        return LayerSelection.angular(shape, measure(parent, calibration, "select='angular'").angular)
    if shape is None:
        raise ValueError(
            "Give shape=(P, R, C), e.g. (4, 8, 4), or explicit prelude/core/coda layer indices "
            "(or select='angular' with calibration ids, to let the angular distances choose)."
        )
    if select == "shortgpt":
        return LayerSelection.from_scores(shape, block_influence(parent, calibration))
    return LayerSelection.paper_rule(tuple(shape), num_layers)


def _transfer_weights(parent, selection: LayerSelection, config: RecurrentConfig, adapter_init: str, seed: int) -> dict:
    """The new model's state dict, copied (not shared) from the parent's kept layers, embeddings and head."""
    embeddings = parent.get_input_embeddings().weight
    state = {
        "model.embed_tokens.weight": embeddings,
        # The parent's head may be its embedding matrix (tied); the copy below unties them.
        "lm_head.weight": parent.get_output_embeddings().weight,
        **{f"model.norm.{k}": v for k, v in parent.model.norm.state_dict().items()},
    }
    for part, indices in selection.as_dict().items():
        for new, old in enumerate(indices):
            for key, value in parent.model.layers[old].state_dict().items():
                state[f"model.{part}.{new}.{key}"] = value
    state = {key: value.detach().clone() for key, value in state.items()}
    if config.adapter == "linear":
        state["model.adapter.weight"] = _adapter_weight(config, embeddings, adapter_init, seed)
    return state


def _adapter_weight(config: RecurrentConfig, like: torch.Tensor, init: str, seed: int) -> torch.Tensor:
    adapter = LinearAdapter(config.text_config.hidden_size)  # drawn in fp32, then cast as the parent's weights
    generator = torch.Generator().manual_seed(seed)
    if init == "identity":
        adapter.reset_to_identity()
    elif init == "torch-default":
        # nn.Linear.reset_parameters' draw, from our generator instead of the global one: the same values as
        # `torch.manual_seed(seed); nn.Linear(2h, h, bias=False)`.
        nn.init.kaiming_uniform_(adapter.weight, a=math.sqrt(5), generator=generator)
    else:
        std = getattr(config.text_config, "initializer_range", 0.02)
        nn.init.normal_(adapter.weight, std=std, generator=generator)
    return adapter.weight.detach().to(device=like.device, dtype=like.dtype)


def prune_layers(parent: PreTrainedModel, keep: int, calibration) -> PreTrainedModel:
    """The parent with only its `keep` layers of highest Block Influence (ShortGPT), in place: a smaller
    non-recurrent model, the baseline the paper compares its layer choice against. Returns `parent`."""
    num_layers = parent.config.num_hidden_layers
    if not 1 <= keep <= num_layers:
        raise ValueError(f"Cannot keep {keep} layers of a {num_layers}-layer parent: choose 1..{num_layers}.")
    kept = highest_scoring(block_influence(parent, calibration), keep)
    tied = parent.config.tie_word_embeddings
    parent.config = config_for_layers(parent.config, kept)
    parent.config.tie_word_embeddings = tied
    parent.model.config = parent.config
    parent.model.layers = nn.ModuleList(parent.model.layers[i] for i in kept)
    for index, layer in enumerate(parent.model.layers):
        # A layer's KV-cache slot is its `layer_idx`: renumber the kept layers 0..keep-1.
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    return parent


def untie_embeddings(model: PreTrainedModel) -> PreTrainedModel:
    """Give a model whose head shares the embedding matrix its own copy of it (in place; no-op when untied).
    Outputs are unchanged; training then updates the two separately, as the paper's Llama-3.2-1B baseline."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    if head.weight is embeddings.weight:
        head.weight = nn.Parameter(embeddings.weight.detach().clone())
    return model


@contextmanager
def pruned_parent(parent: PreTrainedModel, kept: Sequence[int]) -> Iterator[PreTrainedModel]:
    """The parent itself, temporarily running only the `kept` layers (no copy). Call it with use_cache=False."""
    layers, config = parent.model.layers, parent.config
    saved = {key: getattr(config, key) for key in ("num_hidden_layers", "layer_types") if hasattr(config, key)}
    parent.model.layers = nn.ModuleList(layers[i] for i in kept)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [saved["layer_types"][i] for i in kept]
    try:
        yield parent
    finally:
        parent.model.layers = layers
        for key, value in saved.items():
            setattr(config, key, value)


@torch.no_grad()
def parity(parent: PreTrainedModel, model: RecurrentForCausalLM, input_ids, attention_mask=None, steps=(1, 32)):
    """max |Δlogit| between the retrofit at each r and the parent without the dropped layers (real tokens only)."""
    kept = [i for part in model.config.source_layers.values() for i in part]
    valid = slice(None) if attention_mask is None else attention_mask.bool()
    positions = positions_from_mask(attention_mask, input_ids.shape[1], input_ids.device)
    with pruned_parent(parent, kept) as reference:
        expected = reference(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    expected = expected.logits.float()
    return {
        r: (model(input_ids, attention_mask=attention_mask, num_steps=r).logits.float() - expected)[valid]
        .abs()
        .max()
        .item()
        for r in steps
    }


@dataclass
class ParityCheck:
    """A retrofit against its pruned parent: max |Δlogit| at each r over the real tokens of a padded batch."""

    diffs: dict[int, float]
    rows: int

    @property
    def equal(self) -> bool:
        return max(self.diffs.values()) <= PARITY_TOLERANCE

    def describe(self) -> str:
        per_r = ", ".join(f"r={r}: max |Δlogit| = {d:.1e}" for r, d in self.diffs.items())
        verdict = "✓ equal" if self.equal else "✗ differs"
        return f"Parity with the parent minus its dropped layers (left-padded batch of {self.rows}): {per_r}  {verdict}"


def parity_batch(tokenizer, vocab_size: int) -> dict[str, torch.Tensor]:
    """Two sample sentences, left-padded so the check covers padding; random tokens (one row padded) when there
    is no tokenizer."""
    if tokenizer is None:
        ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return {"input_ids": ids, "attention_mask": mask}
    tokenizer.padding_side = "left"
    return dict(tokenizer(list(PARITY_SAMPLES), return_tensors="pt", padding=True))


@torch.no_grad()
def check_parity(parent: PreTrainedModel, model: RecurrentForCausalLM, tokenizer=None, steps=(1, 32)) -> ParityCheck:
    """`parity` on `parity_batch`: what `recurfit retrofit` and the demo report right after surgery."""
    batch = {
        name: tensor.to(model.device) for name, tensor in parity_batch(tokenizer, parent.config.vocab_size).items()
    }
    return ParityCheck(parity(parent, model, **batch, steps=steps), rows=len(batch["input_ids"]))


def load_recurrent_model(
    name_or_path: str | None, dtype: torch.dtype | str = torch.float32, device: torch.device | str | None = None
) -> PreTrainedModel:
    """A model to generate with or evaluate: a folder or Hub id, or by default the embedded SmolLM2-135M
    retrofitted to `DEFAULT_SHAPE` on the spot (untrained: it shows the mechanics, not the quality)."""
    if name_or_path is not None:
        return load_model(name_or_path, dtype, device)
    model = retrofit(load_model(None, dtype), DEFAULT_SHAPE).eval()  # surgery on the CPU, then moved whole
    return model if device is None else model.to(device)
