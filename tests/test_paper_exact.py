"""The paper, exactly: settings checked against the authors' released files (docs/paper-settings.md)."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, tiny_parent, token_batch
from safetensors.torch import load_file, save_file
from test_paper_runs import small_run
from test_raven import write_raven_checkpoint
from test_recipes import suggested_overrides
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
import recurfit.model.loading
import recurfit.train.loop
from recurfit.cli import main
from recurfit.data import TokenStore
from recurfit.errors import RecurfitError
from recurfit.model.accounting import paper_ramp, paper_training_flops, training_flops_per_token
from recurfit.model.loading import meta_model
from recurfit.model.sampling import Curriculum
from recurfit.surgery.raven import import_raven
from recurfit.train import Trainer, load_config, train
from recurfit.train.checkpoint import newest_readable
from recurfit.train.counting import paper_run_flops
from recurfit.train.initial_model import build_model
from recurfit.train.metrics import read_log
from recurfit.train.step_plan import depth_schedule

# ---------------------------------------------------------------- the adapter at the start of training


def test_torch_default_adapter_is_nn_linears_own_draw_from_the_seed():
    # The authors' conversions never write the adapter, so it keeps nn.Linear's default Kaiming-uniform draw.
    parent = tiny_parent("llama")
    hidden = parent.config.hidden_size
    model = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="torch-default", seed=7)
    torch.manual_seed(7)
    reference = torch.nn.Linear(2 * hidden, hidden, bias=False)
    assert torch.equal(model.model.adapter.weight, reference.weight)
    other = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="torch-default", seed=8)
    assert not torch.equal(other.model.adapter.weight, reference.weight)


def test_a_training_config_starts_its_adapter_as_the_run_seed_draws(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run", seed=5)
    config["model"]["adapter_init"] = "torch-default"
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, loaded.seed)
    hidden = model.config.hidden_size
    torch.manual_seed(5)
    assert torch.equal(model.model.adapter.weight, torch.nn.Linear(2 * hidden, hidden, bias=False).weight)
    assert load_config(None, [], base=small_run(workspace, tmp_path / "default")).model.adapter_init == "identity"


PAPER_RECIPES = sorted(Path(__file__).parent.parent.joinpath("recipes", "paper").glob("*.yaml"))


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.stem)
def test_every_paper_recipe_starts_the_adapter_and_draws_depths_as_the_authors_did(path):
    config = load_config(path)
    if config.model.init_from is None:
        assert config.model.adapter_init == "torch-default"
    assert config.depth.draw == "micro_batch"


# ---------------------------------------------------------------- the paper's FLOPs

PARENTS = {  # the paper recipes' parents' shapes (their Hub configs), built on the meta device: no weights needed
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
    ),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
    ),
    "allenai/OLMo-2-0425-1B": dict(
        model_type="olmo2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
    ),
}  # fmt: skip
SETTINGS = Path(__file__).parent.parent / "docs" / "paper-settings.md"
RECIPES = Path(__file__).parent.parent / "recipes" / "paper"
PLOT_DATA = json.loads((Path(__file__).parent / "fixtures" / "paper_plot_flops.json").read_text())["files"]
PLOT_TOKENS_PER_STEP = 2**20  # the authors' get_flops counts every run at 2^20 tokens per step
# A run a recipe continues (model.init_from) that no recipe writes: docs/paper-settings.md, two-phase arms.
UNWRITTEN_RUNS = {"runs/tinyllama-two-phase-1-static": ("tinyllama-484-two-phase-1.yaml", ["model.shape=null"])}


def plot_data_table() -> list[tuple[str, str, str | None, list[str]]]:
    """(plot data file, run label, recipe or None for the untrained parent, overrides) from the mapping table of
    docs/paper-settings.md ("Which recipe produced each plotted run")."""
    text = SETTINGS.read_text().split("| plot data file |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in text.splitlines()[2:]:
        file, label, recipe, overrides = (cell.strip() for cell in line.strip("|").split(" | "))
        recipe = recipe.strip("`") if recipe.startswith("`") else None
        rows.append((file.strip("`"), label.strip("`").replace("\\n", "\n"), recipe, overrides.strip("`").split()))
    return [(f, label, recipe, [] if overrides == ["—"] else overrides) for f, label, recipe, overrides in rows]


def recipe_config(recipe: str, overrides: list[str]):
    return load_config(RECIPES / recipe, overrides)


def continued_run(init_from: str):
    """The config of the run `init_from` names: the recipe whose `out` it is."""
    if init_from in UNWRITTEN_RUNS:
        return recipe_config(*UNWRITTEN_RUNS[init_from])
    (config,) = [c for c in map(load_config, RECIPES.glob("*.yaml")) if c.out == init_from]
    return config


def recipe_counts(config) -> dict:
    """Parameter counts of the model a recipe trains, its parent built from the Hub config on the meta device."""
    if config.model.init_from is not None:
        return recipe_counts(continued_run(config.model.init_from))
    settings = dict(PARENTS[config.model.path])
    model = meta_model(CONFIG_MAPPING[settings.pop("model_type")](**settings))
    if config.model.shape is not None:
        model = recurfit.retrofit(model, shape=tuple(config.model.shape), adapter=config.model.adapter)
    return recurfit.count_parameters(model)


def plot_flops(config, checkpoint: int) -> float:
    """The FLOPs the paper's plots give `config`'s run at `checkpoint`, every setting from the loaded config."""
    return paper_run_flops(config, recipe_counts(config), checkpoint, PLOT_TOKENS_PER_STEP)


def test_the_mapping_table_names_every_run_of_every_plot_data_file():
    mapped = {(file, label) for file, label, _, _ in plot_data_table()}
    assert mapped == {(file, label) for file, runs in PLOT_DATA.items() for label in runs}


@pytest.mark.parametrize("row", plot_data_table(), ids=lambda row: f"{row[0]}:{row[1][:30]}")
def test_the_recipes_reproduce_the_flops_of_the_authors_plot_data(row):
    file, label, recipe, overrides = row
    expected = PLOT_DATA[file][label]
    if recipe is None:  # the untrained parent: its one row is checkpoint 0
        assert expected == [[0, 0.0]]
        return
    config = recipe_config(recipe, overrides)
    for checkpoint, flops in expected:
        assert plot_flops(config, checkpoint) == pytest.approx(flops, rel=1e-6), f"{label} at {checkpoint}"


def test_the_fine_web_recipe_counts_its_ramp_as_the_authors_counted_those_runs():
    # Without the ceil rounding the recipe's own row is 1.2e-3 off at step 1,000: far outside 6 figures.
    config = recipe_config("tinyllama-484-fineweb.yaml", [])
    (flops,) = [f for checkpoint, f in PLOT_DATA["loop_whole_model"]["4,8,4"] if checkpoint == 1000]
    assert config.depth.paper_ramp_rounding == "ceil"
    floor = recipe_config("tinyllama-484-fineweb.yaml", ["depth.paper_ramp_rounding=floor"])
    assert plot_flops(floor, 1000) / flops - 1 == pytest.approx(1.23e-3, abs=0.01e-3)


def test_ceil_rounding_moves_each_ramp_boundary_up_to_the_next_whole_step():
    # W = 6,250, r̄ = 32: depth d ends at d · 195.3125, which floor truncates and ceil rounds up.
    floor = [paper_ramp(step, 32, "linear", 0.25, 25000) for step in range(6300)]
    ceil = [paper_ramp(step, 32, "linear", 0.25, 25000, "ceil") for step in range(6300)]
    assert floor.index(2) == 195 and ceil.index(2) == 196
    assert floor.index(32) == 6054 and ceil.index(32) == 6055 and floor[6250:] == ceil[6250:] == [32] * 50
    # A boundary that falls on a whole step stays there (integer arithmetic, as their ceil_div).
    assert paper_ramp(3124, 32, "linear", 0.25, 25000, "ceil") == 16
    assert paper_ramp(3125, 32, "linear", 0.25, 25000, "ceil") == 17


def test_the_papers_ramp_differs_from_the_run_only_by_rounding():
    # The authors' accounting truncates where their scheduler rounds up: at most one depth apart on the ramp.
    curriculum = Curriculum(32, "linear", math.ceil(0.25 * 25000))
    ramp = [paper_ramp(step, 32, "linear", 0.25, 25000) for step in range(25000)]
    assert all(abs(a - curriculum.at(step)) <= 1 for step, a in enumerate(ramp))
    assert ramp[0] == 1 and ramp.count(1) == int(6250 / 32) and ramp.count(32) == 25000 - int(31 / 32 * 6250)


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_a_runs_flops_paper_field_is_the_papers_accounting(tmp_path, workspace, rounding):
    config = small_run(workspace, tmp_path / "run", steps=5)
    config["depth"] = {"mean_recurrence": 4, "backprop_depth": 2, "curriculum": "linear", "curriculum_fraction": 0.6}
    config["depth"]["paper_ramp_rounding"] = rounding
    train(load_config(None, [], base=config))
    steps = [record for record in read_log(tmp_path / "run" / "log.jsonl") if record.get("kind") == "train"]
    counts = recurfit.count_parameters(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final"))
    tokens_per_step = steps[0]["tokens"]
    for record in steps:
        expected = paper_training_flops(
            counts,
            record["step"],
            tokens_per_step,
            total_steps=5,
            mean_recurrence=4,
            backprop_depth=2,
            curriculum="linear",
            curriculum_fraction=0.6,
            ramp_rounding=rounding,
        )
        assert record["flops_paper"] == expected
    # The two roundings give this ramp (3 steps to depth 4) different depths: the setting reached the count.
    other = paper_training_flops(
        counts,
        5,
        tokens_per_step,
        total_steps=5,
        mean_recurrence=4,
        backprop_depth=2,
        curriculum="linear",
        curriculum_fraction=0.6,
        ramp_rounding="ceil" if rounding == "floor" else "floor",
    )
    assert steps[-1]["flops_paper"] != other
    assert steps[-1]["flops_paper"] != steps[-1]["flops"]  # the drawn depths are the other measure


# ---------------------------------------------------------------- imports that never misconvert


def raven_folder(tmp_path, original, family="llama", name="raven", tensors=None, **config):
    """`original` written in the authors' layout, with extra config.json keys and tensors (None removes a key)."""
    folder = tmp_path / name
    folder.mkdir()
    write_raven_checkpoint(original, folder, family, padded_vocab=128)
    settings = json.loads((folder / "config.json").read_text())
    settings.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    if tensors:
        state = load_file(folder / "model.safetensors") | tensors
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def same_logits(imported, original, steps=(1, 3)):
    ids, zero = token_batch(), torch.zeros(2, 12, original.config.hidden_size)
    with torch.no_grad():
        for r in steps:
            expected = original.eval()(ids, num_steps=r, initial_state=zero).logits
            torch.testing.assert_close(imported(ids, num_steps=r, initial_state=zero).logits, expected)


