"""LayerStack.stack as a path (leanstep.blocks.layer_stack): the stacked layers found under a key, a
path of keys (a Linen model's whole variables: params["params"]["blocks"]), an attribute or an index;
``top`` the same tree with the stack's leaves None; the update inside the backward pass on each form
against the standard step; a tree that breaks the contract refused in one line naming it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from leanstep import LayerStack, StepSpec, TrainState, make_train_step
from leanstep.blocks.layer_stack import CONTRACT


class Params(NamedTuple):
    w_in: jax.Array
    layers: dict
    w_out: jax.Array


def _weights():
    k = jax.random.split(jax.random.key(0), 3)
    blocks = {"w": jax.random.normal(k[1], (4, 8, 8)) * 0.3, "b": jnp.zeros((4, 8))}
    return jax.random.normal(k[0], (3, 8)) * 0.5, blocks, jax.random.normal(k[2], (8, 2))


def _layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"][None, :])


def _batch(seed=1):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"x": jax.random.normal(k[0], (8, 3)), "y": jax.random.normal(k[1], (8, 2))}


def _forms():
    """``{name: (stack, params)}``: one model, its stack at a key, a path of keys, an attribute, an index."""
    w_in, blocks, w_out = _weights()
    head = lambda w_out: lambda top, x, b: jnp.mean((x @ w_out(top) - b["y"]) ** 2)
    return {
        "key": (
            LayerStack(lambda top, b: b["x"] @ top["w_in"], _layer, head(lambda top: top["w_out"])),
            {"w_in": w_in, "blocks": blocks, "w_out": w_out},
        ),
        "path_of_keys": (
            LayerStack(
                lambda top, b: b["x"] @ top["params"]["w_in"], _layer, head(lambda top: top["params"]["w_out"]),
                ("params", "blocks"),
            ),
            {"params": {"w_in": w_in, "blocks": blocks, "w_out": w_out}},
        ),
        "attribute": (
            LayerStack(lambda top, b: b["x"] @ top.w_in, _layer, head(lambda top: top.w_out), "layers"),
            Params(w_in, blocks, w_out),
        ),
        "index": (
            LayerStack(lambda top, b: b["x"] @ top[0], _layer, head(lambda top: top[2]), (1,)),
            (w_in, blocks, w_out),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("form", ["key", "path_of_keys", "attribute", "index"])
def test_each_form_finds_the_stack_and_trains_as_the_standard_step(form):
    stack, params = _forms()[form]
    reference, _ = _forms()["key"]
    w_in, blocks, w_out = _weights()
    assert float(stack(params, _batch())) == float(
        reference({"w_in": w_in, "blocks": blocks, "w_out": w_out}, _batch())
    )
    top, stacked = stack.split(params)
    assert jax.tree.structure(stacked) == jax.tree.structure(blocks)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(blocks)))
    same_tree = jax.tree.map(lambda _: 0, top, is_leaf=lambda leaf: leaf is None)  # a None where a stacked leaf was
    assert jax.tree.structure(same_tree) == jax.tree.structure(params)
    assert [leaf.shape for leaf in jax.tree.leaves(top)] == [(3, 8), (8, 2)]  # the stack's leaves None
    assert stack.stacked_leaves(params) == [leaf.ndim == 3 or leaf.shape == (4, 8) for leaf in jax.tree.leaves(params)]
    spec = StepSpec.from_keywords(num_microbatches=2, max_grad_norm=0.5, loss_scale="dynamic")
    make = lambda: TrainState.create(params, optax.adamw(1e-2, weight_decay=0.1), spec)
    standard, layerwise = make(), make()
    for t in range(3):
        standard, a = make_train_step(stack, spec)(standard, _batch(1 + t))
        layerwise, b = make_train_step(stack, spec.replace(update_in_backward=True))(layerwise, _batch(1 + t))
        assert bool(a.clipped) and bool(b.clipped)
    for x, y in zip(jax.tree.leaves(standard), jax.tree.leaves(layerwise), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.max(np.abs(x - y), initial=0) <= 1e-6 * max(np.max(np.abs(x), initial=0), 1e-30)
    assert type(layerwise.params) is type(params)


def _message(call, error=TypeError) -> str:
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.endswith(CONTRACT), message
    return message


def test_a_tree_that_breaks_the_contract_is_refused_in_one_line_naming_it():
    stack, _ = _forms()["path_of_keys"]
    assert "params at ('params',) is a dict with keys ['w_in', 'w_out']" in _message(
        lambda: stack.split({"params": {"w_in": 1.0, "w_out": 2.0}})
    )
    listed = {"params": {"blocks": [{"w": jnp.ones((8, 8))}] * 4}}
    assert "is a list of 4 layers, not one stacked layer" in _message(lambda: stack.split(listed))
    ragged = {"params": {"blocks": {"w": jnp.ones((4, 8)), "b": jnp.ones((3,))}}}
    assert "the leaves' leading axes differ ([3, 4])" in _message(lambda: stack.split(ragged), ValueError)
    scalar = {"params": {"blocks": {"w": jnp.ones((4, 8)), "s": jnp.ones(())}}}
    assert "every leaf needs a leading axis" in _message(lambda: stack.split(scalar))
    index, _ = _forms()["index"]
    assert "params is a dict" in _message(lambda: index.split({"w_in": 1.0}))


@pytest.mark.parametrize("stack", ["", (), ("params", ""), ("params", True), ["params", "blocks"], 3])
def test_a_stack_that_is_not_a_path_is_refused(stack):
    with pytest.raises(TypeError, match="LayerStack.stack must be where the stacked layers are in params"):
        LayerStack(lambda t, b: b, _layer, lambda t, x, b: x, stack)
