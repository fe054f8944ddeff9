"""The rich tables `inspect` and `train` print: a model's parts and parameters, FLOPs per token, layer scores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.table import Table

from .accounting import count_parameters, effective_parameters, inference_flops_per_token, training_flops_per_token
from .modeling import RecurrentForCausalLM


def layer_ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 3, 10] → "0–3, 10"; no layers → "—"."""
    if not indices:
        return "—"
    runs, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}–{prev}")
            start = cur
    return ", ".join(runs)


def parts_table(model) -> Table:
    counts = count_parameters(model)
    table = Table(title="Parts", title_justify="left")
    for column in ("part", "parent layers", "parameters"):
        table.add_column(column, justify="right" if column == "parameters" else "left")
    if isinstance(model, RecurrentForCausalLM):
        source = model.config.source_layers or {}
        table.add_row("embeddings (in + out)", "", f"{counts['embeddings']:,}")
        for part in ("prelude", "core", "coda"):
            label = f"{part} ({len(getattr(model.model, part))} layers)" + (" ×r" if part == "core" else "")
            table.add_row(label, layer_ranges(source.get(part, [])), f"{counts[part]:,}")
        table.add_row(f"adapter ({model.config.adapter})", "", f"{counts['adapter']:,}")
        table.add_row("final norm", "", f"{counts['final_norm']:,}")
    else:
        table.add_row("embeddings (in + out)", "", f"{counts['embeddings']:,}")
        table.add_row(f"layers ({model.config.num_hidden_layers})", "all", f"{counts['layers']:,}")
        table.add_row("final norm", "", f"{counts['final_norm']:,}")
    table.add_row("body (paper's count)", "", f"{counts['body']:,}", style="bold")
    table.add_row("total", "", f"{counts['total']:,}")
    return table


def flops_table(model, steps: Sequence[int]) -> Table:
    """Per test recurrence r: effective parameters and forward FLOPs per token; training FLOPs at (r - k, k)."""
    recurrent = isinstance(model, RecurrentForCausalLM)
    depth = model.config.backprop_depth if recurrent else 0
    table = Table(
        title="Compute per token (non-embedding; attention over the context not included)", title_justify="left"
    )
    for column in (
        "r",
        "effective params",
        "inference GFLOPs",
        f"training GFLOPs (k ≤ {depth})" if recurrent else "training GFLOPs",
    ):
        table.add_column(column, justify="right")
    for r in steps if recurrent else [1]:
        k = min(depth, r)
        table.add_row(
            str(r) if recurrent else "—",
            f"{effective_parameters(model, r) / 1e6:,.1f} M",
            f"{inference_flops_per_token(model, r) / 1e9:.3f}",
            f"{training_flops_per_token(model, (r - k, k)) / 1e9:.3f}",
        )
    return table


PART_STYLES = {"prelude": "cyan", "core": "bold magenta", "coda": "green"}


def layer_scores_table(scores, selections: Mapping) -> Table:
    """One row per parent layer: its angular distance and Block Influence (`layer_scores.measure`), and the part
    each selection (`surgery.selection.selections_by_rule`) gives it, "·" where it drops the layer."""
    shapes = ", ".join(f"{rule} {selection.shape}" for rule, selection in selections.items())
    table = Table(
        title=f"Layer scores on {scores.tokens:,} calibration tokens (input → output of each layer), and the part "
        f"each rule gives a layer: {shapes}",
        title_justify="left",
    )
    table.add_column("layer", justify="right")
    table.add_column("angular distance", justify="right")
    table.add_column("Block Influence", justify="right")
    for rule in selections:
        table.add_column(rule)
    for layer, (angular, influence) in enumerate(zip(scores.angular, scores.influence)):
        parts = [selection.part_of(layer) for selection in selections.values()]
        cells = [f"[{PART_STYLES[part]}]{part}[/]" if part else "·" for part in parts]
        table.add_row(str(layer), f"{angular:.4f}", f"{influence:.4f}", *cells)
    return table
