"""Model cards in saved folders (retrofit --out, a run's final/) and `recurfit push` (the upload itself mocked:
the Hub is unreachable here, so what is tested is the card and which files would go up)."""

from __future__ import annotations

import huggingface_hub
from conftest import run_cli, tiny_config

from recurfit.model.card import files_to_upload
from recurfit.train import load_config, train


def card_of(folder) -> str:
    return (folder / "README.md").read_text()


def test_retrofit_folder_has_a_card_with_parent_shape_layers_and_how_to_load(workspace, tmp_path, capsys):
    out = tmp_path / "tiny-121"
    code, text = run_cli(capsys, "retrofit", "--model", workspace / "parent", "--shape", "1,2,1", "--out", out)
    assert code == 0, text
    card = card_of(out)
    assert card.startswith("---\n") and "library_name: transformers" in card and "- depth-recurrence" in card
    assert (
        "# tiny-121" in card
        and "from **a local model**" in card
        and str(workspace) not in card
        and "shape (1, 2, 1)" in card
    )
    assert "| prelude | 0 |" in card and "| core | 3–4 |" in card and "| coda | 5 |" in card
    assert "AutoModelForCausalLM.from_pretrained" in card and "import recurfit" in card
    assert "## Training" not in card  # a fresh retrofit is untrained, and the card does not pretend otherwise


def test_final_folder_card_has_the_recipe_tokens_and_validation_table(workspace, tmp_path):
    result = train(load_config(None, ["steps=3"], base=tiny_config(workspace, tmp_path / "myrun")))
    card = card_of(tmp_path / "myrun" / "final")
    assert "# myrun" in card
    assert f"3 optimizer steps, {result.counters.tokens:,} tokens" in card
    assert "mean recurrence 4 (1-sqrt curriculum)" in card and "Optimizer: muon" in card
    assert f"{workspace / 'prose'} (weight 1.0): 1,024 tokens" in card and "the rest of the run" in card
    assert "## Validation loss (nats/token, step 3)" in card and "| data | r=1 | r=4 |" in card
    assert "| prose |" in card and "| math |" in card


def test_push_uploads_the_model_files_and_the_card_only(workspace, tmp_path, capsys, monkeypatch):
    out = tmp_path / "model"
    run_cli(capsys, "retrofit", "--model", workspace / "parent", "--shape", "1,2,1", "--out", out)
    (out / "notes.log").write_text("scratch")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "optimizer.pt").write_text("state")
    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(
        huggingface_hub, "upload_folder", lambda **kw: calls.append(("upload", kw)) or "https://hub/commit"
    )
    code, text = run_cli(capsys, "push", out, "me/tiny-121")
    assert code == 0, text
    files = files_to_upload(out)
    assert "README.md" in files and "model.safetensors" in files and "config.json" in files
    assert "tokenizer.json" in files and "notes.log" not in files and "checkpoints/optimizer.pt" not in files
    (_, repo_id, create), (_, upload) = calls
    assert repo_id == "me/tiny-121" and create["exist_ok"] and upload["repo_id"] == "me/tiny-121"
    assert upload["folder_path"] == out and "https://hub/commit" in text and "README.md" in text
    code, text = run_cli(capsys, "push", workspace / "parent", "me/parent")  # saved by transformers: no card
    assert code == 2 and "no README.md model card" in text
