#!/usr/bin/env python3
"""Rearrange tests/ so that the tests of `recurfit/X/Y.py` live in `tests/test_X_Y.py`.

    python3 scripts/dev/arrange_tests.py             # move every test where scripts/dev/test_layout.toml says
    python3 scripts/dev/arrange_tests.py --dry-run   # say what would move, write nothing
    python3 scripts/dev/arrange_tests.py --check     # verify the layout, move nothing

The layout file maps each target file (flat in tests/) to the tests it holds, as `source.py::test_name`. A move
takes each test function with its decorators, and the module constants, helper functions, classes and
fixtures it needs (found through the names it uses and the fixtures its arguments name). A helper that tests
in two or more files need goes to tests/conftest.py: fixtures are simply defined there, other names are
imported as `from conftest import name`. No test file imports another afterwards: `from test_x import name`
becomes `from conftest import name`. Each target gets the import blocks of its sources, then
`ruff check --fix --select F401,I` and `ruff format` drop the unused imports.

A source's `pytestmark` becomes a decorator of each of its tests when they share a file with tests of another
source. conftest.py's TRAINING_MODULES/DEVICE_MODULES (the test modules that follow --device and --dtype) are
rewritten for the new files; a test placed beside tests that follow more options than it did gets
`cpu_only`/`float32_only`, so that every test runs on the same devices and dtypes as before.

A helper moved to conftest.py imports what is not in the standard library inside its body, as conftest.py
does, so that conftest.py stays light (the GPU machine lacks lm-eval and datasets). Two helpers (or imports)
of one name meeting in one file stop the move: `[rename]` in the layout gives one a new name, and the code that
uses it follows. Two imports of one name that are the same object (a re-export) are merged; the project's
Python (.venv/bin/python) says whether they are.

Stops before writing when a test is not named in the layout (unless its file is one the layout fills; it
stays where it is, listed), when a layout entry names no test, when names would meet, or when the moved tests'
names differ from the old ones; exits non-zero when `ruff check --select F821,F811` finds an undefined or
doubly bound name afterwards. A second run changes nothing. `--check` fails on a test file named after no
module (test_<package>_<module>.py) and not cross-cutting, on a file the layout empties, on a test file that
imports another, and on docs or scripts that name a test file that is not there (saying where its tests went).
Stdlib only, plus ruff (.venv/bin or PATH) for the tidy-up.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
LAYOUT = Path(__file__).with_name("test_layout.toml")
SHARED = "conftest.py"
# conftest.py's sets of test modules that follow --device (training) and --device/--dtype (the rest).
PLACEMENT_SETS = ("TRAINING_MODULES", "DEVICE_MODULES")
ONLY_CPU = "not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)"
ONLY_FLOAT32 = "a training test: --dtype does not move it (training runs in the precision its config asks for)"
RANK = {"none": 0, "training": 1, "dtype": 2}


@dataclass
class Unit:
    """One top-level statement of a test file."""

    source: str
    node: ast.stmt
    text: str
    kind: str  # docstring, future, import, test, fixture, helper, pytestmark, other
    names: set[str] = field(default_factory=set)  # the names it binds
    uses: set[str] = field(default_factory=set)  # the names it reads (and the fixtures its arguments name)


@dataclass
class Module:
    name: str  # file name, e.g. test_train.py
    units: list[Unit]

    def defined(self) -> dict[str, Unit]:
        return {n: u for u in self.units if u.kind in ("helper", "fixture") for n in u.names}

    def imports_from_tests(self) -> dict[str, tuple[str, str]]:
        """{local name: (test module file, name there)} of `from test_x import name [as local]`."""
        found = {}
        for unit in self.units:
            for node in ast.walk(unit.node):
                if isinstance(node, ast.ImportFrom) and is_test_module(node.module):
                    for alias in node.names:
                        found[alias.asname or alias.name] = (f"{node.module}.py", alias.name)
        return found


def is_test_module(name: str | None) -> bool:
    return bool(name) and name.startswith("test_")


def is_fixture(node: ast.AST) -> bool:
    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return ast.unparse(d)

    return isinstance(node, ast.FunctionDef) and any(
        name(d) in ("pytest.fixture", "fixture") for d in node.decorator_list
    )


def bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names |= bound_names(sub)
    return names


def read_module(path: Path) -> Module:
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    units = []
    for index, node in enumerate(tree.body):
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        # Comment lines directly above (no blank line between) belong to the statement.
        start = first
        previous_end = tree.body[index - 1].end_lineno if index else 0
        while start - 1 > previous_end and lines[start - 2].lstrip().startswith("#"):
            start -= 1
        unit_text = "".join(lines[start - 1 : node.end_lineno])
        uses = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            uses |= {f"fixture:{a.arg}" for a in arguments}
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            kind = "docstring"
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            kind = "future"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            kind = "import"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            kind = "test"
        elif is_fixture(node):
            kind = "fixture"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
            kind = "pytestmark" if bound_names(node) == {"pytestmark"} else "helper"
        else:
            kind = "other"  # module-level code (a skip, an environment setting): goes with every test of the file
        units.append(Unit(path.name, node, unit_text, kind, bound_names(node), uses))
    return Module(path.name, units)


# ---------------------------------------------------------------- the layout file


def read_layout(path: Path) -> tuple[dict[str, list[tuple[str, str]]], list[str], dict[tuple[str, str], str]]:
    layout = tomllib.loads(path.read_text())
    targets = {}
    for target, entries in layout.get("targets", {}).items():
        targets[target] = [tuple(entry.split("::", 1)) for entry in entries]
    renames = {tuple(key.split("::", 1)): new for key, new in layout.get("rename", {}).items()}
    return targets, layout.get("cross_cutting", []), renames


# ---------------------------------------------------------------- the move


class Problems(list):
    def say(self, message: str) -> None:
        self.append(message)
        print(f"error: {message}", file=sys.stderr)


def placement_sets(conftest: str) -> dict[str, str]:
    """{test module: 'training' | 'dtype'} from conftest.py's TRAINING_MODULES and DEVICE_MODULES."""
    values = {}
    for node in ast.parse(conftest).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and getattr(node.targets[0], "id", "") in PLACEMENT_SETS
        ):
            members = set()
            for element in node.value.elts:
                if isinstance(element, ast.Starred):
                    members |= values[element.value.id]
                else:
                    members.add(element.value)
            values[node.targets[0].id] = members
    classes = {m: "dtype" for m in values.get("DEVICE_MODULES", set())}
    classes.update({m: "training" for m in values.get("TRAINING_MODULES", set())})
    return classes


