"""The demo pipeline end to end on a tiny parent: every stage runs and the report holds what it promises."""

import numpy as np
import pytest
import yaml

from recurfit.data.decontaminate import EVAL_SETS
from recurfit.data.store import TokenStore
from recurfit.demo.report import _rates
from recurfit.demo.run import run_demo
from recurfit.demo.settings import DemoSettings
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_tokenizer


def test_demo_writes_a_report_with_tables_figures_and_samples(workspace, tmp_path):
    from rich.console import Console

    settings = DemoSettings(
        out=tmp_path / "demo",
        model=str(workspace / "parent"),
        shape=(2, 2, 2),
        steps=4,
        heal_steps=1,
        seq_len=32,
        mean_recurrence=2,
        backprop_depth=1,
        math_problems=40,
        loss_recurrences=[1, 2, 4],
        loss_rows=2,
        gsm8k=2,
        gsm8k_recurrences=[1, 2],
        max_new_tokens=4,
    )
    pad = load_tokenizer(settings.model).pad_token_id
    console = Console(quiet=True)
    report = run_demo(settings, console).read_text()
    for heading in ("## 1. Retrofit", "## 2-4. Training", "## 5. Validation loss", "## GSM8K", "## Sample generations"):
        assert heading in report
    # Where the time went, stage by stage, on a named machine (AVX2 CPUs emulate bf16: it matters).
    assert "## Time: " in report and "CPU capability" in report and "Newton–Schulz in" in report
    stages = [line for line in report.splitlines() if line.startswith("| ") and " s |" in line]
    assert [line.split(".")[0] for line in stages] == [f"| {n}" for n in range(1, 8)]
    assert "| r=4 |" in report and "| parent (same tokens) |" in report and "**r = 4**" in report
    figures = {p.name for p in (tmp_path / "demo" / "figures").iterdir()}
    names = ("training", "loss_prose", "loss_math", "gsm8k")
    assert figures == {f"{name}.{suffix}" for name in names for suffix in ("png", "pdf", "svg")}
    assert (tmp_path / "demo" / "recurrent" / "final" / "config.json").is_file()
    # The stores hold the documents and one EOS each: no padding left by the parity check's padded batch.
    for store in ("prose", "math"):
        splits = [TokenStore(tmp_path / "demo" / "data" / store, split) for split in ("train", "val")]
        tokens = np.concatenate([split[:].reshape(-1) for split in splits])
        meta = splits[0].meta
        assert 0 < (tokens == meta["eos_token_id"]).sum() <= meta["documents"]
        assert pad not in tokens or pad == meta["eos_token_id"]
        assert meta["decontamination"]["sets"] == sorted(EVAL_SETS)  # the one default: every eval set
    # Both models train at the healing study's rates, and the report says why.
    for run in ("recurrent", "parent"):
        optimizer = yaml.safe_load((tmp_path / "demo" / run / "config.yaml").read_text())["optimizer"]
        assert (optimizer["muon_lr"], optimizer["lr"]) == (settings.muon_lr, settings.lr) == (5e-3, 2.5e-4)
    assert "Muon at 5e-3 (AdamW at 2.5e-4 " in report and "5 times the paper's (Muon 1e-3, AdamW 5e-5)" in report
    with pytest.raises(RecurfitError, match="--force"):
        run_demo(settings, console)


def test_the_report_names_the_rates_and_how_they_relate_to_the_papers(tmp_path):
    assert _rates(DemoSettings(muon_lr=1e-3, lr=5e-5)).endswith(": the paper's rates")
    assert "2 times the paper's" in _rates(DemoSettings(muon_lr=2e-3, lr=1e-4))
    assert "not the paper's" in _rates(DemoSettings(muon_lr=2e-3, lr=5e-5))


def test_options_left_out_are_the_settings_own_and_rates_given_reach_the_settings(monkeypatch):
    from recurfit.cli import main
    from recurfit.demo import run

    seen = []
    monkeypatch.setattr(run, "run_demo", lambda settings, console: seen.append(settings))
    assert main(["demo", "--out", "x"]) in (0, None)
    defaults = DemoSettings()
    assert (seen[0].shape, seen[0].steps, seen[0].muon_lr, seen[0].lr) == (
        defaults.shape,
        defaults.steps,
        defaults.muon_lr,
        defaults.lr,
    )
    assert main(["demo", "--out", "x", "--muon-lr", "1e-3", "--lr", "5e-5"]) in (0, None)
    assert (seen[1].muon_lr, seen[1].lr) == (1e-3, 5e-5)
    with pytest.raises(SystemExit):
        main(["demo", "--muon-lr", "-1"])


def test_the_recipe_run_by_hand_is_the_demos_retrofit_at_its_defaults():
    """recipes/demo.yaml is the packaged recipe, and `recurfit train recipes/demo.yaml` after the demo's data stage
    trains what `recurfit demo` trains: its healing tokens and eval schedule follow the demo's rules."""
    from importlib import resources
    from pathlib import Path

    from recurfit.demo.settings import recipe, training_config

    packaged = resources.files("recurfit.demo").joinpath("recipe.yaml").read_text()
    assert (Path(__file__).parent.parent / "recipes" / "demo.yaml").read_text() == packaged
    settings = DemoSettings()
    data = {name: settings.out / "data" / name for name in ("prose", "math")}
    assert training_config(settings, data, settings.out / "recurrent", settings.shape) == recipe()
