"""The README's Python code runs as written (on the embedded SmolLM2-135M), and the docs speak to users."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "recipes").glob("*.md"))]


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_readme_python_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # it saves a model folder
    (snippet,) = code_blocks(REPO / "README.md", "python")
    exec(compile(snippet, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 (the docs' own code)
    printed = capsys.readouterr().out
    assert "| r=8 |" in printed and "| parent (SmolLM2) |" in printed and "arc_easy (acc_norm)" in printed
    assert (tmp_path / "smol-484" / "config.json").is_file()


def test_docs_use_no_internal_language():
    internal = re.compile(r"\b(issue \d+|this issue|DESIGN\.md)", re.IGNORECASE)
    found = [f"{path.relative_to(REPO)}: {match}" for path in DOCS for match in internal.findall(path.read_text())]
    assert not found, found