def rewrite_placement_sets(conftest: str, classes: dict[str, str]) -> str:
    training = sorted(m for m, c in classes.items() if c == "training")
    dtype = sorted(m for m, c in classes.items() if c == "dtype")
    new = {
        "TRAINING_MODULES": "{" + ", ".join(f'"{m}"' for m in training) + "}",
        "DEVICE_MODULES": "{" + ", ".join([*(f'"{m}"' for m in dtype), "*TRAINING_MODULES"]) + "}",
    }
    lines = conftest.splitlines(keepends=True)
    for node in reversed(ast.parse(conftest).body):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in new:
            value = node.value
            first, last = lines[value.lineno - 1], lines[value.end_lineno - 1]
            text = first[: value.col_offset] + new[node.targets[0].id] + last[value.end_col_offset :]
            lines[value.lineno - 1 : value.end_lineno] = [text] + [""] * (value.end_lineno - value.lineno)
    return "".join(lines)


def renamed_text(
    unit: Unit, renames: dict[str, str], shared: dict[tuple[str, str], str] | None = None, inject: list[str] = ()
) -> str:
    """The unit's text with every name in `renames` (old → new) replaced where the code reads or binds it.

    An import from a test module inside a function goes: the target file defines or imports its names at the
    top. Only an aliased name of conftest.py (`shared`: {(test file, name): name in conftest}) stays, imported
    from conftest.
    """
    lines = unit.text.splitlines(keepends=True)
    first_line = unit.node.end_lineno - len(lines) + 1
    edits = []  # (line index, start col, end col, new): columns count UTF-8 bytes, as ast's do
    nested = [n for n in ast.walk(unit.node) if isinstance(n, ast.ImportFrom) and is_test_module(n.module)]
    for node in nested:
        if node is unit.node:
            continue
        keys = [(f"{node.module}.py", a.name, a.asname) for a in node.names if a.asname]
        names = ", ".join(f"{shared[m, n]} as {alias}" for m, n, alias in keys if (m, n) in (shared or {}))
        start, end = node.lineno - first_line, node.end_lineno - first_line
        indent = lines[start][: node.col_offset]
        replacement = [f"{indent}from conftest import {names}\n"] if names else []
        lines[start : end + 1] = replacement + [""] * (end - start + 1 - len(replacement))
    if inject:  # import statements at the top of the function's body, after its docstring
        body = unit.node.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1
        index = (body[0].end_lineno + 1 if has_doc else body[1 if has_doc else 0].lineno) - first_line
        indent = " " * body[-1].col_offset
        lines[index] = (
            "".join(f"{indent}{line}" for text in inject for line in text.splitlines(keepends=True))
            + ("\n" if has_doc else "")
            + lines[index]
        )
    if not renames:
        return "".join(lines)
    for node in ast.walk(unit.node):
        if isinstance(node, ast.Name) and node.id in renames:
            edits.append((node.lineno - first_line, node.col_offset, node.end_col_offset, renames[node.id]))
        elif isinstance(node, ast.arg) and node.arg in renames:  # a fixture, by its name
            index = node.lineno - first_line
            edits.append((index, node.col_offset, node.col_offset + len(node.arg.encode()), renames[node.arg]))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in renames:
            index = node.lineno - first_line
            line = lines[index].encode()
            match = re.search(rb"\b(def|class)\s+(" + node.name.encode() + rb")\b", line)
            edits.append((index, match.start(2), match.end(2), renames[node.name]))
    for index, start, end, new in sorted(edits, reverse=True):
        line = lines[index].encode()
        lines[index] = (line[:start] + new.encode() + line[end:]).decode()
    return "".join(lines)


