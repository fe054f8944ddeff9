"""Which parent layers become prelude, core and coda: `LayerSelection` (explicit indices, the paper's rule, the
highest-scoring layers, the angular distance's knees), its shape checks, and `select_layers`, the choice
`retrofit` makes from its arguments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..defaults import SELECTIONS
from ..model.shape import check_shape, shape_or_indices_problem
from .layer_scores import LayerScores, block_influence, core_window, knees, measure


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
        P, R, C = check_shape(shape, num_layers)
        return cls(
            tuple(range(P)), tuple(range(num_layers - C - R, num_layers - C)), tuple(range(num_layers - C, num_layers))
        )

    @classmethod
    def from_scores(cls, shape: Sequence[int], scores: Sequence[float]):
        """Keep the P+R+C layers with the highest scores, in parent order, and split them into P, R, C."""
        P, R, C = check_shape(shape, len(scores))
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
        P, R, C = check_shape(shape, n)
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


def select_layers(parent, num_layers, shape, prelude, core, coda, select, calibration) -> LayerSelection:
    """The layers `retrofit(parent, shape, prelude=, core=, coda=, select=, calibration=)` keeps."""
    indices_given = any(part is not None for part in (prelude, core, coda))
    if indices_given and shape is not None:
        both = shape_or_indices_problem(
            shape, (prelude, core, coda), "shape=(P, R, C)", "explicit prelude/core/coda indices"
        )
        raise ValueError(f"G{both[1:]}.")
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {SELECTIONS}, got {select!r}.")
    if indices_given:
        if select != "paper":
            raise ValueError(
                f"select={select!r} chooses layers from a shape; it cannot be combined with explicit indices."
            )
        return LayerSelection.explicit(prelude or [], core or [], coda or [], num_layers)
    if shape is not None:
        check_shape(shape, num_layers)  # an impossible shape fails before the parent runs on calibration text
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
