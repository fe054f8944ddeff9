"""Parameter counts and FLOPs, in the paper's conventions (its §3 and appendix parameter tables).

- "embeddings" counts the input embedding and the unembedding (once if tied).
- A recurrent model's "body" is prelude + core + coda (no adapter, no final norm, as in the paper's tables);
  a fixed-depth model's "body" is its layers plus the final norm.
- FLOPs use non-embedding parameters. One recurrence uses the core and the adapter (inference: the adapter's
  W_e half once per token, its W_s half per step; `inference_flops_per_token`). Training costs
  `6·N1 + 2·N2` per token: N1 = prelude + coda + k·(core + adapter) run with gradient, N2 = n·(core + adapter)
  run without. A fixed-depth model costs `6·N`.
`paper_flops_per_token` and `paper_training_flops` count as the paper authors' own scripts did (no adapter,
no final norm, their curriculum ramp), to reproduce the FLOPs axes of the paper's figures.
All functions take a model (a meta-device model is fine) or the dict `count_parameters` returns. The rules,
with the paper's sections: docs/reference/method.md ("FLOPs").
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from ..defaults import RAMP_ROUNDINGS
from .modeling import RecurrentForCausalLM
from .sampling import split_depth


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameters by part. Recurrent: embeddings, prelude, core, coda, adapter, final_norm (+ body, total);
    a fixed-depth parent: embeddings, layers, final_norm (+ body, total)."""
    embeddings = _numel(model.get_input_embeddings())
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        embeddings += _numel(head)
    body = model.model
    if isinstance(model, RecurrentForCausalLM):
        counts = {
            "embeddings": embeddings,
            "prelude": _numel(body.prelude),
            "core": _numel(body.core),
            "coda": _numel(body.coda),
            "adapter": _numel(body.adapter),
            "final_norm": _numel(body.norm),
        }
        counts["body"] = counts["prelude"] + counts["core"] + counts["coda"]
    else:
        counts = {"embeddings": embeddings, "layers": _numel(body.layers), "final_norm": _numel(body.norm)}
        counts["body"] = counts["layers"] + counts["final_norm"]
    counts["total"] = _numel(model)  # parameters() yields a tied matrix once
    return counts


def _counts(model_or_counts) -> Mapping[str, int]:
    return model_or_counts if isinstance(model_or_counts, Mapping) else count_parameters(model_or_counts)


def _is_recurrent(counts: Mapping[str, int]) -> bool:
    return "core" in counts


def effective_parameters(model_or_counts, num_steps: int) -> int:
    """Non-embedding parameters applied per token at r = `num_steps`: prelude + r·core + coda.

    A fixed-depth model's effective parameters are its body, whatever r."""
    c = _counts(model_or_counts)
    if not _is_recurrent(c):
        return c["body"]
    return c["prelude"] + num_steps * c["core"] + c["coda"]


def _step_parameters(c: Mapping[str, int]) -> int:
    return c["core"] + c["adapter"]


def inference_flops_per_token(model_or_counts, num_steps: int) -> int:
    """Forward FLOPs per token at r recurrences: 2 × (prelude + adapter/2 + r·(core + adapter/2) + coda + final
    norm). Inference multiplies e by the adapter's W_e half once per token (e is the same at every step) and the
    state by its W_s half at each step.

    Attention over the context is not included (it depends on the sequence length)."""
    c = _counts(model_or_counts)
    if not _is_recurrent(c):
        return 2 * c["body"]
    embedded_half = c["adapter"] // 2
    per_step = c["core"] + c["adapter"] - embedded_half
    return 2 * (c["prelude"] + embedded_half + num_steps * per_step + c["coda"] + c["final_norm"])


def training_flops_per_token(model_or_counts, num_steps: tuple[int, int]) -> int:
    """Training FLOPs per token for one step of depth (n, k): 6·N1 + 2·N2 (6·N for a fixed-depth model)."""
    c = _counts(model_or_counts)
    if not _is_recurrent(c):
        return 6 * c["body"]
    n, k = num_steps
    with_grad = c["prelude"] + c["coda"] + c["final_norm"] + k * _step_parameters(c)
    return 6 * with_grad + 2 * n * _step_parameters(c)


def training_flops(model_or_counts, tokens: int, mean_recurrence: int = 1, backprop_depth: int = 1) -> int:
    """Total training FLOPs for `tokens` tokens at the mean depth r̄ (split into n without gradient and k with
    as `sampling.split_depth` does), adapter and final norm counted. The count the paper's figures use, with
    their curriculum ramps and without adapter or final norm, is `paper_training_flops`."""
    return tokens * training_flops_per_token(model_or_counts, split_depth(mean_recurrence, backprop_depth))