def import_text(
    unit: Unit,
    renames: dict[tuple[str, str], str],
    promoted: set,
    problems,
    shared: bool,
    used: set[str],
    rename: dict[str, str],
) -> str:
    """An import statement as it goes to a target (or to conftest.py when `shared`).

    `from test_x import name` disappears: the name is either defined in the target itself or imported from
    conftest.py with the other shared names; only an alias (`import name as other`) is kept, from conftest.
    """
    node = unit.node
    if not isinstance(node, ast.ImportFrom) or not (is_test_module(node.module) or node.module == "conftest"):
        if not any((a.asname or a.name) in rename for a in node.names):
            return unit.text
        names = [
            ast.alias(a.name, rename.get(a.asname or a.name, a.asname) if "." not in a.name else a.asname)
            for a in node.names
        ]
        if isinstance(node, ast.ImportFrom):
            return ast.unparse(ast.ImportFrom(node.module, names, node.level)) + "\n"
        return ast.unparse(ast.Import(names)) + "\n"
    if node.module == "conftest" and not shared:
        return unit.text
    kept = []
    for alias in node.names:
        key = (f"{node.module}.py", alias.name)
        name = renames.get(key, alias.name) if is_test_module(node.module) else alias.name
        if alias.asname and alias.asname != name and alias.asname in used:
            if shared or (is_test_module(node.module) and key not in promoted):
                problems.say(f"{unit.source}: `import {alias.name} as {alias.asname}` cannot move; import it unaliased")
            else:
                kept.append(f"{name} as {alias.asname}")
    return f"from conftest import {', '.join(kept)}\n" if kept else ""


