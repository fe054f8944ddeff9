"""Layer selection: the paper's rule, explicit indices, ShortGPT, bad specs, meta-device parents."""

import pytest
from conftest import tiny_parent

import recurfit
from recurfit.surgery.selection import LayerSelection


def test_paper_rule_reproduces_the_papers_layer_choices():
    assert LayerSelection.paper_rule((4, 8, 4), 22).as_dict() == {
        "prelude": [0, 1, 2, 3],
        "core": list(range(10, 18)),
        "coda": [18, 19, 20, 21],
    }
    assert LayerSelection.paper_rule((2, 4, 2), 22).as_dict() == {
        "prelude": [0, 1],
        "core": [16, 17, 18, 19],
        "coda": [20, 21],
    }
    assert LayerSelection.paper_rule((6, 10, 6), 22).kept == list(range(22))
    assert LayerSelection.paper_rule((4, 6, 4), 16).as_dict() == {
        "prelude": [0, 1, 2, 3],
        "core": list(range(6, 12)),
        "coda": [12, 13, 14, 15],
    }
    assert LayerSelection.paper_rule((4, 8, 4), 22).dropped(22) == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prelude=[0, 1], core=[1, 2], coda=[5]), "Layer 1 is in both prelude and core"),
        (dict(prelude=[0], core=[2, 3], coda=[9]), r"out of range: the parent has 6 layers"),
        (dict(prelude=[0], core=[3, 2], coda=[5]), "strictly increasing"),
        (dict(prelude=[0], core=[], coda=[5]), "core is empty"),
        (dict(shape=(3, 3, 3)), "needs 9 layers but the parent has only 6"),
        (dict(shape=(1, 0, 1)), "core of at least 1 layer"),
        (dict(shape=(-1, 2, 1)), "non-negative"),
        (dict(shape=(1, 2)), "three integers"),
        (dict(shape=(1, 2, 1), core=[2, 3]), "not both"),
        (dict(), "Give shape"),
        (dict(shape=(1, 2, 1), select="random"), "select must be one of"),
        (dict(shape=(1, 2, 1), adapter="mlp"), "adapter must be one of"),
        (dict(shape=(1, 2, 1), adapter_init="zeros"), "adapter_init must be one of"),
        (dict(shape=(1, 2, 1), state_init_std=-1.0), "state_init_std must be >= 0"),
        (dict(shape=(1, 2, 1), select="shortgpt"), "calibration token ids"),
    ],
)
def test_bad_specs_raise_a_value_error_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        recurfit.retrofit(tiny_parent("llama"), **kwargs)
