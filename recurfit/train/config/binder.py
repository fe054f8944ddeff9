"""The generic YAML binder: a mapping (a YAML file, `key.sub=value` overrides) into nested dataclasses.

It knows nothing of training: the fields' type hints say what each key accepts (str, int, float, bool, a
`Literal`'s choices, lists and tuples, optional values, nested dataclasses), a field named `global_` is the YAML key
`global`, and a dataclass with a `shorthand` class attribute may be written as a bare string for that key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ...errors import RecurfitError


def read_yaml(path: str | Path | None, base: dict | None = None) -> dict:
    """The mapping a YAML file holds (or a copy of `base` when `path` is None)."""
    raw: dict = copy.deepcopy(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecurfitError(f"Config file not found: {path}.")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as problem:
            raise RecurfitError(f"{path} is not valid YAML: {problem}") from None
        if not isinstance(raw, dict):
            raise RecurfitError(f"{path} must hold a mapping of config keys.")
    return raw


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`raw` (changed in place) with each `a.b=value` override set, the value read as YAML; list items are
    numbered from 0 (`data.phases.1.tokens`) and missing sections are created."""
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise RecurfitError(f"Overrides look like key.sub=value, got {override!r}.")
        target = raw
        *parents, last = key.split(".")
        for part in parents:
            target = _override_slot(target, part, override, descend=True)
        _override_slot(target, last, override, descend=False)
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as problem:
            reason = getattr(problem, "problem", None) or "not YAML"
            raise RecurfitError(
                f"Override {override!r}: {value!r} is not a YAML value ({reason}); write lists as [1, 2] and quote "
                "text that holds YAML syntax."
            ) from None
        if isinstance(target, list):
            target[int(last)] = parsed
        else:
            target[last] = parsed
    return raw


def _override_slot(target, part: str, override: str, descend: bool):
    """The section (or list item: `data.phases.1` is the second phase) an override's `part` names; with
    `descend`, a missing section is created."""
    if isinstance(target, list):
        if not part.isdigit() or int(part) >= len(target):
            raise RecurfitError(
                f"Override {override!r}: {part!r} is not an item of a list of {len(target)} (items count from 0)."
            )
        return target[int(part)] if descend else None
    if not isinstance(target, dict):
        raise RecurfitError(f"Override {override!r}: the value before {part!r} is not a section.")
    return target.setdefault(part, {}) if descend else None


def _yaml_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")  # `global_` is `global` in YAML


def bind(cls, raw, where: str = ""):
    """An instance of the dataclass `cls` from the mapping `raw` (`where`: the dotted key it sits at), every value
    converted to its field's type: a RecurfitError naming the key for an unknown key (with the nearest known
    one), a missing required one, or a value of the wrong type or outside a Literal's choices."""
    if not isinstance(raw, dict):
        raise RecurfitError(f"{where or 'the config'} must be a mapping, got {raw!r}.")
    fields = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        key = sorted(unknown)[0]
        hint = difflib.get_close_matches(key, fields, n=1)
        raise RecurfitError(
            f"Unknown config key {where + key!r}"
            + (
                f"; did you mean {where + hint[0]!r}?"
                if hint
                else f"; {where or 'top level'} accepts {sorted(fields)}."
            )
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name in raw:
            values[f.name] = _convert(hints[f.name], raw[name], where + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecurfitError(f"The config needs {where + name!r}.")
    return cls(**values)


def _convert(kind, value, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kind = next(a for a in args if a is not type(None))
        return _convert(kind, value, where)
    if dataclasses.is_dataclass(kind):
        if isinstance(value, str) and getattr(kind, "shorthand", None):
            value = {kind.shorthand: value}  # a bare string for the section's one required key
        return bind(kind, value, where + ".")
    if origin is Literal:
        if value not in args:
            raise RecurfitError(f"{where} must be one of {list(args)}, got {value!r}.")
        return value
    if origin in (list, tuple):  # a tuple field is written as a YAML list: tuple[int, ...]
        if not isinstance(value, list):
            raise RecurfitError(f"{where} must be a list, got {value!r}.")
        items = [_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if origin is list else tuple(items)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 1e-3 as a string
        except ValueError:
            pass
    if kind in (int, str, bool) and type(value) is kind:
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    raise RecurfitError(f"{where} must be {kind.__name__}, got {value!r}.")


def to_plain(value):
    """Dataclasses as mappings of their YAML keys, recursively: what `bind` reads back."""
    if dataclasses.is_dataclass(value):
        return {_yaml_name(f): to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value
