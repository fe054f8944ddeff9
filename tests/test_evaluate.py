"""Evaluation across test recurrence: the single-pass sweep, padding, the lm-eval model, offline tasks, CLI."""

import json

import pytest
import torch
from conftest import char_tokenizer, run_cli, tiny_parent, token_batch
from lm_eval.api.instance import Instance

import recurfit
from recurfit.errors import RecurfitError
from recurfit.evaluate.loss import Examples, _windows, batches, evaluate_loss, summed_nll, sweep_nll
from recurfit.evaluate.results import Row, Sweep
from recurfit.evaluate.suite import (
    PAPER_SUITE,
    RunSettings,
    _leaves,
    chance_level,
    offline_tasks,
    plan_runs,
    resolve_tasks,
    task_columns,
    task_label,
    task_manager,
)
from recurfit.evaluate.tasks.offline import last_boxed, math_results, minerva_answer


def recurrent(family="llama", **kwargs):
    """A retrofit whose depth matters: a random adapter, so every r gives different logits."""
    parent = tiny_parent(family)
    return recurfit.retrofit(parent, (2, 2, 2), adapter_init="random", **kwargs).eval()


def ragged(lengths=(12, 7, 3, 10), seed=3) -> Examples:
    generator = torch.Generator().manual_seed(seed)
    return Examples([torch.randint(1, 97, (n,), generator=generator).tolist() for n in lengths], "random ids")


# ---------------------------------------------------------------- loss sweep


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo3", "gemma"])
def test_one_pass_readouts_equal_separate_forwards_from_the_same_state(family):
    model = recurrent(family)
    ids = token_batch(2, 12)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding on one row
    s0 = torch.randn(2, 12, model.config.hidden_size) * 0.1
    readouts = dict(model.model.final_hidden_states_at(ids, [1, 3, 4], attention_mask=mask, initial_state=s0))
    assert list(readouts) == [1, 3, 4]
    for r, hidden in readouts.items():
        separate = model.model(ids, attention_mask=mask, num_steps=r, initial_state=s0)[0]
        torch.testing.assert_close(hidden, separate, rtol=0, atol=1e-5)
    assert (readouts[1] - readouts[4]).abs().max() > 1e-3  # depth changes the answer, so the check has teeth


