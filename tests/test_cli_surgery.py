"""Tests of `recurfit/cli/surgery.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    char_tokenizer,
    raven_folder,
    run_cli,
    tiny_parent,
    token_batch,
    write_raven_checkpoint,
)
from conftest import run_cli as run
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import recurfit
from recurfit.cli import main
from recurfit.model.loading import load_tokenizer
from recurfit.surgery.layer_scores import (
    measure,
)
from recurfit.surgery.selection import LayerSelection


@pytest.fixture
def parent_with_text(workspace, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("the cat sat on a mat and then the dog ran far under the big red tree. " * 4)
    return workspace / "parent", text


def test_retrofit_writes_a_loadable_model_equal_to_the_python_api(parent_dir, tmp_path, capsys):
    out = tmp_path / "rec"
    code, text = run(capsys, "retrofit", "--model", parent_dir, "--shape", "2,2,1", "--out", out)
    assert code == 0 and "✓ equal" in text and "3–4" in text  # core = parent layers 3-4
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = recurfit.retrofit(AutoModelForCausalLM.from_pretrained(parent_dir), shape=(2, 2, 1))
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids, num_steps=3).logits, expected(ids, num_steps=3).logits)


def test_explicit_indices_and_ranges(parent_dir, tmp_path, capsys):
    out = tmp_path / "rec"
    code, _ = run(
        capsys, "retrofit", "--model", parent_dir, "--prelude", "0", "--core", "2-4", "--coda", "5", "--out", out
    )
    assert code == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.source_layers == {
        "prelude": [0],
        "core": [2, 3, 4],
        "coda": [5],
    }


def test_existing_output_is_never_overwritten_without_force(parent_dir, tmp_path, capsys):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, text = run(capsys, "retrofit", "--model", parent_dir, "--shape", "1,2,1", "--out", out)
    assert code == 2 and "already exists" in text
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _ = run(capsys, "retrofit", "--model", parent_dir, "--shape", "1,2,1", "--out", out, "--force")
    assert code == 0 and (out / "model.safetensors").exists() and not (out / "keep.txt").exists()


def test_inspect_plans_a_shape_from_the_config_alone(parent_dir, capsys):
    (parent_dir / "model.safetensors").unlink()  # no weights needed
    code, text = run(capsys, "inspect", parent_dir, "--shape", "2,2,1", "--recurrence", "1,4")
    assert code == 0 and "core (2 layers) ×r" in text and "3–4" in text
    counts = recurfit.count_parameters(recurfit.retrofit(tiny_parent("llama", num_layers=6), shape=(2, 2, 1)))
    assert f"{counts['body']:,}" in text


def test_inspect_layers_lists_every_layer_with_its_scores(parent_with_text, capsys):
    parent, text = parent_with_text
    code, output = run_cli(capsys, "inspect", parent, "--layers", "--calibration", text, "--shape", "1,2,1")
    assert code == 0, output
    model = AutoModelForCausalLM.from_pretrained(parent)
    tokenizer = load_tokenizer(str(parent))
    scores = measure(model, tokenizer(text.read_text(), return_tensors="pt").input_ids)
    for layer in range(6):
        assert f"│ {layer} │ {scores.angular[layer]:.4f} │ {scores.influence[layer]:.4f} │" in output
    P, R, C = LayerSelection.angular(None, scores.angular).shape
    assert f"paper (1, 2, 1), shortgpt (1, 2, 1), angular (1, 2, 1), knees ({P}, {R}, {C})" in output
    assert "┃ paper ┃ shortgpt ┃ angular ┃ knees ┃" in output
    assert f"`--select angular` without --shape retrofits {P},{R},{C}" in output


def test_retrofit_select_angular_on_the_command_line(parent_with_text, tmp_path, capsys):
    parent, text = parent_with_text
    code, output = run_cli(capsys, "retrofit", "--model", parent, "--select", "angular", "--out", tmp_path / "no")
    assert code == 2 and "--select angular scores layers on text: pass --calibration FILE" in output
    assert not (tmp_path / "no").exists()
    out = tmp_path / "rec"
    code, output = run_cli(
        capsys, "retrofit", "--model", parent, "--select", "angular", "--calibration", text, "--out", out
    )
    assert code == 0 and "✓ equal" in output


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "--shape", "5,5,5"], "needs 15 layers but the parent has only 6"),
        (["--plot", "x.png"], "--plot and --calibration go with --layers"),
        (["--layers", "--calibration", "missing.txt"], "Calibration file not found: missing.txt"),
    ],
)
def test_inspect_layers_bad_input(parent_with_text, capsys, argv, message):
    code, output = run_cli(capsys, "inspect", parent_with_text[0], *argv)
    assert code == 2 and message in output and "Traceback" not in output


def test_import_raven_command_copies_the_tokenizer_beside_the_weights(tmp_path, capsys):
    original = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="random")
    folder = raven_folder(tmp_path, original)
    char_tokenizer().save_pretrained(folder)
    assert main(["import-raven", str(folder), "--out", str(tmp_path / "out")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("cat").input_ids == char_tokenizer()("cat").input_ids
    capsys.readouterr()


def test_retrofit_saves_in_the_dtype_asked_for_and_refuses_a_missing_gpu(workspace, tmp_path, capsys):
    out = tmp_path / "bf16"
    code, text = run_cli(
        capsys, "retrofit", "--model", workspace / "parent", "--shape", "1,2,1", "--dtype", "bfloat16", "--out", out
    )
    assert code == 0 and "✓ equal" in text, text
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = weights.keys()  # safe_open is no dict: no `in`
        assert {weights.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    code, text = run_cli(
        capsys, "retrofit", "--model", workspace / "parent", "--device", "cuda", "--out", tmp_path / "x"
    )
    assert code == 2 and "--device cpu" in text and not (tmp_path / "x").exists()


def test_import_raven_command_writes_a_loadable_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from recurfit.cli import main

    original = recurfit.retrofit(tiny_parent("olmo2"), shape=(1, 2, 1), adapter_init="random")
    (tmp_path / "raven").mkdir()
    write_raven_checkpoint(original, tmp_path / "raven", "olmo2", padded_vocab=97)
    assert main(["import-raven", str(tmp_path / "raven"), "--out", str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids, zero = token_batch(), torch.zeros(2, 12, 64)
    with torch.no_grad():
        expected = original.eval()(ids, num_steps=3, initial_state=zero).logits
        assert torch.allclose(loaded(ids, num_steps=3, initial_state=zero).logits, expected, atol=1e-5)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out"), "--recurrence", "1,2"]) == 0
    assert "core (2 layers) ×r" in " ".join(capsys.readouterr().out.split())