# ---------------------------------------------------------------- the paper's accounting, as its figures took it


def paper_flops_per_token(model_or_counts, recurrence: int, backprop_depth: int) -> int:
    """Training FLOPs per token of a step at recurrence r with backprop depth k̄, as the paper authors'
    `param_counter.py` counts them: `6·N1 + 2·N2` with N1 = prelude + min(r, k̄)·core + coda and
    N2 = max(r - k̄, 0)·core. Unlike `training_flops_per_token`, the adapter and the final norm are not counted.
    A fixed-depth model costs 6 × (its layers + final norm), as their baselines."""
    c = _counts(model_or_counts)
    if not _is_recurrent(c):
        return 6 * c["body"]
    with_grad = c["prelude"] + min(recurrence, backprop_depth) * c["core"] + c["coda"]
    return 6 * with_grad + 2 * max(recurrence - backprop_depth, 0) * c["core"]


def paper_ramp(step: int, target: int, kind: str, fraction: float, total_steps: int, rounding: str = "floor") -> int:
    """The depth the paper's FLOPs accounting gives optimizer step `step` (0-based) of a curriculum to `target`
    over `fraction` of `total_steps`: the authors' `warmup_hist` puts the steps from int(f⁻¹((d-1)/D)·W) up to
    int(f⁻¹(d/D)·W) at depth d, W = int(fraction · total_steps), f⁻¹(y) = y (linear) or 1 - (1 - y)² (1-sqrt),
    and every later step at D. `rounding="ceil"` rounds those boundaries up instead, as the commented-out
    `ceil_div` line of their `param_counter.py`, which the plotted runs of `loop_whole_model` were counted with.
    (The steps a run actually takes follow `sampling.Curriculum`, which rounds differently again: the counts
    differ by one depth on some steps of the ramp.)"""
    for depth, end in enumerate(_ramp_ends(target, kind, fraction, total_steps, rounding), start=1):
        if step < end:
            return depth
    return target


def _ramp_ends(target: int, kind: str, fraction: float, total_steps: int, rounding: str = "floor") -> list[int]:
    """The first step after depth d, for d = 1 … target, of the authors' ramp (none for a constant depth)."""
    if rounding not in RAMP_ROUNDINGS:
        raise ValueError(f"rounding must be one of {RAMP_ROUNDINGS}, not {rounding!r}")
    if kind == "constant":
        return []
    ramp_steps = int(fraction * total_steps)
    if kind == "linear" and rounding == "ceil":
        # Their ceil_div(d · W, D) in integers: a float d/D · W can land a hair above a whole step.
        return [-(-depth * ramp_steps // target) for depth in range(1, target + 1)]
    inverse = (lambda y: 1.0 - (1.0 - y) ** 2) if kind == "1-sqrt" else (lambda y: y)
    round_ = math.ceil if rounding == "ceil" else int
    return [round_(inverse(depth / target) * ramp_steps) for depth in range(1, target + 1)]


def paper_training_flops(
    model_or_counts,
    steps_done: int,
    tokens_per_step: int,
    *,
    total_steps: int,
    mean_recurrence: int,
    backprop_depth: int,
    curriculum: str = "constant",
    curriculum_fraction: float = 0.0,
    backprop_curriculum: str = "constant",
    backprop_curriculum_fraction: float = 0.0,
    ramp_rounding: str = "floor",
) -> float:
    """Training FLOPs after `steps_done` optimizer steps as the paper's figures count them (the FLOPs column of
    the authors' `paper_plots/data/*.jsonl`): each step at its `paper_ramp` depth, `paper_flops_per_token`
    per token, `tokens_per_step` tokens (their plots assume 2²⁰, i.e. 1,024 rows of 1,024 tokens, for every run);
    `ramp_rounding` as `paper_ramp`."""
    c = _counts(model_or_counts)
    ramps = [
        (mean_recurrence, curriculum, curriculum_fraction, total_steps, ramp_rounding),
        (backprop_depth, backprop_curriculum, backprop_curriculum_fraction, total_steps, ramp_rounding),
    ]
    # The depths change only where a ramp ends a depth: cost each stretch between two changes at once.
    changes = {0, *(end for ramp in ramps for end in _ramp_ends(*ramp))}
    starts = sorted(step for step in changes if step < steps_done)
    total = 0
    for start, end in zip(starts, [*starts[1:], steps_done]):
        recurrence, backprop = (paper_ramp(start, *ramp) for ramp in ramps)
        total += (end - start) * paper_flops_per_token(c, recurrence, backprop)
    return float(total * tokens_per_step)