def test_loss_equals_the_models_own_loss_at_each_r():
    model = recurrent(state_init_std=0.0)
    ids = token_batch(3, 10)
    mask = torch.ones_like(ids)
    nll = sweep_nll(model, ids, mask, [1, 3])
    for r in (1, 3):
        expected = model(ids, labels=ids, num_steps=r).loss * ids.shape[0] * (ids.shape[1] - 1)
        torch.testing.assert_close(nll[r].sum(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("parent", [False, True])
def test_padded_batches_give_each_sequence_its_loss_alone(parent):
    model = tiny_parent("qwen3") if parent else recurrent("qwen3", state_init_std=0.0)
    examples = ragged()
    steps = [1, 2, 4]
    batched = evaluate_loss(model, examples, steps, batch_size=4, show_progress=False)
    alone = evaluate_loss(model, examples, steps, batch_size=1, show_progress=False)
    assert list(batched) == ([None] if parent else steps)
    for r in batched:
        assert batched[r]["loss"] == pytest.approx(alone[r]["loss"], abs=1e-5)
    # Padding is neither attended to nor scored: the same ids padded with other tokens change nothing.
    ids, mask = next(batches(examples, 4))
    noisy = torch.where(mask.bool(), ids, torch.randint_like(ids, 1, 97))
    torch.testing.assert_close(
        sweep_nll(model, ids, mask, steps)[steps[0] if not parent else None],
        sweep_nll(model, noisy, mask, steps)[steps[0] if not parent else None],
    )


def test_windows_predict_every_token_after_the_first_exactly_once():
    tokenizer = char_tokenizer()
    texts = ["the cat sat on the mat. " * 5, "a dog."]
    windows = list(_windows(iter(texts), tokenizer, seq_len=16))
    assert all(2 <= len(w) <= 17 for w in windows)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + EOS
    assert sum(len(w) - 1 for w in windows) == sum(n - 1 for n in lengths)


def test_summed_nll_ignores_masked_targets():
    logits = torch.randn(1, 4, 10)
    ids = torch.tensor([[1, 2, 3, 4]])
    full = summed_nll(logits, ids, torch.ones_like(ids))
    cut = summed_nll(logits, ids, torch.tensor([[1, 1, 0, 0]]))
    expected = torch.nn.functional.cross_entropy(logits[0, :1], ids[0, 1:2], reduction="sum")
    torch.testing.assert_close(cut[0], expected)
    assert full[0] > cut[0]


# ---------------------------------------------------------------- lm-eval model


@pytest.fixture(scope="module")
def lm_pair():
    from recurfit.evaluate.lm import RecurfitLM

    model = recurrent(state_init_std=0.0)
    tokenizer = char_tokenizer()

    def make(batch_size, **kwargs):
        return RecurfitLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, num_steps=3, **kwargs)

    return make


def _requests(kind, arguments):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_lm_eval_loglikelihoods_batched_equal_unbatched_and_depend_on_r(lm_pair):
    pairs = [("the cat sat", " on the mat"), ("a", " dog ran far and then"), ("big red tree", "."), ("x", " y")]
    batched = lm_pair(4).loglikelihood(_requests("loglikelihood", pairs))
    alone = lm_pair(1).loglikelihood(_requests("loglikelihood", pairs))
    for (a, greedy_a), (b, greedy_b) in zip(batched, alone):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    shallow = lm_pair(4)
    shallow.num_steps = 1
    assert any(
        abs(a[0] - b[0]) > 1e-3 for a, b in zip(shallow.loglikelihood(_requests("loglikelihood", pairs)), batched)
    )


def test_lm_eval_generation_batched_equals_unbatched(lm_pair):
    prompts = [
        ("the cat", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        ("a big red tree and then", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        ("x", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
    ]
    batched = lm_pair(3).generate_until(_requests("generate_until", prompts))
    alone = lm_pair(1).generate_until(_requests("generate_until", prompts))
    assert batched == alone and all(isinstance(text, str) for text in batched)


def test_lm_eval_runs_a_fixed_depth_parent_without_num_steps():
    from recurfit.evaluate.lm import RecurfitLM

    lm = RecurfitLM(pretrained=tiny_parent("llama"), tokenizer=char_tokenizer(), batch_size=2, num_steps=4)
    assert not lm.recurrent
    ((logprob, _),) = lm.loglikelihood(_requests("loglikelihood", [("the cat", " sat")]))
    assert logprob < 0


def test_add_bos_token_prepends_bos_as_hflm_does_with_a_tokenizer_it_loads_by_name(saved):
    """The authors' `add_bos_token=True`: HFLM passes it to AutoTokenizer.from_pretrained, which then prepends BOS;
    a tokenizer given as an object HFLM would use as it is, so RecurfitLM applies the flag to a copy."""
    from lm_eval.models.huggingface import HFLM

    from recurfit.evaluate.lm import RecurfitLM

    tokenizer = char_tokenizer()
    text = "the cat sat"
    assert tokenizer(text)["input_ids"][0] != tokenizer.bos_token_id  # this tokenizer adds no BOS by itself
    by_name = HFLM(pretrained=str(saved / "parent"), add_bos_token=True, device="cpu", batch_size=1)
    ours = RecurfitLM(pretrained=recurrent(), tokenizer=tokenizer, batch_size=1, add_bos_token=True)
    expected = [tokenizer.bos_token_id, *tokenizer(text)["input_ids"]]
    assert by_name.tok_encode(text) == ours.tok_encode(text) == expected
    assert ours.tok_batch_encode([text])[0][0].tolist() == by_name.tok_batch_encode([text])[0][0].tolist() == expected
    assert tokenizer(text)["input_ids"] == expected[1:]  # the caller's tokenizer is left as it was
    plain = RecurfitLM(pretrained=recurrent(), tokenizer=tokenizer, batch_size=1)
    assert plain.tok_encode(text) == expected[1:]


# ---------------------------------------------------------------- offline tasks and scoring


def test_offline_task_names_resolve_and_unknown_ones_fail_with_a_suggestion():
    manager = task_manager("offline")
    assert {"arc_challenge", "gsm8k_cot", "minerva_math", "mmlu"} <= set(offline_tasks())
    assert resolve_tasks(["arc_challenge", "gsm8k_cot"], "offline", manager) == [
        "arc_challenge_offline",
        "gsm8k_cot_offline",
    ]
    assert resolve_tasks(["mmlu_anatomy", "minerva_math_algebra"], "offline", manager) == [
        "mmlu_anatomy_offline",
        "minerva_math_algebra_offline",
    ]
    assert len(resolve_tasks(["paper"], "offline", manager)) == 9
    with pytest.raises(RecurfitError, match="did you mean 'arc_challenge'"):
        resolve_tasks(["arc_challenge", "arc_chalenge"], "offline", manager)


def test_hub_names_are_lm_evals_but_gsm8k_cot_is_the_authors_variant_and_runs_get_the_papers_settings():
    manager = task_manager("hub")  # indexes task files only: nothing is downloaded
    names = resolve_tasks(["paper"], "hub", manager)
    assert names == [*PAPER_SUITE[:7], "gsm8k_cot_sean", "minerva_math"]
    assert [task_label(name) for name in names] == list(PAPER_SUITE)
    for _data, tasks in (("hub", names), ("offline", resolve_tasks(["paper"], "offline", task_manager("offline")))):
        runs = plan_runs(tasks)
        assert runs == {RunSettings(num_fewshot=0): tasks[:7], RunSettings(num_fewshot=1, max_length=1024): tasks[7:]}
    assert plan_runs(["boolq"]) == {RunSettings(): ["boolq"]}  # not the paper's: lm-eval's defaults
    with pytest.raises(RecurfitError, match="lm_eval ls tasks"):
        resolve_tasks(["no_such_task"], "hub", manager)


def test_the_papers_other_tasks_resolve_offline_or_through_the_hub():
    """LAMBADA and Social IQa have offline data; WebQuestions and ASDiv run only as lm-eval's own (Hub) tasks, and
    asking for them offline says so. `paper-shapes` is the appendix figure's suite, zero-shot like the authors ran."""
    offline, hub = task_manager("offline"), task_manager("hub")
    assert resolve_tasks(["lambada_openai", "social_iqa_offline"], "offline", offline) == [
        "lambada_openai_offline",
        "social_iqa_offline",
    ]
    others = ["lambada_openai", "social_iqa", "webqs", "asdiv"]
    assert resolve_tasks(others, "hub", hub) == others
    for name in ("webqs", "asdiv"):
        with pytest.raises(RecurfitError, match=f"No offline data for '{name}': run it with `--data hub`.*network"):
            resolve_tasks(["arc_easy", name], "offline", offline)
    shapes = resolve_tasks(["paper-shapes"], "offline", offline)
    assert [task_label(name) for name in shapes] == [*PAPER_SUITE[:7], "social_iqa", "lambada_openai"]
    assert plan_runs(shapes) == {RunSettings(num_fewshot=0): shapes}
    assert plan_runs(["asdiv", "webqs"]) == {RunSettings(num_fewshot=0): ["asdiv"], RunSettings(): ["webqs"]}
    assert task_columns("lambada_openai_offline", {"perplexity,none": 3.0, "acc,none": 0.5}) == {
        "lambada_openai (acc)": 0.5
    }
    assert list(task_columns("webqs", {"exact_match,none": 0.1})) == ["webqs (exact_match)"]


def test_eval_tasks_offline_refuses_a_hub_only_task_before_loading_a_model(tmp_path, capsys):
    code, text = run_cli(capsys, "eval", "tasks", tmp_path / "no-model", "--tasks", "webqs", "--out", tmp_path / "out")
    assert code == 2 and "No offline data for 'webqs': run it with `--data hub`" in text
    assert not (tmp_path / "out").exists()


def test_eval_tasks_backend_vllm_without_vllm_is_refused_naming_the_setup_script(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    argv = ["eval", "tasks", tmp_path / "no-model", "--tasks", "gsm8k_cot", "--backend", "vllm"]
    code, text = run_cli(capsys, *argv, "--out", tmp_path / "out")
    assert code == 2 and not (tmp_path / "out").exists()
    assert "--backend vllm: vLLM is not installed in this environment; run ./scripts/setup-vllm.sh" in text


def test_lambada_and_social_iqa_score_the_tiny_model_as_its_own_loglikelihoods_say(lm_pair):
    """Offline LAMBADA and Social IQa through lm-eval on a tiny random retrofit: LAMBADA's acc and perplexity and
    Social IQa's acc equal the numbers computed by hand from the model's log-likelihoods of the same requests."""
    import math

    from lm_eval import simple_evaluate

    lm, manager = lm_pair(2), task_manager("offline")
    names = ["lambada_openai_offline", "social_iqa_offline"]
    results = simple_evaluate(
        model=lm, tasks=names, task_manager=manager, limit=3, num_fewshot=0, bootstrap_iters=0, log_samples=False
    )["results"]
    lambada, siqa = (manager.load([name])["tasks"][name] for name in names)
    pairs = [(lambada.doc_to_text(doc), lambada.doc_to_target(doc)) for doc in lambada.eval_docs.select(range(3))]
    scored = lm.loglikelihood(_requests("loglikelihood", pairs))
    assert results[names[0]]["acc,none"] == pytest.approx(sum(greedy for _, greedy in scored) / 3)
    assert results[names[0]]["perplexity,none"] == pytest.approx(math.exp(-sum(ll for ll, _ in scored) / 3))
    right = 0
    for doc in siqa.eval_docs.select(range(3)):
        pairs = [(siqa.doc_to_text(doc), " " + choice) for choice in siqa.doc_to_choice(doc)]
        lls = [ll for ll, _ in lm.loglikelihood(_requests("loglikelihood", pairs))]
        right += lls.index(max(lls)) == siqa.doc_to_target(doc)
    assert results[names[1]]["acc,none"] == pytest.approx(right / 3)


def test_table_columns_put_the_papers_metric_first_and_keep_the_others():
    results = {"acc,none": 0.5, "acc_stderr,none": "N/A", "acc_norm,none": 0.25, "alias": "x"}
    assert task_columns("arc_easy_offline", results) == {"arc_easy (acc_norm)": 0.25, "arc_easy (acc)": 0.5}
    assert list(task_columns("winogrande_offline", {"acc,none": 0.5})) == ["winogrande (acc)"]
    gsm8k = {"exact_match,strict-match": 0.1, "exact_match,flexible-extract": 0.2}
    assert task_columns("gsm8k_cot_sean", gsm8k) == {
        "gsm8k_cot (exact_match, flexible-extract)": 0.2,
        "gsm8k_cot (exact_match, strict-match)": 0.1,
    }
    math = {"exact_match,none": 0.1, "math_verify,none": 0.2}  # lm-eval's own minerva_math (--data hub)
    assert list(task_columns("minerva_math", math)) == ["minerva_math (math_verify)", "minerva_math (exact_match)"]
    with pytest.raises(RecurfitError, match="No known metric"):
        task_columns("lambada_openai", {"perplexity,none": 3.0})


def test_every_offline_task_loads_its_bundled_data_and_chance_follows_the_groups():
    manager = task_manager("offline")
    names = resolve_tasks([*offline_tasks()], "offline", manager)
    loaded = manager.load(names)
    sizes = {name: sum(len(task.eval_docs) for task in _leaves(name, loaded)) for name in names}
    assert sizes == {
        "arc_easy_offline": 2376,
        "arc_challenge_offline": 1172,
        "openbookqa_offline": 500,
        "hellaswag_offline": 10042,
        "piqa_offline": 1838,
        "winogrande_offline": 1267,
        "mmlu_offline": 14042,
        "gsm8k_cot_offline": 1319,
        "minerva_math_offline": 5000,
        "minerva_math500_offline": 500,
        "social_iqa_offline": 1954,
        "lambada_openai_offline": 5153,
    }
    assert len(_leaves("mmlu_offline", loaded)) == 57 and len(_leaves("minerva_math_offline", loaded)) == 7
    assert chance_level(_leaves("mmlu_offline", loaded), 2) == pytest.approx(0.25)
    assert chance_level(_leaves("piqa_offline", loaded), 3) == pytest.approx(0.5)
    assert chance_level(_leaves("minerva_math_offline", loaded), 2) == 0.0
    assert chance_level(_leaves("social_iqa_offline", loaded), 3) == pytest.approx(1 / 3)
    assert chance_level(_leaves("lambada_openai_offline", loaded), 3) == 0.0  # a word to predict, not a choice


def test_answer_extraction_helpers():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None and minerva_answer("x = 3") is None
    assert minerva_answer("Final Answer: The final answer is $[2,5)$. I hope it is correct.") == "$[2,5)$"
    doc = {"solution": "So $x = \\boxed{\\frac{1}{2}}$."}
    assert math_results(doc, ["Final Answer: The final answer is $0.5$. I hope it is correct."]) == {
        "math_verify": 1,
        "stated_answer": 1,
    }


# ---------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny parent and its retrofit saved with a tokenizer, as `eval` finds them on disk."""
    root = tmp_path_factory.mktemp("eval")
    tokenizer = char_tokenizer()
    parent = tiny_parent("llama")
    for name, model in (("parent", parent), ("model", recurfit.retrofit(parent, (2, 2, 2), adapter_init="random"))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def test_eval_loss_writes_table_results_and_figures_and_never_overwrites(saved, workspace, tmp_path, capsys):
    out = tmp_path / "loss"
    code, text = run_cli(
        capsys,
        "eval",
        "loss",
        saved / "model",
        "--data",
        workspace / "prose",
        "--recurrence",
        "1,2,4",
        "--baseline",
        saved / "parent",
        "--out",
        out,
    )
    assert code == 0, text
    figures = {f"{name}.{suffix}" for name in ("recurrence", "flops") for suffix in ("png", "pdf", "svg")}
    assert {p.name for p in out.iterdir()} == {"results.json", "table.md", *figures}
    sweep = Sweep.load(out / "results.json")
    assert [row.steps for row in sweep.rows] == [1, 2, 4] and sweep.parent is not None
    assert sweep.details["tokens"] == sweep.details["sequences"] * 32
    table = (out / "table.md").read_text()
    assert "| r=4 |" in table and f"| parent ({saved / 'parent'}) |" in table
    before = (out / "results.json").read_text()
    code, text = run_cli(capsys, "eval", "loss", saved / "model", "--data", workspace / "prose", "--out", out)
    assert code == 2 and "--force" in text and (out / "results.json").read_text() == before


def test_eval_loss_of_a_fixed_depth_model_is_one_row_and_bad_data_is_an_error(saved, workspace, tmp_path, capsys):
    code, _ = run_cli(capsys, "eval", "loss", saved / "parent", "--data", workspace / "math", "--out", tmp_path / "p")
    assert code == 0
    sweep = Sweep.load(tmp_path / "p" / "results.json")
    assert len(sweep.rows) == 1 and sweep.rows[0].steps is None
    code, text = run_cli(
        capsys, "eval", "loss", saved / "model", "--data", tmp_path / "nothing.jsonl", "--out", tmp_path / "x"
    )
    assert code == 2 and "nothing.jsonl" in text and not (tmp_path / "x").exists()


def test_eval_tasks_table_has_a_row_per_r_the_parent_and_chance(saved, tmp_path, capsys):
    out = tmp_path / "tasks"
    code, text = run_cli(
        capsys,
        "eval",
        "tasks",
        saved / "model",
        "--tasks",
        "arc_challenge,gsm8k_cot",
        "--recurrence",
        "1,2",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--baseline",
        saved / "parent",
        "--out",
        out,
    )
    assert code == 0, text
    sweep = Sweep.load(out / "results.json")
    assert sweep.metrics == [
        "arc_challenge (acc_norm)",
        "arc_challenge (acc)",
        "gsm8k_cot (exact_match, flexible-extract)",
        "gsm8k_cot (exact_match, strict-match)",
    ]
    assert sweep.details["headline"] == ["arc_challenge (acc_norm)", "gsm8k_cot (exact_match, flexible-extract)"]
    assert sweep.details["model_args"] == {"add_bos_token": True}
    assert [row.label for row in sweep.rows] == ["r=1", "r=2"]
    assert sweep.chance.metrics["arc_challenge (acc_norm)"] == pytest.approx(0.25)
    assert "Each task's first column is the metric the paper reports" in (out / "table.md").read_text()
    assert set(json.loads((out / "lm_eval.json").read_text())) == {"r=1", "r=2", "parent"}
    code, text = run_cli(capsys, "eval", "tasks", saved / "model", "--tasks", "gsm8k", "--out", tmp_path / "bad")
    assert code == 2 and "did you mean 'gsm8k_cot'" in text and not (tmp_path / "bad").exists()


def test_plot_overlays_results_and_training_runs(saved, workspace, tmp_path, capsys):
    run_cli(
        capsys,
        "eval",
        "loss",
        saved / "model",
        "--data",
        workspace / "prose",
        "-r",
        "1,2",
        "--out",
        tmp_path / "a",
    )
    run_cli(capsys, "eval", "loss", saved / "parent", "--data", workspace / "prose", "--out", tmp_path / "b")
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"kind": "train", "step": 1, "loss": 5.0, "flops": 1e9},
                {"kind": "train", "step": 2, "loss": 4.0, "flops": 2e9},
                {"kind": "eval", "step": 2, "prose/loss@1": 4.5, "prose/loss@4": 4.2},
            ]
        )
    )
    code, text = run_cli(
        capsys, "plot", tmp_path / "a", tmp_path / "b" / "results.json", tmp_path / "run", "--out", tmp_path / "figs"
    )
    assert code == 0, text
    assert {p.name for p in (tmp_path / "figs").iterdir()} == {
        f"{name}.{suffix}" for name in ("loss_recurrence", "loss_flops", "training") for suffix in ("png", "pdf", "svg")
    }
    code, text = run_cli(capsys, "plot", tmp_path, "--out", tmp_path / "figs2")
    assert code == 2 and "neither a training run" in text


def test_figures_draw_a_shared_parent_once_and_a_validation_panel_per_store(tmp_path, monkeypatch):
    from recurfit.evaluate import figures as plots
    from recurfit.evaluate.figures import sweeps as sweep_figures
    from recurfit.evaluate.figures import training as training_figures

    parent = Row("parent (p)", {"loss": 3.0}, flops_per_token=10**8)
    sweeps = [
        Sweep("loss", name, ["loss"], [Row("r=1", {"loss": loss}, 1, 1, 10**8)], parent)
        for name, loss in [("a", 4.0), ("b", 5.0)]
    ]
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"kind": "train", "step": 1, "loss": 5.0, "flops": 1e9},
                {
                    "kind": "eval",
                    "step": 1,
                    "prose/loss@1": 4.5,
                    "prose/loss@4": 4.2,
                    "math/loss@1": 3.5,
                    "math/loss@4": 3.2,
                },
            ]
        )
    )
    figures = []
    for module in (sweep_figures, training_figures):
        monkeypatch.setattr(module, "save_figure", lambda figure, path: figures.append(figure) or path)
    plots.plot_recurrence(sweeps, tmp_path / "r.png")
    plots.plot_training([log.parent], tmp_path / "t.png")
    recurrence, training = figures
    assert [line.get_label() for line in recurrence.axes[0].get_lines()] == ["a", "b", "parent (p)"]
    panels = [axis for axis in training.axes if axis.get_visible()]
    titles = [f"validation loss on {s} (fainter: smaller r)" for s in ("prose", "math")]
    assert [axis.get_title() for axis in panels[2:]] == titles
    assert [line.get_label() for line in panels[3].get_lines()] == ["run r=1", "run r=4"]


