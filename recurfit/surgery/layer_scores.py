"""Per-layer scores on calibration text, and the prelude/core/coda split they suggest.

    scores = measure(parent, ids)            # angular distance and Block Influence of every parent layer
    first, last = knees(scores.angular)      # Kneedle: where the "encode" region ends and "decode" begins

Both scores compare a layer's input and output hidden states, token by token, over the real tokens:

- Block Influence (ShortGPT, arXiv:2403.03853): 1 - mean cos(x_in, x_out).
- Angular distance (Encode-Think-Decode, arXiv:2510.07358): mean arccos(cos(x_in, x_out)) / π, in [0, 1].

The layers near the input and the output turn the hidden state a lot; those in between turn it little and
alike. `knees` finds the two bends of the angular-distance curve with the Kneedle rule, as the reference
analysis of the retrofitting fork (LoopedLMs/retrofitting-recurrence, dev/layer_analysis.py) does: the layers
before the first knee encode (the prelude), those after the last knee decode (the coda), and the ones in between
"think" (the recurrent core).

Unlike that analysis, which reads `output_hidden_states` (whose last entry is after the final norm), every
layer here is scored on its own input and output, the last one included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

# The fork's `suggest_config` looks for the first knee in the first 70 % of the layers (the curve rises again
# at the end, and a knee search over all of it would find that rise instead).
FIRST_KNEE_SPAN = 0.7


@dataclass(frozen=True)
class LayerScores:
    """Scores of each parent layer, input → output, averaged over the calibration tokens."""

    angular: tuple[float, ...]  # mean arccos(cos) / π
    influence: tuple[float, ...]  # ShortGPT's Block Influence, 1 - mean cos
    tokens: int  # real calibration tokens scored


@torch.no_grad()
def measure(parent: PreTrainedModel, calibration, purpose: str = "select='shortgpt'") -> LayerScores:
    """Run the parent once on `calibration` (a LongTensor of token ids, or a tokenizer output with `input_ids`
    and `attention_mask`) and score every layer on its own input and output over the real tokens.
    `purpose` names what needs the scores in error messages."""
    input_ids, valid = _calibration_tokens(calibration, purpose)
    device = parent.get_input_embeddings().weight.device
    if device.type == "meta":
        raise ValueError(f"{purpose} runs the parent on calibration text, so it needs real weights, not meta.")
    input_ids, valid = input_ids.to(device), valid.to(device)
    cosines: list[torch.Tensor] = []

    def record(module, args, kwargs, output):
        before = args[0] if args else kwargs["hidden_states"]
        after = output[0] if isinstance(output, tuple) else output
        cosines.append(nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)[valid])

    hooks = [layer.register_forward_hook(record, with_kwargs=True) for layer in parent.model.layers]
    try:
        parent(input_ids=input_ids, attention_mask=valid.long(), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    # Rounding can put a cosine a hair outside [-1, 1], where arccos is NaN.
    angular = [(torch.arccos(c.clamp(-1.0, 1.0)) / math.pi).mean().item() for c in cosines]
    return LayerScores(tuple(angular), tuple(1.0 - c.mean().item() for c in cosines), int(valid.sum()))


def block_influence(parent: PreTrainedModel, calibration) -> list[float]:
    """ShortGPT's Block Influence per parent layer: 1 - mean cosine(input, output) over real tokens.

    `calibration` is a LongTensor of token ids or a tokenizer output with `input_ids` / `attention_mask`.
    Layers that barely change the residual stream score low and are the first to be dropped.
    """
    return list(measure(parent, calibration).influence)


def _calibration_tokens(calibration, purpose: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and the mask of real tokens (all of them when no attention mask is given)."""
    if isinstance(calibration, Mapping):
        input_ids, attention_mask = calibration["input_ids"], calibration.get("attention_mask")
    else:
        input_ids, attention_mask = calibration, None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"{purpose} needs calibration token ids: a non-empty LongTensor of shape (batch, seq).")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    return input_ids, valid


def kneedle(values: Sequence[float], decreasing: bool = True) -> int:
    """Index of the knee of a curve sampled at equal steps: the point farthest from the chord joining its ends,
    with both axes scaled to [0, 1] (Satopää et al., "Finding a 'Kneedle' in a Haystack", ICDCS 2011; the
    same variant as the fork's `kneedle`). A decreasing curve is flipped first, so its knee is where it stops
    falling fast. Fewer than 3 points have no knee (0); a flat curve's knee is its middle."""
    n = len(values)
    if n < 3:
        return 0
    low, high = min(values), max(values)
    if high - low < 1e-12:
        return n // 2
    x = [i / (n - 1) for i in range(n)]
    y = [(v - low) / (high - low) for v in values]
    if decreasing:
        y = [1.0 - v for v in y]
    dy = y[-1] - y[0]  # the chord runs from (0, y[0]) to (1, y[-1])
    distance = [abs(dy * xi - (yi - y[0])) for xi, yi in zip(x, y)]  # ∝ the distance to the chord
    return max(range(n), key=distance.__getitem__)