def test_import_keeps_the_checkpoints_special_tokens(tmp_path):
    original = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="random")
    folder = raven_folder(tmp_path, original, bos_token_id=40, eos_token_id=41, pad_token_id=42)
    imported = import_raven(folder)
    for model in (imported.config.text_config, imported.config, imported.generation_config):
        assert (model.bos_token_id, model.eos_token_id, model.pad_token_id) == (40, 41, 42)
    bare = import_raven(raven_folder(tmp_path, original, name="bare"))
    assert bare.generation_config.eos_token_id is None and bare.config.text_config.bos_token_id is None


def test_import_applies_the_embedding_scale_and_huginns_defaults(tmp_path):
    original = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="random")
    hidden = original.config.hidden_size
    folder = raven_folder(tmp_path, original, init_values={"std": 0.02, "embed_scale": 3.0})
    imported = import_raven(folder)
    assert imported.config.state_init_std == pytest.approx(0.06)  # their s₀ is scaled by embed_scale too
    original.config.embedding_scale = 3.0
    same_logits(imported, original)
    # No init_values: Huginn's RavenConfig computes σ = sqrt(2 / 5h) and an embedding scale of sqrt(h).
    defaults = import_raven(raven_folder(tmp_path, original, name="defaults", init_values=None))
    assert defaults.config.embedding_scale == pytest.approx(math.sqrt(hidden))
    assert defaults.config.state_init_std == pytest.approx(math.sqrt(2 / (5 * hidden)) * math.sqrt(hidden))
    original.config.embedding_scale = math.sqrt(hidden)
    same_logits(defaults, original)


