"""Which tests compute in low precision, found from what they run: CI runs them again with oneDNN held to other
CPUs' kernels (ONEDNN_MAX_CPU_ISA), because their tolerances and negative controls hold only if they hold on
every CPU's roundings.

A test is `low_precision` when its code, or the code of anything it reaches in tests/ (fixtures, conftest helpers,
module helpers, transitively), names a low-precision computation: bf16 or fp16 dtypes or settings, autocast, FSDP2's
mixed precision, a Muon built directly or one set to `muon_dtype: auto` (Newton-Schulz in bf16 on CPUs with native
bf16 matmul). Comments and docstrings do not count, nor do decorators: a parametrised test counts by its own
parameters and id. The marker is added at collection, so a new test that computes in bf16 is selected without being
listed anywhere. A test may be left out only by saying why, with `@pytest.mark.not_under_isa_caps("why")`: its
assertions cannot depend on how bf16 rounds, or its bounds are derived from bf16's rounding and it costs more than
the caps' runs can take.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Case-sensitive: constants such as conftest's BF16_LOGIT_TOLERANCE apply only under `--dtype bfloat16`.
LOW_PRECISION = re.compile(r"bfloat16|float16|\bbf16|\bfp16|\.half\(|autocast|Muon\(|muon_dtype\W+auto|MixedPrecision")
MARKER = "low_precision"
DESCRIPTION = (
    f"{MARKER}: computes in bf16/fp16, autocast or bf16 Muon (added from the test's code: tests/low_precision.py)"
)
OPT_OUT = "not_under_isa_caps"
OPT_OUT_DESCRIPTION = f"{OPT_OUT}(why): computes in low precision, left out of scripts/check-isas.sh for the reason"


def computes_in_low_precision(item) -> bool:
    """Whether the collected test `item` runs a low-precision computation (see the module's docstring)."""
    opted_out = item.get_closest_marker(OPT_OUT)
    if opted_out is not None:
        if not opted_out.args or not str(opted_out.args[0]).strip():
            raise ValueError(f"{item.nodeid}: @pytest.mark.{OPT_OUT} needs its reason")
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    if LOW_PRECISION.search(item.name) or any(LOW_PRECISION.search(repr(value)) for value in params.values()):
        return True  # this parametrisation's (a decorator's other parametrisations do not count)
    fixtures = getattr(item, "_fixtureinfo", None)
    roots = [item.function]
    if fixtures is not None:
        roots += [definitions[-1].func for definitions in fixtures.name2fixturedefs.values()]
    return any(names_low_precision(root) for root in roots if _in_tests(root))


@cache
def names_low_precision(function) -> bool:
    """Whether `function`'s code, or that of a function of tests/ it refers to, names low precision."""
    return _reached(function, set())


def _reached(function, seen: set) -> bool:
    if function in seen:
        return False
    seen.add(function)
    if LOW_PRECISION.search(_code_text(function)):
        return True
    scope = getattr(function, "__globals__", {})
    return any(_reached(callee, seen) for callee in _referenced(function, scope) if _in_tests(callee))


def _code_text(function) -> str:
    """The function's source without comments, docstrings and decorators (the item's parameters are read apart)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.decorator_list = []
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def _is_docstring(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _referenced(function, scope: dict):
    """The functions and classes of `scope` that `function`'s code (nested functions included) names."""
    code = getattr(function, "__code__", None)
    codes = [code] if code is not None else []
    while codes:
        current = codes.pop()
        codes += [const for const in current.co_consts if isinstance(const, types.CodeType)]
        for name in current.co_names + current.co_freevars:
            value = scope.get(name)
            if inspect.isfunction(value) or inspect.isclass(value):
                yield from _members(value)
    # A closure's free variables hold functions too (e.g. a fixture returning a local helper).
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if inspect.isfunction(value):
            yield value


def _members(value):
    if inspect.isclass(value):
        yield from (member for member in vars(value).values() if inspect.isfunction(member))
    else:
        yield value


def _in_tests(function) -> bool:
    function = inspect.unwrap(function)
    try:
        return Path(inspect.getfile(function)).resolve().is_relative_to(TESTS)
    except (TypeError, OSError):
        return False