def arrange(args) -> int:
    tests_dir = REPO / "tests"
    problems = Problems()
    targets, cross_cutting, renames = read_layout(args.layout)
    sources = {p.name: read_module(p) for p in sorted(tests_dir.glob("test_*.py"))}
    conftest_path = tests_dir / SHARED
    conftest_text = conftest_path.read_text()
    conftest_module = read_module(conftest_path)
    classes = placement_sets(conftest_text)

    # Where each test goes; tests the layout does not name stay where they are.
    place: dict[tuple[str, str], str] = {}

    def tests_in(file: str) -> set[str]:
        return {n for u in sources[file].units if u.kind == "test" for n in u.names} if file in sources else set()

    for target, entries in targets.items():
        for source, name in entries:
            if name not in tests_in(source) and name in tests_in(target):
                source = target  # moved already: a second run leaves it there
            if name not in tests_in(source):
                problems.say(f"{args.layout.name}: {target} names {source}::{name}, which is not a test in tests/")
            elif (source, name) in place:
                problems.say(f"{args.layout.name}: {source}::{name} is placed twice ({place[source, name]}, {target})")
            else:
                place[source, name] = target
    unplaced = [
        (s, n) for s, m in sources.items() for u in m.units if u.kind == "test" for n in u.names if (s, n) not in place
    ]
    for source, name in unplaced:
        place[source, name] = source
    # A test the layout does not name stays where it is: an error unless its file is one the layout fills.
    misplaced = [(s, n) for s, n in unplaced if s not in targets and s not in cross_cutting]
    if misplaced:
        problems.say(
            f"{len(misplaced)} tests are not in {args.layout.name}; they stay where they are:\n  "
            + "\n  ".join(f"{s}::{n}" for s, n in misplaced)
        )
    if len(unplaced) > len(misplaced):
        print(f"note: {len(unplaced) - len(misplaced)} tests the layout does not name stay in their file, one of its:")
        print("  " + "\n  ".join(f"{s}::{n}" for s, n in unplaced if (s, n) not in misplaced))

    # The helpers each test needs, through names (and fixture arguments), across `from test_x import` too.
    def resolve(source: str, name: str) -> tuple[str, str] | None:
        module = sources[source]
        if name.startswith("fixture:"):
            name = name.removeprefix("fixture:")
            unit = module.defined().get(name)
            return (source, name) if unit is not None and unit.kind == "fixture" else None
        if name in module.defined():
            return source, name
        imported = module.imports_from_tests().get(name)
        if imported and imported[0] in sources and imported[1] in sources[imported[0]].defined():
            return imported
        return None

    def units_of(source: str, name: str) -> Unit:
        return sources[source].defined()[name]

    needed_by: dict[tuple[str, str], set[str]] = defaultdict(set)  # helper → target files that need it
    helper_deps: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for source, module in sources.items():
        for unit in module.units:
            if unit.kind in ("helper", "fixture"):
                for name in unit.names:
                    helper_deps[source, name] = {d for d in (resolve(source, u) for u in unit.uses) if d}
    marks = {s: [u for u in m.units if u.kind in ("pytestmark", "other")] for s, m in sources.items()}

    def closure(start: set[tuple[str, str]]) -> set[tuple[str, str]]:
        seen, todo = set(), list(start)
        while todo:
            key = todo.pop()
            if key not in seen:
                seen.add(key)
                todo.extend(helper_deps.get(key, ()))
        return seen

    for (source, name), target in place.items():
        unit = next(u for u in sources[source].units if u.kind == "test" and name in u.names)
        uses = set(unit.uses) | {n for m in marks[source] for n in m.uses}
        for key in closure({d for d in (resolve(source, u) for u in uses) if d}):
            needed_by[key].add(target)
    promoted = {key for key, where in needed_by.items() if len(where) > 1}
    promoted = closure(promoted)
    for key in helper_deps:
        if key not in needed_by:
            print(f"note: {key[0]}::{key[1]} is used by no test; it is dropped", file=sys.stderr)

    # Renames: helpers whose name is taken in conftest.py.
    for key in sorted(promoted):
        new = renames.get(key, key[1])
        unit = units_of(*key)
        same = [u for u in conftest_module.units if new in u.names]
        if same and not (len(same) == 1 and same[0].text == renamed_text(unit, {key[1]: new})):
            problems.say(
                f"{key[0]}::{key[1]} goes to conftest.py, which defines {new} already; give it another name under "
                f"[rename] in {args.layout.name}"
            )

    def local_renames(source: str) -> dict[str, str]:
        """Names to rewrite in `source`'s code: its own renamed helpers, and those it imports unaliased."""
        out = {name: new for (s, name), new in renames.items() if s == source}
        for local, (other, name) in sources[source].imports_from_tests().items():
            if (other, name) in renames and local == name:
                out[local] = renames[other, name]
        return out

    shared_keys = {key: renames.get(key, key[1]) for key in promoted}

    def unit_deps(source: str, unit: Unit) -> set[tuple[str, str]]:
        return {d for d in (resolve(source, u) for u in unit.uses) if d} - {(source, n) for n in unit.names}

    def text_of(unit: Unit, source: str, inject: list[str] = ()) -> str:
        return renamed_text(unit, local_renames(source), shared_keys, inject)

    # Build each target's text.
    by_target: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for (source, name), target in place.items():
        by_target[target].append((source, name))
    shared_names = {renames.get(k, k[1]): k for k in promoted}
    shared_text: dict[str, str] = {}
    for new, key in shared_names.items():
        shared_text[new] = text_of(units_of(*key), key[0])
    outputs: dict[str, str] = {}
    clashes: list[tuple[str, str, str, str]] = []
    new_classes: dict[str, str] = {}
    for target in sorted(by_target):
        placed = by_target[target]
        test_sources = sorted({s for s, _ in placed}, key=lambda s: (s != target, s))
        local = {k for k, where in needed_by.items() if target in where and k not in promoted}
        helper_sources = sorted({k[0] for k in local} - set(test_sources))
        target_class = max((classes.get(s[:-3], "none") for s in test_sources), key=RANK.get)
        if target_class != "none":
            new_classes[target[:-3]] = target_class
        marks_as_decorators = len({marks_text(marks[s]) for s in test_sources}) > 1
        chunks, helpers, tests, imports, futures, seen_names = [], [], [], [], False, {}
        needs_pytest = False
        shared_here = {renames.get(k, k[1]) for k in promoted if target in needed_by[k]}
        for source in test_sources + helper_sources:
            module = sources[source]
            used_here = {n for u in module.units for n in u.uses}
            tests_here = {n for s, n in placed if s == source}
            for unit in module.units:
                if unit.kind == "future":
                    futures = True
                elif unit.kind == "import":
                    text = import_text(unit, renames, promoted, problems, False, used_here, local_renames(source))
                    if text and text not in imports:
                        imports.append(text)
                elif unit.kind in ("pytestmark", "other") and source in test_sources:
                    if unit.kind == "other" or not marks_as_decorators:
                        text = text_of(unit, source)
                        if text not in chunks:
                            chunks.append(text)
                elif unit.kind in ("helper", "fixture") and {(source, n) for n in unit.names} & local:
                    text = text_of(unit, source)
                    new_names = {local_renames(source).get(n, n) for n in unit.names}
                    for name in new_names:
                        if name in shared_here and shared_text.get(name) != text:
                            problems.say(f"{target}: {source}'s {name} meets conftest.py's {name}, a different one")
                        if name in seen_names and seen_names[name][0] != text:
                            problems.say(f"{target}: {name} is defined in both {seen_names[name][1]} and {source}")
                        seen_names[name] = (text, source)
                    if not new_names <= shared_here and text not in [h[2] for h in helpers]:
                        helpers.append(({(source, n) for n in unit.names}, unit_deps(source, unit), text))
                elif unit.kind == "test" and unit.names & tests_here:
                    decorators = []
                    if marks_as_decorators:
                        decorators += [
                            f"@{d}\n" for m in marks[source] if m.kind == "pytestmark" for d in mark_exprs(m)
                        ]
                    own = classes.get(source[:-3], "none")
                    if own == "none" and target_class != "none":
                        decorators.append(f'@pytest.mark.cpu_only("{ONLY_CPU}")\n')
                    if own != "dtype" and target_class == "dtype":
                        reason = ONLY_FLOAT32 if own == "training" else ONLY_CPU
                        decorators.append(f'@pytest.mark.float32_only("{reason}")\n')
                    needs_pytest |= bool(decorators)
                    tests.append(with_decorators(text_of(unit, source), unit, decorators))
        shared_fixtures = {n for n, k in shared_names.items() if units_of(*k).kind == "fixture"}
        shared_imports = sorted((shared_here - shared_fixtures) - {n for n in seen_names if n not in shared_here})
        imports = used_submodules(imports, "\n\n".join(chunks + [h[2] for h in helpers] + tests))
        clashing_imports(target, imports, clashes)
        head = module_docstring(target, sources, test_sources)
        head += "from __future__ import annotations\n\n" if futures else ""
        head += "".join(imports) + ("import pytest\n" if needs_pytest else "")
        if shared_imports:
            head += f"from conftest import {', '.join(shared_imports)}\n"
        outputs[target] = head + "\n\n" + "\n\n".join(chunks + in_order(helpers) + tests) + "\n"

    # conftest.py: the promoted helpers, their sources' imports, the new placement sets.
    if promoted:
        added_imports, added, added_names = [], [], {}
        light = set(sys.stdlib_module_names) | {
            top_module(u.node) for u in conftest_module.units if u.kind in ("import", "future")
        }
        for source in sorted({s for s, _ in promoted}):
            used = {n for k in promoted if k[0] == source for n in units_of(*k).uses}
            heavy = []  # (names bound, statement): imported where a function needs them, as conftest.py does
            for unit in sources[source].units:
                if unit.kind == "import":
                    text = import_text(unit, renames, promoted, problems, True, used, local_renames(source))
                    if text and top_module(unit.node) not in light:
                        heavy.append((unit.names, text))
                    elif text and text not in added_imports:
                        added_imports.append(text)
            for unit in sources[source].units:
                if unit.kind in ("helper", "fixture") and any((source, n) in promoted for n in unit.names):
                    needs = [text for names, text in heavy if names & unit.uses]
                    signature = signature_names(unit.node)
                    added_imports.extend(t for names, t in heavy if names & signature and t not in added_imports)
                    needs = [t for t in needs if t not in added_imports]
                    is_function = isinstance(unit.node, ast.FunctionDef) and unit.node.body[0].lineno > unit.node.lineno
                    if needs and not is_function:
                        added_imports.extend(t for t in needs if t not in added_imports)
                    text = text_of(unit, source, needs if is_function else [])
                    if text in [a[2] for a in added] or any(u.text == text for u in conftest_module.units):
                        continue  # there already, word for word
                    for name in {local_renames(source).get(n, n) for n in unit.names}:
                        if name in added_names:
                            problems.say(
                                f"conftest.py would get two helpers named {name} ({added_names[name]}, {source}); "
                                f"give one another name under [rename] in {args.layout.name}"
                            )
                        added_names[name] = source
                    added.append(({(source, n) for n in unit.names}, unit_deps(source, unit), text))
        conftest_imports = [u.text for u in conftest_module.units if u.kind == "import"]
        clashing_imports(SHARED, conftest_imports + added_imports, clashes)
        lines = conftest_text.splitlines(keepends=True)
        last_import = max(u.node.end_lineno for u in conftest_module.units if u.kind in ("import", "future"))
        conftest_text = "".join(lines[:last_import]) + "".join(added_imports) + "".join(lines[last_import:])
        conftest_text = conftest_text.rstrip("\n") + (
            f"\n\n\n# {'-' * 64} shared by several test files\n\n\n" + "\n\n".join(in_order(added)) + "\n"
        )
    conftest_text = rewrite_placement_sets(conftest_text, new_classes)
    for target, local, _, second in real_clashes(clashes, problems):  # one object under two names: keep one
        if target == SHARED:
            conftest_text = drop_import(conftest_text, local, second)
        else:
            outputs[target] = drop_import(outputs[target], local, second)

    old_names = Counter(n for s, m in sources.items() for u in m.units if u.kind == "test" for n in u.names)
    new_names = Counter(n for t, p in by_target.items() for _, n in p)
    if old_names != new_names:
        problems.say(f"the tests' names changed: {sorted((old_names - new_names) + (new_names - old_names))}")
    for target, placed in by_target.items():
        for name, count in Counter(n for _, n in placed).items():
            if count > 1:
                problems.say(f"{target} would hold two tests named {name}")

    moved_away = sorted(set(sources) - set(outputs))
    shared_list = ", ".join(sorted(shared_names))
    print(f"{sum(old_names.values())} tests from {len(sources)} files into {len(outputs)} files; ")
    print(f"{len(promoted)} helpers go to conftest.py: {shared_list}")
    print(f"files that disappear: {', '.join(moved_away) or 'none'}")
    if args.dry_run:
        for target in sorted(outputs):
            froms = ", ".join(sorted({s for s, _ in by_target[target]}))
            print(f"  {target}: {len(by_target[target])} tests from {froms}")
        return 1 if problems else 0
    if problems and not args.force:
        print(f"nothing written: {len(problems)} problems (--force writes anyway)", file=sys.stderr)
        return 1

    for name in moved_away:
        (tests_dir / name).unlink()
    for target, text in outputs.items():
        (tests_dir / target).write_text(text)
    conftest_path.write_text(conftest_text)
    written = [str(tests_dir / t) for t in sorted(outputs)] + [str(conftest_path)]
    ruff = find_ruff()
    subprocess.run([ruff, "check", "--quiet", "--fix", "--select", "F401,I", *written], cwd=REPO)
    subprocess.run([ruff, "format", "--quiet", *written], cwd=REPO, check=True)
    command = [ruff, "check", "--select", "F821,F811", "--output-format", "concise", *written]
    undefined = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if undefined.returncode:
        problems.say(
            "undefined or twice-bound names after the move (give one a new name under [rename]):\n" + undefined.stdout
        )
    print(f"wrote {len(outputs)} test files and conftest.py" + ("; see the errors above" if problems else ""))
    print("\nWhat `--check` says now (the docs and scripts name test files; fix them by hand):")
    check_layout(tests_dir, cross_cutting, targets)
    return 1 if problems else 0