def test_import_reproduces_qk_bias(tmp_path):
    heads = 4
    parent = tiny_parent("llama", num_key_value_heads=heads, attention_bias=True)
    original = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="random")
    biases, generator = {}, torch.Generator().manual_seed(0)
    for theirs, ours in {"prelude": "prelude", "core_block": "core", "coda": "coda"}.items():
        for i, layer in enumerate(getattr(original.model, ours)):
            attention = layer.self_attn
            with torch.no_grad():  # their model has q and k biases only
                attention.v_proj.bias.zero_()
                attention.o_proj.bias.zero_()
                attention.q_proj.bias.copy_(torch.randn(attention.q_proj.bias.shape, generator=generator))
                attention.k_proj.bias.copy_(torch.randn(attention.k_proj.bias.shape, generator=generator))
            pair = torch.stack([attention.q_proj.bias, attention.k_proj.bias]).detach()
            biases[f"transformer.{theirs}.{i}.attn.qk_bias"] = pair.view(2, 1, heads, -1)
    imported = import_raven(raven_folder(tmp_path, original, tensors=biases, qk_bias=True))
    same_logits(imported, original)


@pytest.mark.parametrize(
    "family, kwargs, tensors, message",
    [
        ("llama", {"bias": True}, {}, "adapter bias"),
        ("llama", {}, {"transformer.adapter.bias": torch.ones(64)}, "adapter bias"),
        ("llama", {}, {"transformer.prelude.0.attn.qk_bias": torch.ones(2, 1, 4, 16)}, "grouped-query"),
        ("olmo2", {}, {"transformer.prelude.0.attn.qk_bias": torch.ones(2, 1, 4, 16)}, "olmo2"),
    ],
)
def test_import_refuses_what_it_cannot_reproduce(tmp_path, family, kwargs, tensors, message):
    parent = tiny_parent(family, num_key_value_heads=2) if family == "llama" else tiny_parent(family)
    original = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="random")
    folder = raven_folder(tmp_path, original, family, tensors=tensors, **kwargs)
    with pytest.raises(RecurfitError, match=message):
        import_raven(folder)