def knees(angular: Sequence[float]) -> tuple[int, int]:
    """(first, end): the layers [first, end) think; [0, first) encode and [end, n) decode.

    As the fork's `suggest_config`: the first knee is Kneedle's on the falling start of the curve (its first
    70 %); the last is Kneedle's on the curve after the first knee, read backwards from the output, so it finds
    where the rise towards the output begins. At least one layer encodes and one decodes; when the knees leave
    fewer than two layers between them, the layers are split in thirds instead."""
    n = len(angular)
    if n < 3:
        raise ValueError(
            f"The parent has {n} layers: finding knees in the angular distance needs at least 3; give a shape."
        )
    first = kneedle(angular[: max(3, int(FIRST_KNEE_SPAN * n))])
    end = n - kneedle(list(reversed(angular[first:])))
    first, end = max(1, first), min(n - 1, end)
    if end <= first + 1:
        first, end = n // 3, 2 * n // 3
    return first, end


def core_window(angular: Sequence[float], shape: tuple[int, int, int], thinking: tuple[int, int]) -> range:
    """R consecutive layers for the core, between the first P and the last C layers: inside the thinking
    region [first, end) when it holds R of them, and there the R whose angular distances sum highest (the
    fork keeps the thinking layers that change the hidden state most and drops the others; here they stay one
    block, as the parent ran them). A tie goes to the block nearer the coda, where the paper's rule puts it."""
    P, R, C = shape
    n = len(angular)
    low, high = max(P, thinking[0]), min(n - C, thinking[1])
    if high - low < R:  # the thinking region (less prelude and coda) is too short: anywhere between them
        low, high = P, n - C
    starts = range(low, high - R + 1)
    best = max(reversed(starts), key=lambda s: sum(angular[s : s + R]))
    return range(best, best + R)


# ---------------------------------------------------------------- figure

PART_COLORS = {"prelude": "#1f77b4", "core": "#ff7f0e", "coda": "#2ca02c"}


def plot_layer_scores(scores: LayerScores, selections: Mapping, path, title: str):
    """Angular distance (knees marked, the knees' regions shaded), Block Influence, and the part each selection
    gives every layer, against the parent layer; saved as PNG, PDF and SVG (`path` names the PNG)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

    from ..io.figures import plt, save_figure

    n = len(scores.angular)
    layers = range(n)
    first, end = knees(scores.angular)
    figure, (angular, influence, parts) = plt.subplots(
        3, 1, figsize=(9, 9.5), sharex=True, layout="constrained", height_ratios=(3, 3, 0.5 + 0.45 * len(selections))
    )
    figure.suptitle(title)
    for part, (low, high) in zip(PART_COLORS, ((0, first), (first, end), (end, n))):
        angular.axvspan(low - 0.5, high - 0.5, color=PART_COLORS[part], alpha=0.12, linewidth=0)
    angular.plot(layers, scores.angular, "o-", color="black", markersize=3.5, linewidth=1.2, label="angular distance")
    knee_layers = [first, end - 1]
    angular.plot(
        knee_layers, [scores.angular[i] for i in knee_layers], "X", color="red", markersize=10, label="knee (Kneedle)"
    )
    angular.set_title(f"Angular distance, shaded by the knees' split: prelude 0–{first - 1}, coda {end}–{n - 1}")
    angular.set_ylabel("arccos(cos) / π")
    influence.plot(
        layers, scores.influence, "s-", color="#7f7f7f", markersize=3, linewidth=1.2, label="Block Influence"
    )
    influence.set_title("ShortGPT Block Influence")
    influence.set_ylabel("1 − cos")
    for axis in (angular, influence):
        axis.set_yscale("log")  # the first layer turns the state far more than the rest: a log axis shows both
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.05, 0.1, 0.2, 0.5: several per decade
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_locator(NullLocator())
        axis.grid(alpha=0.3, axis="y")
    _draw_parts(parts, selections, n)
    parts.xaxis.set_major_locator(MaxNLocator(integer=True))
    parts.set_xlim(-0.5, n - 0.5)
    for axis in (angular, influence, parts):
        axis.set_xlabel("parent layer")
        axis.tick_params(labelbottom=True)  # every panel keeps its layer numbers
    return save_figure(figure, path)


def _draw_parts(axis, selections: Mapping, n: int) -> None:
    """One row per selection, a cell per parent layer, coloured by the part it gives the layer (white: dropped)."""
    names = list(selections)
    for part, color in (*PART_COLORS.items(), (None, "white")):
        cells = [(row, layer) for row, name in enumerate(names) for layer in range(n)]
        cells = [(row, layer) for row, layer in cells if selections[names[row]].part_of(layer) == part]
        axis.barh(
            [row for row, _ in cells],
            1.0,
            left=[layer - 0.5 for _, layer in cells],
            height=0.8,
            color=color,
            edgecolor="#999999",
            linewidth=0.5,
            label=part or "dropped",
        )
    axis.set_yticks(range(len(names)), [f"{name} {selections[name].shape}" for name in names], fontsize=8)
    axis.set_ylim(len(names) - 0.4, -0.6)  # the first rule on top
    axis.set_ylabel("rule")
    axis.set_title("Part each rule gives a layer")