def clashing_imports(target: str, imports: list[str], clashes: list[tuple[str, str, str, str]]) -> None:
    """Collect where the sources' imports bind one name to two things (ruff would keep one of them silently)."""
    bound: dict[str, str] = {}
    for text in imports:
        for node in ast.parse(text).body:
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                module = node.module if isinstance(node, ast.ImportFrom) else ""
                what = f"{module}:{alias.name}" if module else alias.name if alias.asname else local
                if bound.setdefault(local, what) != what:
                    clashes.append((target, local, bound[local], what))


def real_clashes(clashes: list[tuple[str, str, str, str]], problems: Problems) -> list[tuple[str, str, str, str]]:
    """Say which clashes bind two different objects: `recurfit.train:load_config` re-exported from
    `recurfit.train.config` is one object, and no clash. Asks the project's Python (.venv/bin/python)."""
    if not clashes:
        return []
    python = REPO / ".venv" / "bin" / "python"
    code = (
        "import importlib, json, sys\n"
        "def get(spec):\n"
        "    module, _, name = spec.partition(':')\n"
        "    try:\n"
        "        return getattr(importlib.import_module(module), name) if name else importlib.import_module(module)\n"
        "    except Exception as error:\n"
        "        return error\n"
        "print(json.dumps([get(a) is get(b) for a, b in json.load(sys.stdin)]))\n"
    )
    pairs = json.dumps([(a, b) for _, _, a, b in clashes])
    answer = subprocess.run(
        [str(python) if python.exists() else sys.executable, "-c", code], input=pairs, capture_output=True, text=True
    )
    same = json.loads(answer.stdout) if answer.returncode == 0 else [False] * len(clashes)
    for (target, local, first, second), one in zip(clashes, same):
        if not one:
            problems.say(f"{target}: {local} would be both {first} and {second}; give one a new name under [rename]")
    return [clash for clash, one in zip(clashes, same) if one]


