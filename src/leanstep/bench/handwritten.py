"""The train step a careful user writes by hand: the baseline leanstep's step must match.

Everything :func:`leanstep.make_train_step` does with its building blocks is written inline
here with plain JAX and optax, and nothing from leanstep is imported: the bf16 cast of the
float32 masters, the loss multiplied by a dynamic loss scale, one ``lax.scan`` over
microbatches with ``value_and_grad`` in its body and a float32 accumulator, one unscale,
one finiteness check, a global-norm clip, the update applied only when finite (``jnp.where``)
and the scale grown or backed off. The benchmark times the two side by side and compares
their compiled memory; the tests check they take the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike, DTypeLike

__all__ = ["HandwrittenState", "init_handwritten_state", "make_handwritten_step"]


class HandwrittenState(NamedTuple):
    """What the hand-written step carries: float32 masters, optimizer state and loss scale.

    Attributes:
      params: float32 master parameters.
      opt_state: the optax optimizer's state.
      loss_scale: float32 scalar loss scale (1.0 and never adjusted without a dynamic scale).
      good_steps: int32 count of finite steps since the scale last changed.
    """

    params: Any
    opt_state: Any
    loss_scale: jax.Array
    good_steps: jax.Array


def init_handwritten_state(
    params: Any, optimizer: optax.GradientTransformation, *, loss_scale: ArrayLike = 2.0**15
) -> HandwrittenState:
    """Builds the step-0 state with one fresh buffer per leaf (the step donates it).

    Example:
      >>> state = init_handwritten_state({"w": jnp.ones(2)}, optax.sgd(0.1), loss_scale=8.0)
      >>> float(state.loss_scale), int(state.good_steps)
      (8.0, 0)
    """
    params = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
    state = HandwrittenState(params, optimizer.init(params), jnp.float32(loss_scale), jnp.int32(0))
    return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), state)


def make_handwritten_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    *,
    compute_dtype: DTypeLike = jnp.bfloat16,
    num_microbatches: int = 1,
    max_grad_norm: float = 1.0,
    dynamic_loss_scale: bool = True,
    growth_interval: int = 2000,
    max_loss_scale: float = 2.0**24,
    min_loss_scale: float = 1.0,
) -> jax.stages.Wrapped:
    """Builds the jitted, state-donating ``step(state, batch) -> (state, {"loss", "grad_norm"})``.

    The math, the same as :func:`leanstep.make_train_step` with a dynamic loss scale
    (growth factor 2, backoff 0.5, hysteresis 1)::

        p_c = bf16(params); batch = bf16(floating leaves of batch)
        S = loss_scale; M = num_microbatches
        G = sum_j float32(grad(S * loss_fn)(p_c, microbatch_j))      # lax.scan
        G = G / (M * S); finite = all(isfinite(G))
        G = G * min(1, c / |G|)
        params, opt = finite ? optimizer(G) : (params, opt)
        S = finite ? (2S if growth_interval finite steps in a row) : S / 2

    Args:
      loss_fn: ``loss_fn(params_in_compute_dtype, microbatch) -> scalar`` (a mean over rows).
      optimizer: an optax optimizer.
      compute_dtype: the dtype the loss is computed in.
      num_microbatches: equal microbatches per batch (must divide the batch size).
      max_grad_norm: global-norm clipping threshold ``c``.
      dynamic_loss_scale: adjust the scale; without it the state's scale is used unchanged.
      growth_interval, max_loss_scale, min_loss_scale: the dynamic scale's settings.

    Returns:
      The jitted step; it donates its state argument.

    Example:
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> step = make_handwritten_step(loss_fn, opt, num_microbatches=2)
      >>> state = init_handwritten_state({"w": jnp.zeros((2, 1))}, opt)
      >>> state, metrics = step(state, {"x": jnp.ones((4, 2)), "y": jnp.ones((4, 1))})
      >>> float(metrics["loss"]), round(float(metrics["grad_norm"]), 4)
      (1.0, 2.8284)
    """

    def scaled_loss(params_c: Any, microbatch: Any, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss = loss_fn(params_c, microbatch).astype(jnp.float32)
        return loss * scale, loss

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def step(state: HandwrittenState, batch: Any) -> tuple[HandwrittenState, dict[str, jax.Array]]:
        params_c = jax.tree.map(lambda p: p.astype(compute_dtype), state.params)
        # Floating inputs go to the compute dtype too, or a float32 input would promote every
        # bf16 matmul back to float32; integer token ids stay as they are.
        batch = jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, batch)
        microbatches = jax.tree.map(
            lambda x: x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:]), batch
        )

        def body(carry: tuple[jax.Array, Any], microbatch: Any) -> tuple[tuple[jax.Array, Any], None]:
            loss_total, grads_total = carry
            (_, loss), grads = grad_fn(params_c, microbatch, state.loss_scale)
            grads_total = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_total, grads)
            return (loss_total + loss, grads_total), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        (loss_total, grads), _ = jax.lax.scan(body, (jnp.float32(0), zeros), microbatches)
        grads = jax.tree.map(lambda g: g / num_microbatches / state.loss_scale, grads)

        leaves = jax.tree.leaves(grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))
        grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in leaves))
        factor = jnp.minimum(1.0, max_grad_norm / grad_norm)
        grads = jax.tree.map(lambda g: g * factor, grads)

        updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        scale, good = state.loss_scale, state.good_steps
        if dynamic_loss_scale:
            good = jnp.where(finite, good + 1, 0)
            grow = good >= growth_interval
            scale = jnp.where(
                finite,
                jnp.where(grow, jnp.minimum(scale * 2.0, max_loss_scale), scale),
                jnp.maximum(scale * 0.5, min_loss_scale),
            )
            good = jnp.where(grow, 0, good)
        new_state = HandwrittenState(keep(new_params, state.params), keep(new_opt_state, state.opt_state), scale, good)
        return new_state, {"loss": loss_total / num_microbatches, "grad_norm": grad_norm}

    return jax.jit(step, donate_argnums=(0,))