def test_lm_eval_command_line_runs_the_registered_model(saved, tmp_path, capsys):
    out = tmp_path / "lm"
    code, text = run_cli(
        capsys,
        "lm-eval",
        "--model",
        "recurfit",
        "--model_args",
        f"pretrained={saved / 'model'},num_steps=2",
        "--tasks",
        "arc_easy_offline",
        "--limit",
        "2",
        "--output_path",
        out,
    )
    assert code == 0, text
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert "arc_easy_offline" in results["results"] and results["config"]["model"] == "recurfit"


def test_lm_eval_requests_advance_recurfits_bar_and_lm_evals_bars_stay_off(lm_pair, monkeypatch, capsys):
    from recurfit.progress import progress_bar

    monkeypatch.setenv("TQDM_DISABLE", "1")  # as `recurfit` without --verbose sets it
    monkeypatch.setenv("RECURFIT_PROGRESS_EVERY", "1")
    lm = lm_pair(2)
    pairs = [("the cat sat", " on the mat"), ("a", " dog"), ("big red tree", "."), ("x", " y")]
    prompts = [("the cat", {"until": ["."], "max_gen_toks": 3, "do_sample": False})] * 2
    with progress_bar() as bar:  # captured output is not a terminal: plain lines
        lm.progress = (bar, "model at r=3")
        lm.loglikelihood(_requests("loglikelihood", pairs))
        lm.generate_until(_requests("generate_until", prompts))
    said = capsys.readouterr()
    lines = [line.split("  ")[0] for line in said.out.splitlines()]
    assert lines == [
        *(f"model at r=3: log-likelihood requests: {i}/4 ({i / 4:.0%})" for i in range(1, 5)),
        *(f"model at r=3: generation requests: {i}/2 ({i / 2:.0%})" for i in range(1, 3)),
    ]
    assert "Running generate_until requests" not in said.err and "it/s]" not in said.err  # no bar of lm-eval's
