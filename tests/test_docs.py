"""The docs' Python runs as written (on the embedded SmolLM2-135M), their `recurfit` commands and configs parse,
their links and anchors resolve, and they speak to users."""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "recipes").glob("*.md"))]
# Pages other work adds; the index may link to them before they exist.
# Words of notes to developers, not to users: issue numbers, the machine a note was written on, changelogs.
INTERNAL = re.compile(
    r"\b(issue \d+|this issue|the issue's|DESIGN\.md|this machine|this change|before the change|other engineers"
    r"|for the record|ruled out|superseded)\b",
    re.IGNORECASE,
)
# A commit hash of this repository (the paper authors' release commit is a reference, not a note).
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
AUTHORS_COMMITS = {"e21042a"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def prose(path: Path) -> str:
    """The page without its code blocks (commands may name anything)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_python_reference_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # it saves a model folder
    (snippet,) = code_blocks(REPO / "docs" / "reference" / "python-api.md", "python")
    exec(compile(snippet, "python-api.md", "exec"), {"__name__": "docs"})  # noqa: S102 (the docs' own code)
    printed = capsys.readouterr().out
    assert "| r=8 |" in printed and "| parent (SmolLM2) |" in printed and "arc_easy (acc_norm)" in printed
    assert (tmp_path / "smol-484" / "config.json").is_file() and (tmp_path / "smol-484" / "README.md").is_file()
    assert (tmp_path / "smol-484" / "tokenizer_config.json").is_file()


@pytest.mark.slow
def test_readme_python_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's loading snippet, on a retrofit of the embedded model saved where the snippet looks."""
    import recurfit
    from recurfit.model.loading import load_model, load_tokenizer

    monkeypatch.chdir(tmp_path)
    (snippet,) = code_blocks(REPO / "README.md", "python")
    (folder,) = set(re.findall(r'from_pretrained\("([^"]+)"\)', snippet))
    recurfit.retrofit(load_model(None), shape=(2, 4, 2)).save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    exec(compile(snippet, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 (the docs' own code)
    assert capsys.readouterr().out.startswith("The capital of France is")


def test_docs_use_no_internal_language():
    found = [f"{path.relative_to(REPO)}: {match}" for path in DOCS for match in INTERNAL.findall(prose(path))]
    found += [
        f"{path.relative_to(REPO)}: commit {match}"
        for path in DOCS
        for match in COMMIT.findall(prose(path))
        if match not in AUTHORS_COMMITS
    ]
    assert not found, found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, spaces to hyphens, punctuation dropped."""
    text = heading.lstrip("#").strip().lower()
    return "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in prose(path).splitlines():
        if re.match(r"^#{1,6} ", line):
            base, n = slug(line), 0
            while (anchor := base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(anchor)
    return found


def test_links_lead_to_files_and_anchors_that_exist():
    broken = []
    for page in DOCS:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def commands(page: Path) -> list[list[str]]:
    """The `recurfit` commands of a page's bash blocks, as argument lists after `recurfit` (continuation lines
    joined; `torchrun … -m recurfit`, `.venv/bin/recurfit` and environment assignments in front included)."""
    found = []
    for block in code_blocks(page, "bash"):
        block = re.sub(r"\$\{?[A-Z_]+\}?", "0", block)  # a shell variable (a Slurm task id): an example value
        block = re.sub(r"\s\[(?:-[^\]\n]*|[A-Z_]+)\]", "", block)  # a synopsis's optional parts: [--force] [DIR]
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"\s(?:&&|;|&)\s?", line):
                words = shlex.split(part, comments=True)
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words = words[1:]
                if words and words[0] == "torchrun" and "recurfit" in words:
                    words = words[words.index("recurfit") :]
                if words and Path(words[0]).name == "recurfit" and words[1:2] != ["lm-eval"]:
                    found.append([w for w in words[1:] if w != "&"])
    return found


def test_every_recurfit_command_in_the_docs_parses_and_its_config_overrides_load():
    from recurfit.cli import build_parser
    from recurfit.train import load_config

    checked = 0
    for page in DOCS:
        for argv in commands(page):
            where = f"{page.relative_to(REPO)}: recurfit {' '.join(argv)}"
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"does not parse: {where}")
            config = getattr(args, "config", None)
            if args.command == "train" and (REPO / config).is_file():  # a recipe: its overrides must apply
                load_config(REPO / config, args.overrides)
            checked += 1
    tutorial = commands(REPO / "docs" / "tutorials" / "gpu-1b.md")
    assert {argv[0] for argv in tutorial} >= {"inspect", "data", "train", "eval", "plot", "push"}
    assert checked > 50, checked


def test_the_example_configs_in_the_docs_load():
    from recurfit.train import load_config

    blocks = [(page, block) for page in DOCS for block in code_blocks(page, "yaml")]
    configs = [(page, yaml.safe_load(block)) for page, block in blocks]
    configs = [(page, config) for page, config in configs if isinstance(config, dict) and "out" in config]
    assert len(configs) >= 2
    for page, config in configs:
        loaded = load_config(None, [], base=config)
        assert loaded.out == config["out"], page


def test_readme_is_short_and_holds_the_command_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    ci = "./scripts/setup.sh" + (REPO / ".ci" / "run").read_text().split("\n./scripts/setup.sh", 1)[1].rstrip()
    assert ci in readme
    assert "./scripts/setup.sh && .venv/bin/recurfit demo" in readme


def by_hand_steps(page: Path) -> list[str]:
    """The lines of the page's step-by-step block (the bash block that writes runs/by-hand), continuations joined."""
    (block,) = [block for block in code_blocks(page, "bash") if "runs/by-hand" in block]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def on_the_tiny_model(argv: list[str], parent: Path, texts: dict[str, Path]) -> list[str] | None:
    """A tutorial command as it runs on the tiny llama in seconds: the same folders and order, smaller settings.
    None for `eval tasks`: GSM8K's prompts are longer than the tiny model's 128 positions."""
    small = {"--shape": "2,2,2", "--seq-len": "16", "--recurrence": "1,2"}  # a single r stays as it is
    argv = [texts.get(word, word) for word in argv]  # embedded sources → small text files
    argv = [
        small[before] if before in small and (before != "--recurrence" or "," in word) else word
        for before, word in zip(["", *argv], argv)
    ]
    command = " ".join(argv[:2])
    if command == "eval tasks":
        return None
    if argv[0] == "inspect":
        return [argv[0], str(parent), *argv[1:]]
    if argv[0] == "retrofit":
        return [*argv, "--model", str(parent)]
    if command == "data prepare":
        return [*argv, "--tokenizer", str(parent), "--decontaminate", "none", "--val-fraction", "0.1"]
    if argv[0] == "train":  # the page's own overrides come last and win (the parent's model.shape=null)
        tiny = [f"model.path={parent}", "model.shape=[2,2,2]", "steps=4", "data.phases.0.tokens=136", "eval.at=[1]"]
        return [argv[0], argv[1], *tiny, "eval.rows=2", "log.progress=false", *argv[2:]]
    if command == "eval loss":
        return [*argv, "--limit", "4"]
    if argv[0] == "plot":
        return [word for word in argv if "eval-tasks" not in word]
    if argv[0] == "generate":
        return [*argv, "--max-new-tokens", "3"]
    return argv


def test_the_cpu_tutorials_steps_run_from_the_root_into_their_own_folder(workspace, tmp_path, monkeypatch):
    """docs/tutorials/cpu-demo.md's step-by-step block, in order, from a copy of the repository root where the demo
    has already run (its run folder is finished), on the tiny llama: every command succeeds and writes under the
    block's own folder, and training uses the data the block prepared."""
    import subprocess

    from conftest import write_documents

    from recurfit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "demo.yaml").write_text((REPO / "recipes" / "demo.yaml").read_text())
    (tmp_path / "runs" / "demo" / "recurrent" / "final").mkdir(parents=True)  # a finished demo
    texts = {}
    for name, seed in (("embedded:prose", 0), ("embedded:math:4000", 1)):
        texts[name] = str(tmp_path / f"{seed}.jsonl")
        write_documents(Path(texts[name]), 120, seed)
    ran = []
    for line in by_hand_steps(REPO / "docs" / "tutorials" / "cpu-demo.md"):
        words = shlex.split(line, comments=True)
        if words[0] == "source":
            continue
        if words[0] != "recurfit":
            subprocess.run(line, shell=True, check=True, cwd=tmp_path)  # noqa: S602 (the page's own shell line)
            continue
        argv = on_the_tiny_model(words[1:], workspace / "parent", texts)
        if argv is not None:
            assert main(argv) == 0, f"failed: recurfit {' '.join(argv)}"
            ran.append(" ".join(words[1:3]))
    assert {"retrofit --shape", "train runs/by-hand/recipe.yaml", "generate runs/by-hand/recurrent/final"} <= set(ran)
    for folder in ("recurrent/final", "parent/final", "eval-loss", "figures", "data/prose", "data/math"):
        assert (tmp_path / "runs" / "by-hand" / folder).is_dir(), folder
    trained = yaml.safe_load((tmp_path / "runs" / "by-hand" / "recurrent" / "config.yaml").read_text())
    assert trained["data"]["validation"] == ["runs/by-hand/data/prose", "runs/by-hand/data/math"]


# Pages that walk a user through work on some hardware open with what has and has not run there.
GUIDES = sorted([*(REPO / "docs" / "tutorials").glob("*.md"), *(REPO / "docs" / "how-to").glob("*.md")])
# A sentence that says a figure was measured on a GPU.
GPU_CLAIM = re.compile(r"\bmeasured on (?:an? |one |\d+ × )?(?:NVIDIA )?(?:GPU|H100|H200|A100|CUDA)", re.IGNORECASE)
NEGATED = re.compile(r"\b(?:not|never|no|none|nothing|untested)\b", re.IGNORECASE)


def status_box(page: Path) -> str:
    """The blockquote that opens the page, after its title ("" when there is none)."""
    lines = page.read_text().splitlines()[2:]
    box = []
    for line in lines:
        if not line.startswith(">"):
            break
        box.append(line.lstrip("> "))
    return " ".join(box)


def section(page: Path, anchor: str) -> str:
    """The text under the heading with this anchor, up to the next heading of the same or a higher level."""
    text, found, level = [], False, 0
    for line in prose(page).splitlines():
        heading = re.match(r"^(#{1,6}) ", line)
        if heading and found and len(heading.group(1)) <= level:
            break
        if heading and slug(line) == anchor:
            found, level = True, len(heading.group(1))
        elif found:
            text.append(line)
    return "\n".join(text)


@pytest.mark.parametrize("page", GUIDES, ids=lambda page: page.name)
def test_each_guide_opens_with_what_has_run_where_and_links_its_results(page):
    if page.name == "serving.md" and not status_box(page):
        pytest.skip("serving.md's status box is written with its vLLM version")
    box = status_box(page)
    assert box.startswith("**Status.**"), f"{page.relative_to(REPO)} opens without a status box"
    assert re.search(r"\]\((?:\.\./)+(?:docs/)?results/[a-z-]+\.md", box), f"{page.relative_to(REPO)}: no results link"
    assert re.search(r"\b(?:not|never|no)\b", box, re.IGNORECASE), f"{page.relative_to(REPO)}: says nothing unrun"


def test_a_gpu_figure_claimed_as_measured_links_a_gpu_result_that_exists():
    """A sentence saying something was measured on a GPU links a section of results/gpu.md that holds a figure
    (not one of its *not measured* cells); a sentence that says it was not (`not measured on a GPU`) needs none."""
    gpu = REPO / "docs" / "results" / "gpu.md"
    unbacked = []
    for page in DOCS:
        if page == gpu:
            continue
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(prose(page).split())):
            if not GPU_CLAIM.search(sentence) or NEGATED.search(sentence):
                continue
            links = [target for target in LINK.findall(sentence) if target.split("#")[0].endswith("results/gpu.md")]
            backed = [
                target
                for target in links
                if "#" in target
                and (body := section(gpu, target.split("#", 1)[1]))
                and re.search(r"\d", body)
                and "not measured" not in body
            ]
            if not backed:
                unbacked.append(f"{page.relative_to(REPO)}: {sentence[:160]}")
    assert not unbacked, "\n".join(unbacked)


def load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_training_command_on_a_paper_recipe_fits_the_gpus_it_names():
    """Each `recurfit train recipes/paper/….yaml OVERRIDES` of the docs (torchrun's included), with its overrides,
    fits an 80 GB GPU of 8 by recurfit's memory plan: an example that changes depth or micro-batch must keep to
    the memory the page promises (micro-batch 8 at r̄ = 8 would need more than 80 GB)."""
    from recurfit.train.memory import gb
    from recurfit.train.memory_fit import fits

    budget = load_script("gpu_budget")
    checked, too_big = 0, []
    for page in DOCS:
        for argv in commands(page):
            if argv[0] != "train" or not argv[1].startswith("recipes/paper/") or "--dry-run" in argv:
                continue
            overrides = [word for word in argv[2:] if "=" in word and not word.startswith("-")]
            plan = budget.memory_plan(REPO / argv[1], overrides)
            if not fits(plan, budget.GPU_MEMORY):
                too_big.append(f"{page.relative_to(REPO)}: {' '.join(argv)}: {gb(plan.peak)} at micro {plan.micro}")
            checked += 1
    assert checked >= 5 and not too_big, too_big


@pytest.mark.slow
def test_the_gpu_budget_page_is_what_the_script_computes():
    budget = load_script("gpu_budget")
    assert budget.PAGE.read_text() == budget.page(), "run .venv/bin/python scripts/gpu_budget.py"
    for page in (REPO / "docs" / "tutorials" / "gpu-1b.md", REPO / "recipes" / "paper" / "llama-464-math.yaml"):
        assert "gpu-budget.md" in page.read_text(), page


def test_user_pages_are_short_except_reference_tables():
    """A page a user reads through stays under 300 lines; reference pages (tables to look things up in) may not."""
    long = [
        f"{page.relative_to(REPO)}: {len(page.read_text().splitlines())} lines"
        for page in DOCS
        if "reference" not in page.parts and len(page.read_text().splitlines()) > 300
    ]
    assert not long, long


def test_each_how_to_page_is_at_most_180_lines():
    """A how-to does one job, short enough to read through before doing it; a second job is a page of its own."""
    long = [
        f"{page.relative_to(REPO)}: {len(page.read_text().splitlines())} lines"
        for page in sorted((REPO / "docs" / "how-to").glob("*.md"))
        if len(page.read_text().splitlines()) > 180
    ]
    assert not long, long


# ---------------------------------------------------------------- what a page promises, what has run

SERVE_MIDDLEWARE = "--middleware recurfit.serving.middleware.EffortToDepth"
# What a page promises of a server that only the middleware gives: a depth per request (with the cache salt that
# keeps prefix caching to one depth), reasoning effort as a depth, the depth each answer ran at.
PER_REQUEST_DEPTH = re.compile(r"num_steps|reasoning_effort|reasoning\.effort|depth per request|x-recurfit-depth")


def serve_commands(page: Path) -> list[tuple[str, str]]:
    """The `vllm serve` command lines of a page's code blocks (continuations joined), each with its block."""
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), flags=re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            if re.search(r"\bvllm serve\b", line.split(" # ")[0]):
                found.append((line, block))
    return found


