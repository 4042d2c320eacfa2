"""What the int8 composition tests share: the tiny transformer with int8 block matmuls, its
batches, an optimizer that keeps the gradient it is handed (so a test reads the step's gradient
as the optimizer saw it, after unscaling and clipping), and the measure of two trees' difference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from leanstep.blocks.int8 import Int8Recipe
from leanstep.models import build_model

BF16 = "compute=bfloat16"
ROWS = 8  # 2 rows a microbatch at M=4, 2 a device at data=4 or fsdp=4


def model(weight_grad: str | None = "compute"):
    """The tiny transformer (2 layers, width 16, 16 tokens) with int8 block matmuls (None: without)."""
    return build_model("transformer", "tiny", int8=None if weight_grad is None else Int8Recipe(weight_grad))


def params():
    """The tiny transformer's float32 parameters (the same for every recipe: int8 adds none)."""
    return model(None).init(jax.random.key(0))


def batch(seed: int = 0, rows: int = ROWS) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 256, size=(rows, 17)).astype(np.int32)}


def keep_gradient() -> optax.GradientTransformation:
    """Passes the updates on and keeps them as its state: ``opt_state[0]`` is the last gradient."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda updates, state, params=None: (updates, updates)
    )


#: Plain SGD after the kept gradient: params after a step are ``p - 0.1 g``.
TX = optax.chain(keep_gradient(), optax.sgd(0.1))


def gradient(state):
    """The gradient the optimizer was last handed (the state of :func:`keep_gradient`)."""
    return state.opt_state[0]


def largest_difference(a, b) -> float:
    """``max |a - b| / max |a|`` over the entries of each leaf, the largest over the leaves (float64)."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / np.max(np.abs(x))))
    return out


def bit_equal(a, b) -> bool:
    """Same leaves, dtypes and bytes."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in pairs
    )
