"""The passes of a :class:`leanstep.blocks.layer_stack.LayerStack` loss, a layer at a time, for the
update inside the backward pass (:mod:`leanstep.step.layerwise`).

The passes here walk the microbatches layer-major: the forward pass runs every microbatch
through layer ``l`` before layer ``l + 1`` and keeps each layer's inputs (what full remat keeps);
the backward pass recomputes one layer at a time, for every microbatch, and sums its gradient
over them in float32, so the gradient accumulator is one layer's, never the model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from leanstep.blocks.layer_stack import LayerStack
from leanstep.blocks.loss_contract import LossContract
from leanstep.blocks.loss_scale import LossScale

__all__ = ["StackForward", "layer_gradient", "stack_forward", "top_gradient"]


class StackForward(NamedTuple):
    """The forward pass and the head's backward, for every microbatch (leading axis ``M``).

    Attributes:
      inputs: each layer's input, ``(L, M, ...)``.
      head_cotangent: the cotangent of the last layer's output, ``(M, ...)``.
      head_grads: the head's gradient of the top params, summed over microbatches in float32 (scaled).
      values: the microbatches' losses (or loss sums), float32 ``(M,)``.
      counts: their token counts (token-weighted), or None.
    """

    inputs: Any
    head_cotangent: Any
    head_grads: Any
    values: jax.Array
    counts: jax.Array | None


def _float32_zeros(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def _added(total: Any, grads: Any) -> Any:
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), total, grads)


def stack_forward(
    stack: LayerStack,
    top_c: Any,
    stacked: Any,
    microbatches: Any,
    cast: Callable[[Any], Any],
    contract: LossContract,
    loss_scale: LossScale,
) -> StackForward:
    """Every microbatch through the stack, layer-major, then the head's loss and its backward.

    ``top_c`` is in the compute dtype; ``stacked`` as kept, each layer cast by ``cast`` as it is
    reached. The head is differentiated through ``loss_scale.scale(loss)``, as the standard step's
    loss is."""
    x = jax.lax.map(lambda microbatch: stack.embed(top_c, microbatch), microbatches)

    def forward(x: Any, layer: Any) -> tuple[Any, Any]:
        layer_c = cast(layer)
        return jax.lax.map(lambda x_m: stack.layer(layer_c, x_m), x), x

    x, inputs = jax.lax.scan(forward, x, stacked)

    def head(total: Any, inputs_m: Any) -> tuple[Any, Any]:
        x_m, microbatch = inputs_m

        def scaled(top: Any, x_m: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
            out = contract.parse(stack.head(top, x_m, microbatch))
            count = jnp.zeros((), jnp.float32) if out.token_count is None else out.token_count
            return loss_scale.scale(out.value), (out.value, count)

        _, pullback, (value, count) = jax.vjp(scaled, top_c, x_m, has_aux=True)
        d_top, d_x = pullback(jnp.ones((), jnp.float32))
        return _added(total, d_top), (value, count, d_x)

    head_grads, (values, counts, cotangent) = jax.lax.scan(head, _float32_zeros(top_c), (x, microbatches))
    return StackForward(inputs, cotangent, head_grads, values, counts if contract.token_weighted else None)


def layer_gradient(stack: LayerStack, layer_c: Any, inputs: Any, cotangent: Any) -> tuple[Any, Any]:
    """One layer's backward for every microbatch: ``(gradient, cotangent)``, the gradient of
    ``layer_c`` summed over the microbatches in float32 (in their order, from zeros, as the standard
    step accumulates), and the cotangent of the layer's inputs, ``(M, ...)``."""

    def one(total: Any, inputs_m: Any) -> tuple[Any, Any]:
        x_m, d_out = inputs_m
        _, pullback = jax.vjp(stack.layer, layer_c, x_m)
        d_layer, d_x = pullback(d_out)
        return _added(total, d_layer), d_x

    return jax.lax.scan(one, _float32_zeros(layer_c), (inputs, cotangent))


def top_gradient(stack: LayerStack, top_c: Any, microbatches: Any, cotangent: Any) -> Any:
    """The embedding's gradient of the top params for the first layer's input ``cotangent``,
    summed over the microbatches in float32."""

    def one(total: Any, inputs_m: Any) -> tuple[Any, None]:
        microbatch, d_x = inputs_m
        _, pullback = jax.vjp(lambda top: stack.embed(top, microbatch), top_c)
        return _added(total, pullback(d_x)[0]), None

    total, _ = jax.lax.scan(one, _float32_zeros(top_c), (microbatches, cotangent))
    return total
