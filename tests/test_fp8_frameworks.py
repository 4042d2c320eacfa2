"""FP8 from every framework: Flax NNX (``Fp8Linear``, its state in an ``Fp8`` variable), Equinox
(``Fp8Linear``, an ``Fp8Meta`` field), Flax Linen (leanstep's ``Fp8DotGeneral`` as a
``dot_general_cls``, and Flax's own ``fp8_ops``), trained through the adapters as their users
write them: the FP8 state of M microbatches is the one-microbatch step's, bit for bit; it moves;
the optimizer never holds it; the trained model carries it back."""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops

import leanstep
from helpers.fp8_models import batch, fp8_of
from leanstep.frameworks import equinox as leqx
from leanstep.frameworks import linen as llinen
from leanstep.frameworks import nnx as lnnx

RECIPE = leanstep.Fp8Recipe(history=4)
TX = optax.adam(1e-2)
PRECISION = "params=float32,compute=bfloat16,output=float32"


class NnxNet(nnx.Module):
    def __init__(self, recipe, rngs):
        self.hidden = lnnx.Fp8Linear(16, 32, recipe=recipe, rngs=rngs)
        self.head = lnnx.Fp8Linear(32, 4, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x)))


class EqxNet(eqx.Module):
    hidden: leqx.Fp8Linear
    head: leqx.Fp8Linear

    def __init__(self, recipe, key):
        k1, k2 = jax.random.split(key)
        self.hidden = leqx.Fp8Linear(16, 32, recipe=recipe, key=k1)
        self.head = leqx.Fp8Linear(32, 4, recipe=recipe, key=k2)

    def __call__(self, x):  # on the whole batch: an FP8 scale is per tensor
        return self.head(jnp.tanh(self.hidden(x)))


class LinenNet(nn.Module):
    recipe: leanstep.Fp8Recipe

    @nn.compact
    def __call__(self, x):
        op = functools.partial(llinen.Fp8DotGeneral, recipe=self.recipe)
        hidden = jnp.tanh(nn.Dense(32, dot_general_cls=op)(x))  # Dense_0
        return nn.Dense(4, dot_general_cls=op)(hidden)


class BridgedNet(nnx.Module):
    """An NNX model around a Linen MLP written with Flax's own fp8_ops (nnx.bridge.ToNNX)."""

    def __init__(self, rngs):
        op = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=4)
        self.hidden = nnx.bridge.ToNNX(nn.Dense(32, dot_general_cls=op), rngs=rngs)
        self.head = nnx.bridge.ToNNX(nn.Dense(4, dot_general_cls=op), rngs=rngs)
        nnx.bridge.lazy_init(self.hidden, jnp.ones((1, 16)))
        nnx.bridge.lazy_init(self.head, jnp.ones((1, 32)))

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x)))


def mse(out, b):
    return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)


def setups(recipe):
    """framework -> (loss_fn, params, model_state or None, back: (params, model_state) -> the model's FP8 metas)."""
    graphdef, params, model_state = lnnx.split(NnxNet(recipe, nnx.Rngs(0)))
    nnx_loss = lnnx.loss(graphdef, lambda model, b: mse(model(b["x"]), b))
    nnx_back = lambda p, s: nnx.merge(graphdef, p, s).hidden.fp8.get_value()
    eqx_params, static = leqx.split(EqxNet(recipe, jax.random.key(0)))
    eqx_loss = leqx.loss(static, lambda model, b: mse(model(b["x"]), b))
    eqx_back = lambda p, s: leqx.combine(p, static).hidden.fp8
    linen_params, _ = llinen.split(LinenNet(recipe).init(jax.random.key(0), jnp.ones((1, 16))))
    linen_loss = lambda p, b: mse(llinen.apply(LinenNet(recipe), p, {}, b["x"])[0], b)
    linen_back = lambda p, s: llinen.merge(p, {})["_overwrite_with_gradient"]["Dense_0"]["Fp8DotGeneral_0"]["meta"]
    out = {
        "nnx": (nnx_loss, params, model_state, nnx_back),
        "equinox": (eqx_loss, eqx_params, None, eqx_back),
        "linen": (linen_loss, linen_params, None, linen_back),
    }
    if recipe.delayed:  # Flax's fp8_ops: delayed scaling, history 4
        graphdef_b, params_b, state_b = lnnx.split(BridgedNet(nnx.Rngs(0)))
        bridged_loss = lnnx.loss(graphdef_b, lambda model, b: mse(model(b["x"]), b))
        out["nnx-bridge"] = (bridged_loss, params_b, state_b, None)
    return out


