"""Behaviour of the recurrent forward: depth semantics, truncated backprop, checkpointing, save and load."""

import pytest
from conftest import tiny_parent

import recurfit


@pytest.mark.parametrize("shape", [(1, 0, 1), (-1, 2, 1)])
def test_every_entry_point_refuses_a_bad_shape_by_the_one_rule(shape):
    """The shape rule (`model.shape.shape_problem`) is written once; the config, retrofit and a train config
    all report its words."""
    from recurfit.model.config import RecurrentConfig
    from recurfit.model.shape import shape_problem
    from recurfit.surgery.retrofit import retrofit
    from recurfit.train import load_config

    rule = shape_problem(shape)
    assert rule and "core of at least 1 layer and non-negative prelude and coda" in rule
    with pytest.raises(ValueError, match="core of at least 1 layer"):
        RecurrentConfig(num_prelude_layers=shape[0], num_core_layers=shape[1], num_coda_layers=shape[2])
    with pytest.raises(ValueError, match="core of at least 1 layer"):
        retrofit(tiny_parent("llama"), shape=shape)
    with pytest.raises(recurfit.errors.RecurfitError, match=r"model\.shape .* core of at least 1 layer"):
        load_config(None, [], base={"out": "x", "model": {"path": "p", "shape": list(shape)}, "data": {}})
