"""The lens figure (`recurfit lens`): a column per token, a row per recurrence step.

Top: the probability of the coda's top prediction after each step, with that prediction's text written where it
changes from the step below (and at step 1), and each exit rule's step marked. Bottom: KL(p_s ‖ p_{s-1}) on a log
colour scale, with the same marks. A line separates the prompt from its continuation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.ticker import MaxNLocator

from ...io.figures import plt, save_figure
from ..lens import Lens

RULE_MARKERS = ("o", "s", "^", "D", "v", "P")
RULE_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")
# Inches per token column and per step row: a 6-point token text of about 6 characters fits a cell.
COLUMN_INCHES, ROW_INCHES = 0.42, 0.2
# A token's text cut to this many characters: in a cell (6-point text), on the token axis (7-point, turned)
CELL_CHARACTERS, AXIS_CHARACTERS = 6, 10


def plot_lens(lens: Lens, path: str | Path, title: str) -> Path:
    """The lens as a figure in the format `path`'s suffix names (.png, .svg or .pdf); returns `path`."""
    path = Path(path)
    tokens, r = lens.top_ids.shape
    width = max(7.0, 1.8 + COLUMN_INCHES * tokens)
    height = 2.2 + ROW_INCHES * r * 1.6 + 0.2 * AXIS_CHARACTERS
    figure, (top, kl) = plt.subplots(
        2, 1, figsize=(width, height), sharex=True, layout="constrained", height_ratios=(1, 0.6)
    )
    figure.suptitle(title)
    extent = (0.5, tokens + 0.5, 0.5, r + 0.5)
    image = top.imshow(
        lens.probabilities.T.numpy(), origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1, extent=extent
    )
    figure.colorbar(image, ax=top, label="probability", pad=0.01)
    _write_predictions(top, lens)
    top.set_title("Top prediction of the next token after each step (its text where it changes)")
    values = lens.kl.T.numpy()
    finite = values[np.isfinite(values) & (values > 0)]
    low, high = (finite.min(), finite.max()) if finite.size else (1e-6, 1.0)
    image = kl.imshow(
        np.where(values > 0, values, np.nan),
        origin="lower",
        aspect="auto",
        cmap="magma",
        norm=LogNorm(vmin=low, vmax=max(high, low * 10)),
        extent=extent,
    )
    figure.colorbar(image, ax=kl, label="KL (nats)", pad=0.01)
    if not finite.size:  # an empty panel would read as a failure to draw
        kl.text(0.5, 0.5, "KL = 0 at every step: no step changes the prediction", ha="center", transform=kl.transAxes)
    kl.set_title("KL(p_s ‖ p_{s-1}) between consecutive steps")
    for axis in (top, kl):
        _mark_exits(axis, lens)
        if lens.prompt_length < tokens:
            axis.axvline(lens.prompt_length + 0.5, color="white", linewidth=2)
        axis.set_ylabel("recurrence step")
        axis.set_ylim(0.5, r + 0.5)
        axis.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(r, 8)))
        axis.set_xlabel("token (prompt, then continuation)")
    kl.set_xticks(range(1, tokens + 1), [_label(token, AXIS_CHARACTERS) for token in lens.tokens])
    for axis in (top, kl):  # each panel keeps its tokens' names
        axis.tick_params(axis="x", labelbottom=True, labelrotation=90, labelsize=7)
    return save_figure(figure, path, formats=(path.suffix,))


def _write_predictions(axis, lens: Lens) -> None:
    """The top prediction's text in the cells where it differs from the step below: a token's run of one
    prediction reads as one label at its start."""
    tokens, r = lens.top_ids.shape
    size = 6 if r <= 48 else 4
    for column in range(tokens):
        for step in range(r):
            if step and lens.top_ids[column, step] == lens.top_ids[column, step - 1]:
                continue
            light = lens.probabilities[column, step] < 0.6  # viridis is dark below about 0.6
            axis.text(
                column + 1,
                step + 1,
                _label(lens.top_tokens[column][step], CELL_CHARACTERS),
                ha="center",
                va="center",
                fontsize=size,
                color="white" if light else "black",
                clip_on=True,
            )


def _mark_exits(axis, lens: Lens) -> None:
    """Each rule's exit step per token, as a hollow marker around the cell's text (the rules offset sideways, so
    that equal steps stay visible)."""
    count = len(lens.rules)
    for i, rule in enumerate(lens.rules):
        offset = (i - (count - 1) / 2) * min(0.25, 0.8 / max(count, 1))
        xs = [column + 1 + offset for column in range(len(lens.tokens))]
        axis.plot(
            xs,
            lens.exits[rule],
            linestyle="none",
            marker=RULE_MARKERS[i % len(RULE_MARKERS)],
            markersize=7,
            markerfacecolor="none",
            markeredgecolor=RULE_COLORS[i % len(RULE_COLORS)],
            markeredgewidth=1.3,
            label=f"exit: {rule}",
        )


def _label(text: str, characters: int) -> str:
    """A token's text as a short label: spaces as ·, newlines as ⏎, at most `characters` long."""
    shown = text.replace(" ", "·").replace("\n", "⏎").replace("\t", "⇥") or "∅"
    return shown if len(shown) <= characters else shown[: characters - 1] + "…"