def train(loss, params, model_state, num_mb, steps=2):
    has_state = model_state is not None
    state = leanstep.TrainState.create(params, TX, loss_scale="dynamic", model_state=model_state)
    step = leanstep.make_train_step(
        loss, precision=PRECISION, num_microbatches=num_mb, max_grad_norm=1.0, has_state=has_state
    )
    for seed in range(steps):
        state, metrics = step(state, batch(seed))
        assert not bool(metrics.skipped)
    return state


@pytest.fixture(scope="module")
def trained():
    out = {}
    for name, (loss, params, model_state, back) in setups(RECIPE).items():
        out[name] = {m: train(loss, params, model_state, m) for m in (1, 4)}, back
    return out


@pytest.mark.parametrize("framework", ["nnx", "equinox", "linen", "nnx-bridge"])
def test_four_microbatches_give_the_one_microbatch_fp8_state_bit_for_bit(trained, framework):
    states, _ = trained[framework]
    one, four = fp8_of(states[1].params), fp8_of(states[4].params)
    assert len(one) == 12 and all(np.any(x != 0) for x in one)  # moved
    for a, b in zip(one, four, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("framework", ["nnx", "equinox", "linen"])
def test_the_fp8_state_moved_stays_out_of_the_optimizer_and_comes_back_with_the_model(trained, framework):
    states, back = trained[framework]
    state = states[1]
    assert back is not None
    trainable = len(jax.tree.leaves(state.params)) - len(fp8_of(state.params))
    assert len(jax.tree.leaves(state.opt_state[0].mu)) == trainable  # Adam's moments: no FP8 state
    meta = back(state.params, state.model_state)
    assert isinstance(meta, leanstep.blocks.Fp8Meta)
    x_amax = float(np.max(np.abs(np.asarray(jnp.asarray(batch(1)["x"], jnp.bfloat16), np.float32))))
    assert float(meta.input_history[0]) == x_amax  # the second step's batch, the newest entry
    assert float(meta.input_scale[0]) != 1.0  # the second step's scale, from the first one's amax


def test_an_equinox_fp8_linear_vmapped_over_the_examples_is_refused_naming_the_fix():
    """Equinox's habit, a layer called per example under jax.vmap: each example would record its own amax."""
    params, static = leqx.split(EqxNet(RECIPE, jax.random.key(0)))
    per_example = leqx.loss(static, lambda model, b: mse(jax.vmap(model)(b["x"]), b))
    state = leanstep.TrainState.create(params, TX, loss_scale="dynamic")
    step = leanstep.make_train_step(per_example, precision=PRECISION)
    with pytest.raises(ValueError, match=r"runs under a jax.vmap that batches its operands but not its meta") as info:
        step(state, batch(0))
    assert "Call the layer on the whole batch" in str(info.value).splitlines()[0]  # one line, with the fix


@pytest.mark.parametrize("framework", ["nnx", "equinox", "linen"])
def test_current_scaling_keeps_no_state_and_trains(framework):
    loss, params, model_state, _ = setups(leanstep.Fp8Recipe("current"))[framework]
    assert not fp8_of(params)
    state = train(loss, params, model_state, 2, steps=3)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params))
