"""The recurrent model's shape (P, R, C) = (prelude, core, coda) layers, and the two rules every entry point
(`RecurrentConfig`, `retrofit`, the train config, the command line) applies to it:

- a shape is three integers with a core of at least one layer and a prelude and coda of zero or more;
- a retrofit is given a shape or explicit prelude/core/coda indices, not both.

Torch-free, so the train config and the command line check a shape before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Sequence


def shape_problem(shape: Sequence[int], num_layers: int | None = None) -> str | None:
    """What is wrong with `shape` as (P, R, C) for a parent of `num_layers` layers (None: any), or None."""
    if len(shape) != 3 or any(not isinstance(x, int) or isinstance(x, bool) for x in shape):
        return f"shape must be three integers (prelude, core, coda), got {tuple(shape)}"
    P, R, C = shape
    if min(P, C) < 0 or R < 1:
        return f"shape {tuple(shape)} needs a core of at least 1 layer and non-negative prelude and coda"
    if num_layers is not None and P + R + C > num_layers:
        return f"shape {tuple(shape)} needs {P + R + C} layers but the parent has only {num_layers}"
    return None


def check_shape(shape: Sequence[int], num_layers: int | None = None) -> tuple[int, int, int]:
    """`shape` as (P, R, C) if `shape_problem` finds nothing; else a ValueError naming the problem."""
    problem = shape_problem(shape, num_layers)
    if problem:
        raise ValueError(problem + ".")
    P, R, C = shape
    return P, R, C


def shape_or_indices_problem(shape, indices: Sequence, shape_name: str, indices_name: str) -> str | None:
    """A retrofit takes its layers from a shape or from explicit indices: giving both is the problem named
    (each caller names the two as its user writes them: `--shape`, `model.shape`, `shape=(P, R, C)`)."""
    if shape is not None and any(part is not None for part in indices):
        return f"give either {shape_name} or {indices_name}, not both"
    return None