def drop_import(text: str, local: str, spec: str) -> str:
    """`text` without the top-level import that binds `local` as `spec` (module:name): another binds it already."""
    module, _, name = spec.partition(":")
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        if isinstance(node, ast.ImportFrom) and node.module == module:
            kept = [a for a in node.names if not (a.name == name and (a.asname or a.name) == local)]
            if len(kept) < len(node.names):
                new = ast.unparse(ast.ImportFrom(node.module, kept, node.level)) + "\n" if kept else ""
                lines[node.lineno - 1 : node.end_lineno] = [new] + [""] * (node.end_lineno - node.lineno)
                return "".join(lines)
    return text


def used_submodules(imports: list[str], code: str) -> list[str]:
    """The imports without `import a.b` whose a.b the code never reads: ruff keeps those while `a` is used."""
    chains = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Attribute):
            chains.add(ast.unparse(node))
    kept = []
    for text in imports:
        node = ast.parse(text).body[0]
        if isinstance(node, ast.Import) and not node.names[0].asname and "." in node.names[0].name:
            name = node.names[0].name
            if not any(chain == name or chain.startswith(name + ".") for chain in chains):
                continue
        kept.append(text)
    return kept


def signature_names(node: ast.stmt) -> set[str]:
    """Names a function's decorators, annotations and defaults read: they need a module-level import."""
    if not isinstance(node, ast.FunctionDef):
        return set()
    parts = [*node.decorator_list, node.args, *([node.returns] if node.returns else [])]
    return {n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)}


