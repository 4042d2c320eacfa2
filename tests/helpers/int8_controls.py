"""Planted int8 bugs, verify's controls: each :func:`leanstep.blocks.int8.int8_matmul` with one thing wrong, put in
place of the transformer's by :func:`planted` (a test's patch: nothing in the library can switch one on).

.. code-block:: text

    scale_from_loss_scaled   the input gradient's g unscaled (g / S) before it is quantized, with the scale of
                             the loss-scaled g: 127 / S of a level at most, so it rounds to zeros and nothing
                             flows below the matmul (fails int8_agreement)
    per_microbatch_scale     the input gradient's g quantized with one scale over the microbatch's rows, not one
                             a token: a token's int8 values depend on the rows beside it, so M=4 is not M=1
                             (fails int8_microbatches)
    shard_scale_no_pmax      under an fsdp axis (a weight's rows split over it), each device quantizes its rows
                             of the weight with its own column scales (no pmax), all-gathers the int8 values and
                             dequantizes every row with its own scales (fails int8_meshes)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import leanstep.models.transformer as transformer_module
from leanstep.blocks import int8 as int8_module
from leanstep.blocks.int8 import Int8Recipe, int8_matmul, quantize_int8

#: The loss scale the controls run with (RunConfig's initial dynamic scale): the one the first bug divides by.
LOSS_SCALE = 2.0**15


def _op(backward_gradient: Callable[[jax.Array], tuple[jax.Array, jax.Array]]) -> Callable[..., jax.Array]:
    """``int8_matmul`` whose backward quantizes its gradient ``g`` with ``backward_gradient(g) -> (q, s)``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def dot(recipe: Int8Recipe, x: jax.Array, w: jax.Array) -> jax.Array:
        return int8_module._int8_dot_fwd(recipe, x, w)[0]

    def bwd(recipe: Int8Recipe, res: tuple[Any, ...], g: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, w = res
        qg, sg = backward_gradient(g)
        qw, sw = quantize_int8(w, axis=1)
        dx = (int8_module._int_dot(qg, qw, (1, 1)).astype(jnp.float32) * sg * sw.T).astype(x.dtype)
        dw = jax.lax.dot_general(x, g.astype(x.dtype), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dx, dw.astype(w.dtype)

    dot.defvjp(int8_module._int8_dot_fwd, bwd)

    def matmul(x: jax.Array, w: jax.Array, recipe: Int8Recipe | None = None) -> jax.Array:
        recipe = recipe or Int8Recipe()
        y = dot(recipe, x.reshape(-1, x.shape[-1]), w.astype(x.dtype))
        return y.reshape(*x.shape[:-1], w.shape[1])

    return matmul


def _from_loss_scaled(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The bug: ``g`` unscaled before it is quantized, its scale the loss-scaled ``g``'s (S times too large)."""
    g32 = g.astype(jnp.float32)
    _, scale = quantize_int8(g32, axis=1)  # the loss-scaled gradient's scale
    q = jnp.round(jnp.clip(g32 / LOSS_SCALE / scale, -127.0, 127.0)).astype(jnp.int8)
    return q, scale * LOSS_SCALE  # back in the loss-scaled units: only the rounding went wrong


def _per_microbatch(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The bug: one scale over the microbatch's rows (all of them), not one a token's."""
    g32 = g.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(g32)), 1e-30)
    q = jnp.round(jnp.clip(g32 * (127.0 / amax), -127.0, 127.0)).astype(jnp.int8)
    return q, jnp.full((g.shape[0], 1), amax / 127.0)


scale_from_loss_scaled = _op(_from_loss_scaled)
per_microbatch_scale = _op(_per_microbatch)


def shard_scale_no_pmax(x: jax.Array, w: jax.Array, recipe: Int8Recipe | None = None) -> jax.Array:
    """The bug: under an fsdp axis, the weight's per-column scale from this device's rows only (no ``pmax``),
    the gathered int8 column dequantized with it; straight through, as the op's gradient is."""
    from leanstep.sharding.model_sharding import _CONTEXT

    context = _CONTEXT.get()
    fsdp = None if context is None else context.axes.axis_of("fsdp")
    if fsdp is None or fsdp in context.manual:
        return int8_matmul(x, w, recipe)

    def gather(local: jax.Array) -> jax.Array:
        q, scale = quantize_int8(local, axis=0)  # this device's rows of each column: its own amax, no pmax
        whole = jax.lax.all_gather(q, fsdp, axis=0, tiled=True)
        return (whole.astype(jnp.float32) * scale).astype(local.dtype)

    seen = jax.shard_map(
        gather,
        mesh=context.axes.mesh,
        axis_names={fsdp},
        in_specs=PartitionSpec(fsdp, None),
        out_specs=PartitionSpec(),
        check_vma=False,
    )(w)
    return int8_matmul(x, w + jax.lax.stop_gradient(seen - w), recipe)


#: Each control by name: its planted op.
CONTROLS: dict[str, Callable[..., jax.Array]] = {
    "scale_from_loss_scaled": scale_from_loss_scaled,
    "per_microbatch_scale": per_microbatch_scale,
    "shard_scale_no_pmax": shard_scale_no_pmax,
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """The transformer's int8 matmuls run the planted op ``name`` while in the block (traced in it)."""
    with mock.patch.object(transformer_module, "int8_matmul", CONTROLS[name]):
        yield
