"""Small FP8 models shared by the FP8 tests: a plain-JAX MLP with leanstep's ``Fp8Meta`` per matmul,
and a Flax Linen MLP written with Flax's own ``fp8_ops`` (its ``_overwrite_with_gradient``
collection), both trained through ``make_train_step`` as their users write them."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

import leanstep
from leanstep.frameworks import linen as llinen

RECIPE = leanstep.Fp8Recipe(history=8)
ROWS, D_IN, D_HIDDEN, D_OUT = 32, 16, 32, 4


def batch(seed: int = 0, rows: int = ROWS) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, D_IN)).astype(np.float32) * np.linspace(0.5, 3.0, rows, dtype=np.float32)[:, None]
    return {"x": x, "y": rng.normal(size=(rows, D_OUT)).astype(np.float32)}


def jax_params(recipe: leanstep.Fp8Recipe = RECIPE) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": np.asarray(jax.random.normal(k1, (D_IN, D_HIDDEN)) * 0.3),
        "w2": np.asarray(jax.random.normal(k2, (D_HIDDEN, D_OUT)) * 0.3),
        "fp8": {"l1": leanstep.blocks.Fp8Meta.create(recipe), "l2": leanstep.blocks.Fp8Meta.create(recipe)},
    }


def jax_loss(params, batch, recipe: leanstep.Fp8Recipe = RECIPE):
    h = jnp.tanh(leanstep.blocks.fp8_matmul(batch["x"], params["w1"], params["fp8"]["l1"], recipe))
    out = leanstep.blocks.fp8_matmul(h, params["w2"], params["fp8"]["l2"], recipe)
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


class FlaxNet(nn.Module):
    """A Linen MLP with Flax's ``Fp8DirectDotGeneralOp`` (history 8), unchanged Flax code."""

    @nn.compact
    def __call__(self, x):
        op = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=8)
        h = jnp.tanh(nn.Dense(D_HIDDEN, dot_general_cls=op)(x))
        return nn.Dense(D_OUT, dot_general_cls=op)(h)


def flax_variables() -> dict:
    return FlaxNet().init(jax.random.key(0), jnp.ones((1, D_IN)))


def flax_loss(params, batch):
    out, _ = llinen.apply(FlaxNet(), params, {}, batch["x"])
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def fp8_of(params) -> list[np.ndarray]:
    """The FP8 state's leaves (host copies), in tree order."""
    from leanstep.blocks.fp8_state import fp8_leaves

    return [np.asarray(leaf) for leaf in fp8_leaves(params)]