def top_module(node: ast.stmt) -> str:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] if not node.level else ""
    return node.names[0].name.split(".")[0] if isinstance(node, ast.Import) else ""


def in_order(helpers: list[tuple[set, set, str]]) -> list[str]:
    """The helpers' texts, each after those it uses (a constant a decorator reads must come first); else as given."""
    done, out = set(), []

    def visit(index: int, path: tuple[int, ...]) -> None:
        keys, deps, text = helpers[index]
        if index in done or index in path:
            return
        for other, (other_keys, _, _) in enumerate(helpers):
            if other != index and deps & other_keys:
                visit(other, (*path, index))
        done.add(index)
        out.append(text)

    for index in range(len(helpers)):
        visit(index, ())
    return out


def marks_text(units: list[Unit]) -> str:
    return "".join(u.text for u in units)


def mark_exprs(unit: Unit) -> list[str]:
    value = unit.node.value
    elements = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return [ast.unparse(e) for e in elements]


def with_decorators(text: str, unit: Unit, decorators: list[str]) -> str:
    if not decorators:
        return text
    lines = text.splitlines(keepends=True)
    first = min([unit.node.lineno, *(d.lineno for d in unit.node.decorator_list)])
    index = first - (unit.node.end_lineno - len(lines) + 1)
    return "".join(lines[:index] + decorators + lines[index:])