def test_every_vllm_serve_in_the_docs_gives_the_features_its_page_promises():
    """A `vllm serve` of a recurfit folder on a page that promises a depth per request or reasoning effort carries
    the middleware (without it reasoning_effort does nothing and depths share prefix-cache blocks); a block that
    serves on a CPU (the CPU build's `--kv-cache-memory-bytes`) sets OMP_NUM_THREADS on that command, without
    which vLLM's CPU worker runs one thread."""
    wrong, checked = [], 0
    for page in DOCS:
        promises = PER_REQUEST_DEPTH.search(page.read_text())
        blocks: dict[str, list[str]] = {}
        for line, block in serve_commands(page):
            blocks.setdefault(block, []).append(line)
            checked += 1
            if promises and SERVE_MIDDLEWARE not in line:
                wrong.append(f"{page.relative_to(REPO)}: no {SERVE_MIDDLEWARE}: {line.strip()}")
        for block, lines in blocks.items():
            cpu = [line for line in lines if "--kv-cache-memory-bytes" in line and "OMP_NUM_THREADS=" in line]
            if "--kv-cache-memory-bytes" in block and not cpu:
                wrong.append(f"{page.relative_to(REPO)}: a CPU server without OMP_NUM_THREADS: {lines[0].strip()}")
    assert checked >= 3, checked
    assert not wrong, "\n".join(wrong)


