"""Training and scoring on the depth task: the trace's targets follow the bindings, the loss reads each recurrence
with gradient out, the cut head scores as the full one, training learns, and `recurfit demo --depth-task` writes its
table, figure and results."""

import dataclasses
import io
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import CHARS, char_tokenizer, run_cli, tiny_parent
from rich.console import Console

import recurfit
from recurfit.data.depth_task import examples
from recurfit.train.depth_task import (
    TOKENS,
    DepthRecipe,
    DepthScoring,
    accuracy,
    encode,
    prepare,
    train,
    train_step_loss,
)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(CHARS + "=")


def retrofit(shape=(1, 2, 1)):
    # No s_0 noise: a readout inside one pass then equals a separate pass of that many recurrences.
    model = recurfit.retrofit(tiny_parent("llama", num_layers=4), shape, adapter="add", state_init_std=0.0)
    return model.float()


def test_pointers_follow_the_bindings_one_hop_at_a_time(tokenizer):
    batch = list(examples("train", 12, range(1, 5), chains=3, queries="all", seed=4))
    encoded = encode(batch, tokenizer, pointer_steps=6)
    answers = [(example, index, hops) for example in batch for index, _, hops in example.answers]
    assert len(encoded.answers) == len(answers)
    for j, (example, index, hops) in enumerate(answers):
        binds = dict(statement.split("=") for statement in example.text.split(".")[0].split(","))
        trace = [TOKENS[row] for row in encoded.pointers[j].tolist()]
        assert trace[0] == binds[example.text[index - 2]]  # the first hop: what the queried variable names
        assert all(binds[trace[i - 1]] == trace[i] for i in range(1, hops))  # each next hop: what that one names
        assert trace[hops - 1 :] == [example.text[index]] * (6 - hops + 1)  # then the value, and it stays
        assert TOKENS[encoded.answers[j]] == example.text[index] and encoded.hops[j] == hops
        assert encoded.input_ids[encoded.rows[j], encoded.positions[j]] == tokenizer.convert_tokens_to_ids("=")


def test_the_trace_loss_averages_each_recurrence_with_gradient(tokenizer):
    """Its value and its gradients: each readout of the trace takes gradient through the steps before it, as a
    separate pass of that many recurrences with the same steps under no_grad would."""
    model = retrofit()
    head = prepare(model, tokenizer)
    batch = encode(list(examples("train", 4, range(1, 4), chains=3, queries="all")), tokenizer, pointer_steps=5)

    def alone(r, without=0):  # the trace's loss after a separate pass of r recurrences, the first `without` no_grad
        out = model.model(batch.input_ids, attention_mask=batch.attention_mask, num_steps=(without, r - without))
        logits = head(out.last_hidden_state[batch.rows, batch.positions])
        return F.cross_entropy(logits, batch.pointers[:, r - 1])

    def gradients(loss) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    trace, expected = train_step_loss(model, head, batch, 5, 3), (alone(3, 2) + alone(4, 2) + alone(5, 2)) / 3
    assert torch.allclose(trace, expected)
    got, wanted = gradients(trace), gradients(expected)
    assert got.keys() == wanted.keys() and any(name.startswith("model.core") for name in got)
    for name in wanted:
        torch.testing.assert_close(got[name], wanted[name], rtol=1e-4, atol=1e-7, msg=name)
    with torch.no_grad():
        assert torch.allclose(train_step_loss(model, head, batch, 2, 3), (alone(1) + alone(2)) / 2)
        parent = tiny_parent("llama", num_layers=4).float()
        parent_head = prepare(parent, tokenizer)
        logits = parent(batch.input_ids, attention_mask=batch.attention_mask).logits  # the cut head, as a Linear
        expected = F.cross_entropy(logits[batch.rows, batch.positions], batch.answers)
        assert torch.allclose(train_step_loss(parent, parent_head, batch, None, 3), expected)


def test_accuracy_is_the_full_heads_argmax_over_the_tasks_tokens(tokenizer):
    model = retrofit()
    full_head = model.lm_head
    rows = torch.tensor(tokenizer.convert_tokens_to_ids(list(TOKENS)))
    test = list(examples("test", 6, [2], chains=3))
    batch = encode(test, tokenizer, pointer_steps=1)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, num_steps=3).logits
        predicted = logits[batch.rows, batch.positions][:, rows].argmax(-1)
    expected = (predicted == batch.answers).float().mean().item()
    head = prepare(model, tokenizer)
    assert head.weight.data_ptr() != full_head.weight.data_ptr()
    assert accuracy(model, head, tokenizer, hops=2, r=3, count=6, batch=4) == pytest.approx(expected)


def test_training_learns_and_is_repeatable(tokenizer):
    recipe = DepthRecipe(steps=30, batch=4, lr=3e-3, hops=2, deepest=False, max_r=3, backprop=2)
    losses = []
    for steps in (recipe.steps, 5):  # the same seed: the same examples, r and s_0, so the same first losses
        torch.manual_seed(0)
        model = retrofit()
        head = prepare(model, tokenizer)
        frozen = model.get_input_embeddings().weight.clone()
        losses.append(train(model, head, tokenizer, dataclasses.replace(recipe, steps=steps), recurrent=True))
        assert torch.equal(model.get_input_embeddings().weight, frozen)
    assert losses[0][:5] == losses[1]
    first, last = sum(losses[0][:5]) / 5, sum(losses[0][-5:]) / 5
    # Measured over four seeds of model and data: trained, the mean loss falls 0.44-0.69 from the first five
    # steps to the last five; with a learning rate of 1e-12, 0.01-0.16 (only the batches differ).
    assert last < first - 0.3, (first, last)


