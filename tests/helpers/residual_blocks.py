"""The residual block both remat test files use, its parameters and two ways to stack it."""

import jax
import jax.numpy as jnp
from jax import lax

from leanstep.blocks.rematerialization import REMAT_POLICIES, checkpoint_name

B, D, H, L = 5, 2, 3, 3  # distinct sizes so a residual's shape tells which value it is
ALL_POLICIES = (*REMAT_POLICIES, "save:h", "save:pre", "save:pre,h")


def block(p, x):
    """The seed-004 residual MLP block, out = x + tanh(x W1 + b1) W2 + b2, with tagged values."""
    pre = checkpoint_name(x @ p["w1"], "pre")
    h = checkpoint_name(jnp.tanh(pre + p["b1"][None, :]), "h")
    return x + h @ p["w2"] + p["b2"][None, :]


def make_params(seed, d=D, h=H, dtype=jnp.float32, layers=None):
    lead = () if layers is None else (layers,)
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "w1": jax.random.normal(k[0], (*lead, d, h), dtype),
        "b1": jax.random.normal(k[1], (*lead, h), dtype),
        "w2": jax.random.normal(k[2], (*lead, h, d), dtype),
        "b2": jax.random.normal(k[3], (*lead, d), dtype),
    }


PARAMS = make_params(0)
STACKED = make_params(1, layers=L)
X = jax.random.normal(jax.random.key(2), (B, D))
LAYERS = [jax.tree.map(lambda a, i=i: a[i], STACKED) for i in range(L)]


def loop_stack(layer):
    def stack(layers, x):
        for p in layers:
            x = layer(p, x)
        return x

    return stack


def scan_stack(layer):
    def stack(stacked, x):
        out, _ = lax.scan(lambda c, p: (layer(p, c), None), x, stacked)
        return out

    return stack
