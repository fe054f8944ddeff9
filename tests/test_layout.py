"""The tests' layout (docs/contributing.md, "Where the tests live"): the tests of `recurfit/X/Y.py` live in
`tests/test_X_Y.py`, the files that test no single module are the ones contributing.md's table lists, and no test
file imports another."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CONTRIBUTING = ROOT / "docs" / "contributing.md"


def module_of(test_file: str) -> Path | None:
    """The recurfit module (file or package) that `test_<package>_<module>.py` names, or None: each underscore
    of the name is either a folder's slash or one of the module's own underscores."""
    words = test_file.removeprefix("test_").removesuffix(".py").split("_")
    for joins in itertools.product("_/", repeat=len(words) - 1):
        path = ROOT / "recurfit" / (words[0] + "".join(j + w for j, w in zip(joins, words[1:])))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def cross_cutting() -> set[str]:
    """The test files contributing.md's table says test no single module."""
    section = CONTRIBUTING.read_text().split("A few files test no single module:")[1].split("\n\n")[1]
    return set(re.findall(r"^\| `(test_\w+\.py)` \|", section, flags=re.MULTILINE))


def test_every_test_file_names_its_module_or_is_listed_as_testing_none():
    files = {path.name for path in TESTS.glob("test_*.py")}
    listed = cross_cutting()
    assert listed and listed <= files, f"contributing.md lists missing files: {sorted(listed - files)}"
    unplaced = sorted(name for name in files - listed if module_of(name) is None)
    assert not unplaced, f"{unplaced} name no module of recurfit (test_<package>_<module>.py); rename, or list them"
    assert module_of("test_model_static_cache.py") == ROOT / "recurfit" / "model" / "static_cache.py"
    assert module_of("test_serving.py") == ROOT / "recurfit" / "serving" / "__init__.py"


def test_no_test_file_imports_another():
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            shared = [name for name in names if name.split(".")[0].startswith("test_")]
            assert not shared, f"{path.name}:{node.lineno} imports {shared}: shared helpers live in conftest.py"