USER_PAGES = [page for page in DOCS if not page.name.startswith("contributing") and page.name != "gpu.md"]
# Sentences that say no GPU path has run at all.
NOTHING_ON_A_GPU = re.compile(
    r"\b(?:nothing|no command)\b[^.;]*\b(?:run|ran|measured)\b[^.;]*\b(?:GPUs?|CUDA)\b"
    r"|\bevery GPU path\b|\bnone measured\b|\bno result yet\b"
    r"|\bnot (?:yet )?been (?:run|timed|measured) on (?:a )?GPUs?\b",
    re.IGNORECASE,
)
# A sentence that says something has not run on a GPU.
NOT_ON_A_GPU = re.compile(
    r"\b(?:not|never|nothing|untested|unmeasured)\b[^.;]{0,40}"
    r"\b(?:on|with) (?:an? |one |the )?(?:GPUs?|CUDA|H100|H200)\b",
    re.IGNORECASE,
)
# GPU paths a page may name → the row of results/gpu.md that measures them.
GPU_PATHS = {
    r"CUDA graph": "CUDA graphs: tokens captured",
    r"compiled decoding": "bf16 compiled vs eager",
    r"memory plan|measured peak": "peak memory against the memory plan",
    r"\bMFU\b|training step|\btimed\b": "training step: micro-batch, tokens/s, MFU",
    r"CUDA tests|pytest --device cuda": "CUDA tests fp32",
}