def module_docstring(target: str, sources: dict[str, Module], target_sources: list[str]) -> str:
    if target in sources or len(target_sources) == 1:
        source = target if target in sources else target_sources[0]
        units = sources[source].units
        if units and units[0].kind == "docstring":
            return units[0].text + "\n"
    path = module_of(target)
    what = f"`recurfit/{path}`" if path else f"{target[5:-3]}"
    return f'"""Tests of {what}."""\n\n'


def module_of(test_file: str) -> str | None:
    """The recurfit module (file or package) test_<package>_<module>.py names, or None."""
    words = test_file.removeprefix("test_").removesuffix(".py").split("_")
    root = REPO / "recurfit"
    for joins in itertools.product("_/", repeat=len(words) - 1):
        path = words[0] + "".join(j + w for j, w in zip(joins, words[1:]))
        if (root / f"{path}.py").is_file():
            return f"{path}.py"
        if (root / path / "__init__.py").is_file():
            return f"{path}/"
    return None


def find_ruff() -> str:
    local = REPO / ".venv" / "bin" / "ruff"
    return str(local) if local.exists() else (shutil.which("ruff") or "ruff")


# ---------------------------------------------------------------- --check


def check_layout(tests_dir: Path, cross_cutting: list[str], targets: dict[str, list[tuple[str, str]]]) -> list[str]:
    problems = Problems()
    files = sorted(p.name for p in tests_dir.glob("test_*.py"))
    moved_from = {source for entries in targets.values() for source, _ in entries}
    for name in files:
        if name not in cross_cutting and module_of(name) is None:
            problems.say(
                f"tests/{name} names no module of recurfit (test_<package>_<module>.py) and is not cross-cutting"
            )
        elif name not in targets and name not in cross_cutting and name in moved_from:
            problems.say(f"tests/{name} is still there: {LAYOUT.name} moves its tests elsewhere (run arrange_tests.py)")
        tree = ast.parse((tests_dir / name).read_text())
        for node in ast.walk(tree):
            imported = [node.module] if isinstance(node, ast.ImportFrom) else []
            imported += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for module in imported:
                if is_test_module(module):
                    problems.say(f"tests/{name}:{node.lineno} imports {module}: shared helpers live in conftest.py")
    # Docs, benchmarks and scripts that name a test file that is not there.
    existing = set(files) | {p.name for p in tests_dir.glob("*.py")}
    pattern = re.compile(r"tests/(test_[a-z0-9_]+\.py)")
    for path in sorted(REPO.rglob("*")):
        if (
            path.suffix not in (".md", ".py", ".sh", ".toml", ".yaml", ".yml")
            or not path.is_file()
            or any(
                part.startswith(".") or part in ("fixtures", "node_modules") for part in path.relative_to(REPO).parts
            )
            or path == LAYOUT
        ):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for missing in sorted(set(pattern.findall(line)) - existing):
                went = sorted({t for t, entries in targets.items() for source, _ in entries if source == missing})
                where = f"; its tests are in {', '.join(went)}" if went else ""
                problems.say(f"{path.relative_to(REPO)}:{number} names tests/{missing}, which is not there{where}")
    if not problems:
        print(f"tests/ is laid out by module: {len(files)} test files, none imports another")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify the layout; move nothing")
    parser.add_argument("--dry-run", action="store_true", help="say what would move; write nothing")
    parser.add_argument("--force", action="store_true", help="write even when the layout leaves problems")
    parser.add_argument("--layout", type=Path, default=LAYOUT, help="the mapping (default: %(default)s)")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    if args.check:
        targets, cross_cutting, _ = read_layout(args.layout)
        return 1 if check_layout(REPO / "tests", cross_cutting, targets) else 0
    return arrange(args)


if __name__ == "__main__":
    sys.exit(main())
