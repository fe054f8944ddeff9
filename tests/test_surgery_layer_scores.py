"""Angular distance per layer, its Kneedle knees, `select="angular"`, `recurfit inspect --layers` and its figure."""

import math

import pytest
import torch
from conftest import check_figure, tiny_parent, token_batch
from transformers import AutoModelForCausalLM

import recurfit
from recurfit.surgery.layer_scores import (
    LayerScores,
    block_influence,
    core_window,
    kneedle,
    knees,
    measure,
    plot_layer_scores,
)
from recurfit.surgery.parity import check_parity
from recurfit.surgery.selection import LayerSelection, selections_by_rule

# An angular-distance curve of the usual form: a fast fall over the first layers, a flat middle, a rise at the end
U_CURVE = [0.5, 0.2, 0.08, 0.07, 0.075, 0.07, 0.072, 0.07, 0.09, 0.06, 0.07, 0.15, 0.3]


def test_scores_equal_arccos_of_the_cosine_between_hidden_states():
    parent = tiny_parent("llama", num_layers=5)
    parent.model.norm = torch.nn.Identity()  # the last hidden state is then the last layer's own output
    ids = token_batch(2, 10)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: its positions are not scored
    with torch.no_grad():
        states = parent(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    scores = measure(parent, {"input_ids": ids, "attention_mask": mask})
    real = mask.bool()
    for layer in range(5):
        cosine = torch.nn.functional.cosine_similarity(states[layer], states[layer + 1], dim=-1)[real].double()
        angle = torch.arccos(cosine.clamp(-1, 1)) / math.pi
        assert scores.angular[layer] == pytest.approx(angle.mean().item(), rel=1e-5, abs=1e-7)
        assert scores.influence[layer] == pytest.approx(1 - cosine.mean().item(), rel=1e-5, abs=1e-7)
    assert scores.tokens == 16 and all(0 < a < 1 for a in scores.angular)
    assert list(scores.influence) == block_influence(parent, {"input_ids": ids, "attention_mask": mask})


def test_an_identity_layer_has_angular_distance_zero():
    parent = tiny_parent("llama", num_layers=4)
    with torch.no_grad():
        parent.model.layers[2].self_attn.o_proj.weight.zero_()
        parent.model.layers[2].mlp.down_proj.weight.zero_()
    scores = measure(parent, token_batch(2, 8))
    assert scores.angular[2] == pytest.approx(0.0, abs=2e-4)  # arccos near 1 in fp32: ~sqrt(2·6e-8)/π
    assert min(a for i, a in enumerate(scores.angular) if i != 2) > 0.01


def test_kneedle_finds_the_knee_of_a_constructed_curve():
    # Flipped and scaled: y = [0, .8, .9, .95, 1] over x = [0, .25, .5, .75, 1]; the chord is y = x, and
    # |x - y| = [0, .55, .4, .2, 0] is largest at index 1.
    assert kneedle([1.0, 0.2, 0.1, 0.05, 0.0]) == 1
    # A rising curve that bends at index 6: slope 1 up to it, then slope 0.1
    rising = [float(i) if i <= 6 else 6 + 0.1 * (i - 6) for i in range(20)]
    assert kneedle(rising, decreasing=False) == 6
    assert kneedle([0.3, 0.3, 0.3, 0.3]) == 2  # flat: the middle, as the fork
    assert kneedle([0.5, 0.1]) == 0


def test_knees_split_encode_think_decode():
    first, end = knees(U_CURVE)
    assert (first, end) == (2, 11)  # layers 0-1 fall fast; 11-12 rise
    selection = LayerSelection.angular(None, U_CURVE)
    assert selection.as_dict() == {"prelude": [0, 1], "core": list(range(2, 11)), "coda": [11, 12]}
    assert knees([0.1] * 6) == (2, 4)  # flat: Kneedle's middle of each span it searches


def test_a_shape_takes_the_core_block_of_highest_angular_distance_in_the_thinking_region():
    # Thinking region [2, 11); the 3 consecutive layers there with the largest summed distance are 6-8
    assert core_window(U_CURVE, (2, 3, 2), (2, 11)) == range(6, 9)
    assert LayerSelection.angular((2, 3, 2), U_CURVE).as_dict() == {
        "prelude": [0, 1],
        "core": [6, 7, 8],
        "coda": [11, 12],
    }
    # A core longer than the thinking region (less prelude and coda) goes anywhere between prelude and coda
    assert LayerSelection.angular((2, 10, 1), U_CURVE).core == tuple(range(2, 12))
    # Ties go to the block nearest the coda, where the paper's rule puts the core
    assert core_window([0.5] + [0.1] * 8 + [0.5], (1, 2, 1), (1, 9)) == range(7, 9)


@pytest.mark.parametrize("shape", [(2, 3, 2), None])
def test_select_angular_gives_a_valid_split_equal_to_the_pruned_parent(shape):
    parent = tiny_parent("llama", num_layers=8)
    ids = token_batch(2, 16)
    model = recurfit.retrofit(parent, shape, select="angular", calibration=ids)
    expected = LayerSelection.angular(shape, measure(parent, ids).angular)
    assert model.config.source_layers == expected.as_dict()
    if shape is not None:
        assert (model.config.num_prelude_layers, model.config.num_core_layers, model.config.num_coda_layers) == shape
    assert check_parity(parent, model, steps=(1, 5)).equal


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(shape=(1, 2, 1)), "select='angular' needs calibration token ids"),
        (dict(), "select='angular' needs calibration token ids"),
        (dict(shape=(5, 5, 5)), "needs 15 layers but the parent has only 6"),  # before any calibration is read
        (dict(shape=(1, 2, 1), core=[2, 3]), "not both"),
        (dict(prelude=[0], core=[2, 3], coda=[5]), "cannot be combined with explicit indices"),
    ],
)
def test_bad_angular_specs_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        recurfit.retrofit(tiny_parent("llama"), select="angular", **kwargs)


