"""A train state built from shapes alone (issue 41, item 18): ``jax.eval_shape`` of
``TrainState.create(..., loss_scale="dynamic")`` gives the concrete state's structure, shapes and
dtypes, so a model too large for host memory can be planned without materializing it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import leanstep
from leanstep.blocks.loss_scale_registry import get_loss_scale

PARAMS = {"w": jnp.ones((4, 300)), "b": jnp.zeros((300,))}


def _signature(tree):
    return jax.tree.structure(tree), [(tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(loss_scale="dynamic"),
        dict(loss_scale="none"),
        dict(loss_scale="dynamic", master="bfloat16-sr", moments="int8"),
        dict(loss_scale="dynamic", master="bfloat16-sr-kahan", moments="bfloat16"),
    ],
    ids=["dynamic", "none", "lean-int8", "kahan-bf16"],
)
def test_eval_shape_of_create_is_the_concrete_states_shape(kwargs):
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS)
    optimizer = optax.adamw(1e-3)  # static in the state's tree: the same object for both
    abstract = jax.eval_shape(lambda p: leanstep.TrainState.create(p, optimizer, **kwargs), shapes)
    concrete = leanstep.TrainState.create(PARAMS, optimizer, **kwargs)
    assert _signature(abstract) == _signature(concrete)


def test_a_concrete_initial_scale_out_of_range_is_still_refused_inside_eval_shape():
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS)
    with pytest.raises(ValueError, match=r"initial_scale must be in \[min_loss_scale=1.0"):
        jax.eval_shape(lambda p: get_loss_scale("dynamic", 0.5), shapes)