def test_import_raven_command_copies_the_tokenizer_beside_the_weights(tmp_path, capsys):
    original = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="random")
    folder = raven_folder(tmp_path, original)
    char_tokenizer().save_pretrained(folder)
    assert main(["import-raven", str(folder), "--out", str(tmp_path / "out")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("cat").input_ids == char_tokenizer()("cat").input_ids
    capsys.readouterr()


# ---------------------------------------------------------------- smaller settings


def test_model_revision_reaches_from_pretrained_and_the_model_card(tmp_path, workspace, monkeypatch):
    seen = []
    real = recurfit.model.loading.load_model

    def recording(name, *args, revision=None, **kwargs):
        seen.append(revision)
        return real(name, *args, revision=revision, **kwargs)

    monkeypatch.setattr("recurfit.train.initial_model.load_model", recording)
    config = small_run(workspace, tmp_path / "run", steps=2)
    config["model"]["revision"] = "stage1-step1907359-tokens4001B"
    train(load_config(None, [], base=config))
    assert seen == ["stage1-step1907359-tokens4001B"]
    assert "revision: stage1-step1907359-tokens4001B" in (tmp_path / "run" / "final" / "README.md").read_text()
    with pytest.raises(RecurfitError, match="drop model.path and model.revision"):
        load_config(None, ["model.path=null", "model.shape=null", "model.init_from=runs/x"], base=config)


def suggested_configs(name: str):
    path = RECIPES / name
    return [load_config(path, overrides) for overrides in [[], *suggested_overrides(path)]]


def test_the_scheduling_recipe_runs_the_curriculum_lengths_the_authors_ran():
    # paper_plots/model_size_cache.json: n_schedule_only_max_32_warmup_{0,0625,125,25}, k_schedule_only_…
    configs = suggested_configs("llama-242-schedule.yaml")
    mean_arms = {
        0.0 if c.depth.curriculum == "constant" else c.depth.curriculum_fraction
        for c in configs
        if c.depth.backprop_curriculum == "constant"
    }
    backprop_arms = {c.depth.backprop_curriculum_fraction for c in configs if c.depth.backprop_curriculum == "linear"}
    assert mean_arms == {0.0, 0.0625, 0.125, 0.25}
    assert backprop_arms == {0.0625, 0.125, 0.25}


def test_the_random_init_run_scales_embeddings_for_its_own_shape():
    # Fig. 2's "Random" is plot.py's "Geiping et al. emb_scale" run: √h of Llama-3.2-1B; Huginn's √5280 is the ablation.
    random_runs = [c for c in suggested_configs("llama-242-init.yaml") if c.model.init == "random"]
    assert random_runs[0].out == "runs/llama-242-random"
    assert random_runs[0].model.embedding_scale == pytest.approx(math.sqrt(2048))
    assert [c.model.embedding_scale for c in random_runs[1:]] == [pytest.approx(math.sqrt(5280))]


def test_validation_in_fp32_as_the_authors_measured(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run", steps=2, precision="bf16")
    config["model"]["state_init_std"] = 0.0
    config["data"]["validation"] = [str(workspace / "prose")]
    config["eval"] = {"steps": [1, 3], "rows": 4, "precision": "fp32"}
    train(load_config(None, [], base=config))
    record = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r.get("kind") == "eval"][-1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32).eval()
    rows = torch.from_numpy(TokenStore(workspace / "prose", "val")[:4].astype("int64"))

    def loss(r, autocast):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(rows[:, :-1], num_steps=r).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()).item()

    for r in (1, 3):
        assert record[f"prose/loss@{r}"] == pytest.approx(loss(r, autocast=False), rel=1e-5)
        assert abs(record[f"prose/loss@{r}"] - loss(r, autocast=True)) > 1e-4  # bf16 would not give it


def test_nonfinite_apply_updates_every_step_and_never_stops(tmp_path, workspace, monkeypatch):
    real = recurfit.train.loop.global_grad_norm

    def non_finite(*args, **kwargs):  # every step reports a NaN gradient norm
        return real(*args, **kwargs) * float("nan")

    monkeypatch.setattr(recurfit.train.loop, "global_grad_norm", non_finite)
    config = small_run(workspace, tmp_path / "apply", steps=3, max_bad_steps=1, nonfinite="apply")
    train(load_config(None, [], base=config))
    steps = [r for r in read_log(tmp_path / "apply" / "log.jsonl") if r.get("kind") == "train"]
    assert [r["skipped"] for r in steps] == [0, 0, 0]
    with pytest.raises(RecurfitError, match="non-finite losses or gradients in a row"):
        train(load_config(None, [], base=small_run(workspace, tmp_path / "skip", steps=3, max_bad_steps=1)))


def test_one_depth_draw_per_micro_batch_as_the_authors_loop(tmp_path, workspace, monkeypatch):
    used = []
    real = recurfit.train.loop.Trainer._micro_batch_loss

    def spy(self, rows, num_steps, first_row, *rest):
        if self.model.training:
            used.append(num_steps)
        return real(self, rows, num_steps, first_row, *rest)

    monkeypatch.setattr(recurfit.train.loop.Trainer, "_micro_batch_loss", spy)
    config = small_run(workspace, tmp_path / "run", steps=3)
    config["depth"] = {"mean_recurrence": 6, "backprop_depth": 2, "draw": "micro_batch"}
    loaded = load_config(None, [], base=config)
    train(loaded)
    schedule = depth_schedule(loaded)
    micro, rows = loaded.batch.micro, loaded.batch.global_
    expected = [schedule.at(step, offset) for step in range(3) for offset in range(0, rows, micro)]
    assert used == expected and len(set(expected)) > 1
    steps = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r.get("kind") == "train"]
    assert [tuple(d) for r in steps for d in r["depths"]] == expected
    counts = recurfit.count_parameters(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final"))
    seq_len = steps[0]["tokens"] // rows
    flops = seq_len * micro * sum(training_flops_per_token(counts, depth) for depth in expected)
    assert steps[-1]["flops"] == flops
    assert load_config(None, [], base=small_run(workspace, tmp_path / "default")).depth.draw == "step"


def test_a_chained_run_can_carry_the_optimizer_state_and_data_position(tmp_path, workspace):
    train(load_config(None, [], base=small_run(workspace, tmp_path / "parent", steps=3)))
    checkpoint = newest_readable(tmp_path / "parent" / "checkpoints")
    overrides = ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'parent'}", "steps=2"]
    carried = Trainer(
        load_config(None, [*overrides, "model.carry_state=true"], base=small_run(workspace, tmp_path / "b"))
    )
    fresh = Trainer(load_config(None, overrides, base=small_run(workspace, tmp_path / "c")))
    assert fresh.stream.position == 0 and all(not optimizer.state for optimizer in fresh.optimizers)
    # The moments are the parent's; the LR is this run's own schedule, not where the parent's ended.
    for optimizer, saved in zip(carried.optimizers, checkpoint.optimizer["optimizers"]):
        state = get_optimizer_state_dict(carried.model, optimizer, options=StateDictOptions(full_state_dict=True))
        assert state["state"].keys() == saved["state"].keys() and saved["state"]
        for name, values in saved["state"].items():
            assert all(torch.equal(state["state"][name][key], value) for key, value in values.items())
    assert [s.get_last_lr() for s in carried.schedulers] == [s.get_last_lr() for s in fresh.schedulers]
    assert [g["lr"] for o in carried.optimizers for g in o.param_groups] == [
        g["lr"] for o in fresh.optimizers for g in o.param_groups
    ]
    # The data continue where the parent stopped: its next rows, not the stream's first ones.
    assert carried.stream.position == checkpoint.trainer["stream"]["position"] > 0
    fresh.stream.load_state_dict(checkpoint.trainer["stream"])
    assert torch.equal(carried.stream.next_batch(8, 0, 1), fresh.stream.next_batch(8, 0, 1))
    with pytest.raises(RecurfitError, match="model.carry_state carries a finished run's state"):
        load_config(None, ["model.carry_state=true"], base=small_run(workspace, tmp_path / "d"))
