"""The demo's settings: the default shape chosen from the parent's layer count."""

import pytest

from recurfit.demo.settings import DemoSettings, demo_shape, recipe, with_shape
from recurfit.errors import RecurfitError


def test_the_embedded_parents_30_layers_keep_the_recipes_shape():
    assert demo_shape(30) == tuple(recipe()["model"]["shape"]) == (6, 12, 6)
    assert with_shape(DemoSettings()).shape == (6, 12, 6)  # the embedded SmolLM2-135M's config


@pytest.mark.parametrize(
    ("layers", "shape"), [(24, (4, 8, 4)), (22, (4, 8, 4)), (16, (3, 6, 3)), (6, (1, 2, 1)), (5, (1, 2, 1))]
)
def test_other_parents_get_a_fifth_of_their_layers_for_prelude_and_coda_and_twice_that_for_the_core(layers, shape):
    assert demo_shape(layers) == shape


@pytest.mark.parametrize("layers", range(5, 81))
def test_every_default_shape_drops_at_least_a_fifth_of_the_layers(layers):
    prelude, core, coda = demo_shape(layers)
    assert prelude == coda >= 1 and core == 2 * prelude
    assert 5 * (prelude + core + coda) <= 4 * layers  # Qwen2.5-0.5B's 24 layers are not all kept, as by (6, 12, 6)


def test_a_parent_too_shallow_for_the_default_is_told_to_pass_a_shape():
    with pytest.raises(RecurfitError, match="4 layers, too few .* pass --shape P,R,C"):
        demo_shape(4)


def test_a_given_shape_is_kept_and_none_is_chosen_from_the_parents_config(workspace):
    parent = str(workspace / "parent")  # 6 layers
    assert with_shape(DemoSettings(model=parent)).shape == (1, 2, 1)
    assert with_shape(DemoSettings(model=parent, shape=(2, 2, 2))).shape == (2, 2, 2)