def test_too_few_layers_for_knees_and_meta_weights_are_clear_errors():
    with pytest.raises(ValueError, match="has 2 layers: finding knees .* needs at least 3; give a shape"):
        recurfit.retrofit(tiny_parent("llama", num_layers=2), select="angular", calibration=token_batch())
    config = tiny_parent("llama").config
    with torch.device("meta"):
        parent = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="needs real weights, not meta"):
        recurfit.retrofit(parent, (1, 2, 1), select="angular", calibration=token_batch())


def test_the_figure_marks_the_knees_and_follows_the_figure_conventions(drawn, tmp_path):
    scores = LayerScores(tuple(U_CURVE), tuple(1 - math.cos(math.pi * a) for a in U_CURVE), 100)
    png = plot_layer_scores(scores, selections_by_rule(scores, (2, 3, 2)), tmp_path / "layers.png", "Layer scores")
    assert all((tmp_path / f"layers{suffix}").stat().st_size > 1000 for suffix in (".png", ".pdf", ".svg"))
    assert png == tmp_path / "layers.png"
    (figure,) = drawn
    check_figure(figure)
    angular, influence, parts = figure.axes
    (knee_line,) = [line for line in angular.get_lines() if line.get_label() == "knee (Kneedle)"]
    assert list(knee_line.get_xdata()) == [2, 10]  # the first and last thinking layers
    rows = ["paper (2, 3, 2)", "shortgpt (2, 3, 2)", "angular (2, 3, 2)", "knees (2, 9, 2)"]
    assert [t.get_text() for t in parts.get_yticklabels()] == rows
    legend = {t.get_text() for t in figure.legends[0].get_texts()}
    assert {"angular distance", "Block Influence", "knee (Kneedle)", "prelude", "core", "coda", "dropped"} <= legend