def gpu_rows() -> dict[str, str]:
    """The rows of results/gpu.md's tables that hold a measured figure, by their text."""
    rows = [line for line in (REPO / "docs" / "results" / "gpu.md").read_text().splitlines() if line.startswith("|")]
    return {row: row for row in rows if re.search(r"\d", row.split("|")[-2]) and "not measured" not in row}


def test_no_user_page_says_a_gpu_path_is_unmeasured_where_the_gpu_results_hold_it():
    """While results/gpu.md holds measured rows, no user page says nothing has run on a GPU; a sentence that says a
    path has not run on a GPU names none that a row of gpu.md measures (CUDA graphs, compiled decoding, the memory
    plan against the peak, a training step's speed, the CUDA tests)."""
    rows = gpu_rows()
    assert rows, "results/gpu.md holds no measured row"
    measured = {topic for topic, row in GPU_PATHS.items() if any(row in line for line in rows)}
    assert len(measured) == len(GPU_PATHS), set(GPU_PATHS) - measured
    stale = []
    for page in USER_PAGES:
        text = re.sub(r"^> ?", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", prose(page)), flags=re.MULTILINE)
        text = " ".join(text.split())  # links as their words, blockquotes as prose
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            if NOTHING_ON_A_GPU.search(sentence):
                stale.append(f"{page.relative_to(REPO)}: {sentence[:200]}")
            elif NOT_ON_A_GPU.search(sentence) and any(re.search(topic, sentence) for topic in measured):
                stale.append(f"{page.relative_to(REPO)}: {sentence[:200]}")
    assert not stale, "\n".join(stale)


def test_the_demo_reports_commands_parse_and_the_depth_task_adds_to_a_finished_demo(tmp_path):
    """The commands `recurfit demo`'s report gives parse with the CLI's parser; its depth-task command names the
    demo's own folder, which a finished demo leaves free for it, and is refused only once OUT/depth-task exists."""
    from recurfit.cli import _check_before_imports, build_parser
    from recurfit.demo.report import _scaling, depth_task_pointer
    from recurfit.demo.settings import DemoSettings
    from recurfit.errors import RecurfitError

    settings = DemoSettings(out=tmp_path / "demo")
    act_folder = settings.out / "depth-task"  # where the docs say the act writes
    pointer = depth_task_pointer(settings)
    commands = re.findall(r"`recurfit ([^`]+)`", pointer + _scaling(settings))
    assert len(commands) >= 2, commands
    parsed = [build_parser().parse_args(shlex.split(command)) for command in commands]
    (act,) = [args for args in parsed if getattr(args, "depth_task", False)]
    assert Path(act.out) == settings.out
    (settings.out / "recurrent" / "final").mkdir(parents=True)  # a finished demo
    (settings.out / "report.md").write_text("done\n")
    _check_before_imports(act)  # no refusal: the act adds its folder
    act_folder.mkdir()
    (act_folder / "depth_task.md").write_text("done\n")
    with pytest.raises(RecurfitError, match=f"{act_folder} already exists; pass --force"):
        _check_before_imports(act)  # checked before any import or work: the act never starts


def test_every_gpu_check_command_in_the_guides_runs_as_its_plan(capsys, monkeypatch):
    """Each `python benchmarks/gpu_check.py …` of a tutorial or how-to, run with `--plan` (its options parsed, the
    steps and limits printed, nothing measured)."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    check = importlib.import_module("gpu_check.runner")  # what benchmarks/gpu_check.py runs
    ran = []
    for page in GUIDES:
        for block in code_blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words = words[1:]
                if words[:2] != ["python", "benchmarks/gpu_check.py"]:
                    continue
                monkeypatch.setattr(sys, "argv", ["gpu_check.py", *words[2:], "--plan"])
                try:
                    assert check.main() == 0
                except SystemExit as stop:
                    pytest.fail(f"{page.relative_to(REPO)}: {line.strip()}: exit {stop.code}")
                assert "correctness" in capsys.readouterr().out or "--part" in words, line
                ran.append(line)
    assert len(ran) >= 3, ran