def test_the_depth_act_writes_its_table_figure_and_results_and_keeps_an_existing_folder(tokenizer, tmp_path):
    from recurfit.demo.depth_act import guessing, run_depth_act
    from recurfit.errors import RecurfitError
    from recurfit.evaluate.results import Sweep

    recipe = DepthRecipe(steps=2, batch=2, hops=2, max_r=2, backprop=2)
    layers = {"prelude": [0], "core": [1, 2], "coda": [3]}
    console = Console(file=io.StringIO())

    def act(**kwargs):
        parent = tiny_parent("llama", num_layers=4).float()
        return run_depth_act(tmp_path, console, recipe=recipe, parent=parent, tokenizer=tokenizer, layers=layers,
                             scoring=DepthScoring(hops=(1, 3), recurrences=(1, 2), examples=4), **kwargs)  # fmt: skip

    sweep = act()
    folder = tmp_path / "depth-task"
    assert Sweep.load(folder / "depth_task.json") == sweep
    assert [row.steps for row in sweep.rows] == [1, 2] and sweep.parent.steps is None
    assert sweep.chance.metrics["3 hops"] == pytest.approx(guessing(3, 4, 3, 0))
    page = (folder / "depth_task.md").read_text()
    assert sweep.markdown() in page and "**3 hops** (beyond training)" in page
    assert (folder / "depth_task.png").stat().st_size > 0
    with pytest.raises(RecurfitError, match="--force"):
        act()
    assert Sweep.load(folder / "depth_task.json") == sweep
    assert act(force=True) == sweep  # seeded: the same models and scores again


def test_guessing_is_one_over_the_programs_distinct_digits():
    from recurfit.demo.depth_act import guessing

    test = list(examples("test", 5, [2], chains=3, seed=1))
    shares = [1 / len({c for c in e.text.split(".")[0] if c.isdigit()}) for e in test for _ in e.answers]
    assert guessing(2, 5, 3, 1) == pytest.approx(sum(shares) / len(shares))
    assert 1 / 3 <= guessing(2, 5, 3, 1) <= 1


def test_the_depth_task_joins_a_finished_demos_folder_and_refuses_to_replace_its_own_without_force(
    tmp_path, capsys, monkeypatch
):
    """`demo --depth-task --out DEMO` adds DEMO/depth-task beside a finished demo's report; an existing
    DEMO/depth-task is refused by name (what --force would replace), and nothing of the demo is touched."""
    from recurfit.demo import depth_act

    acts = []
    monkeypatch.setattr(depth_act, "run_depth_act", lambda out, console, force, **kwargs: acts.append((out, force)))
    (tmp_path / "report.md").write_text("the demo's report")
    code, output = run_cli(capsys, "demo", "--depth-task", "--out", str(tmp_path))
    assert code == 0 and acts == [(tmp_path, False)], output
    (tmp_path / "depth-task").mkdir()
    (tmp_path / "depth-task" / "depth_task.md").write_text("kept")
    code, output = run_cli(capsys, "demo", "--depth-task", "--out", str(tmp_path))
    assert code != 0 and f"{tmp_path / 'depth-task'} already exists; pass --force to replace it" in output
    assert len(acts) == 1 and (tmp_path / "depth-task" / "depth_task.md").read_text() == "kept"
    assert run_cli(capsys, "demo", "--depth-task", "--force", "--out", str(tmp_path))[0] == 0
    assert acts[-1] == (tmp_path, True) and (tmp_path / "report.md").read_text() == "the demo's report"


def test_the_depth_task_command_refuses_another_model_and_dtype(tmp_path, capsys):
    code, output = run_cli(capsys, "demo", "--depth-task", "--model", "HuggingFaceTB/SmolLM2-360M")
    assert code != 0 and "embedded model only" in output
    code, output = run_cli(capsys, "demo", "--depth-task", "--dtype", "bfloat16", "--out", str(tmp_path / "new"))
    assert code != 0 and "float32" in output and not (tmp_path / "new").exists()


def test_a_recipe_file_sets_training_and_scoring_and_bad_ones_are_refused(tmp_path, capsys):
    from recurfit.errors import RecurfitError
    from recurfit.train.depth_task import load_depth_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text("train:\n  steps: 40\n  lr: 1\n  deepest: false\nscore:\n  recurrences: [1, 32]\n")
    file = load_depth_recipe(path)
    assert file.train == DepthRecipe(steps=40, lr=1, deepest=False)
    assert file.score == DepthScoring(recurrences=(1, 32))
    for text, problem in [
        ("train:\n  step: 40\n", "recipe.yaml: Unknown config key 'train.step'; did you mean 'train.steps'?"),
        ("train: 40\n", "train. must be a mapping"),
        ("train:\n  steps: 4.5\n", "train.steps must be int, got 4.5"),
        ("train:\n  deepest: 1\n", "train.deepest must be bool"),
        ("train:\n  backprop: 0\n", "recipe.yaml: backprop must be positive"),
        ("train:\n  hops: 8\n", "need up to 27 variable names"),
        ("score:\n  hops: [0, 2]\n", "score.hops must be a list of positive integers"),
        ("score:\n  hops: 3\n", "score.hops must be a list"),
        ("tests:\n  hops: [3]\n", "Unknown config key 'tests'"),
        ("train: [", "not valid YAML"),
    ]:
        path.write_text(text)
        with pytest.raises(RecurfitError, match=re.escape(problem)):
            load_depth_recipe(path)
    code, output = run_cli(capsys, "demo", "--depth-task", "--depth-recipe", str(path), "--out", str(tmp_path / "o"))
    assert code != 0 and "not valid YAML" in output and not (tmp_path / "o").exists()
    code, output = run_cli(capsys, "demo", "--depth-recipe", str(path), "--out", str(tmp_path / "o"))
    assert code != 0 and "add --depth-task" in output and not (tmp_path / "o").exists()
