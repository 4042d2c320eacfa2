"""Gradient accumulation over microbatches inside one traced step.

The batch is split into ``num_microbatches`` equal microbatches and walked by one
``lax.scan``; each scan step runs the forward and backward pass of one microbatch
(``jax.value_and_grad`` inside the body, so only one microbatch's activations are alive at
a time) and adds its gradient into a float32 accumulator. Unlike :func:`optax.microbatch`,
bfloat16 gradients are not summed in bfloat16 (there 4,096 additions of 1.001 give 256);
unlike :class:`optax.MultiSteps`, everything happens in one call. A token-weighted mode
divides by the total token count, not a mean of per-microbatch means.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from leanstep._checks import check_bool
from leanstep.microbatches import Splitter, check_num_microbatches, get_splitter

__all__ = ["init_grad_accumulator", "microbatched_value_and_grad"]

Tree = TypeVar("Tree")


def init_grad_accumulator(params: Tree, accum_dtype: DTypeLike = jnp.float32) -> Tree:
    """Return a zero tree shaped like ``params`` in ``accum_dtype``: the scan's gradient carry.

    Args:
      params: the pytree being differentiated.
      accum_dtype: the dtype to accumulate gradients in (float32 by default, whatever the
        dtype of ``params``).

    Returns:
      A pytree with the structure and shapes of ``params`` and zeros of ``accum_dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> init_grad_accumulator({"w": jnp.ones((2,), jnp.bfloat16)})
      {'w': Array([0., 0.], dtype=float32)}
    """
    dtype = _check_accum_dtype(accum_dtype)
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype), params)


def _check_accum_dtype(accum_dtype: DTypeLike) -> jnp.dtype:
    try:
        dtype = jnp.dtype(accum_dtype)
    except TypeError as error:
        raise TypeError(f"accum_dtype must be a floating dtype, got {accum_dtype!r}") from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"accum_dtype must be a floating dtype, got accum_dtype={dtype}")
    return dtype


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    accum_dtype: DTypeLike = jnp.float32,
    token_weighted: bool = False,
    split: str | Splitter = "contiguous",
    with_index: bool = False,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    r"""Like ``jax.value_and_grad(loss_fn)``, with the batch processed in microbatches.

    The returned function ``(params, batch) -> (loss, grads)`` splits ``batch`` with
    ``split`` (see :mod:`leanstep.microbatches`; contiguous by default) and runs **one** ``lax.scan`` of length
    ``num_microbatches``; its body calls ``jax.value_and_grad(loss_fn)`` on one
    microbatch of S rows and adds the result into the carry (a Python loop never unrolls
    the microbatches, and nothing differentiates through the scan).
    ``num_microbatches=1`` runs the same scan, so the traced program has one shape.

    Mean mode (default), ``loss_fn(params, mb) -> loss``:

    .. math::

        L = \frac1M \sum_{j=1}^{M} \ell_j, \qquad
        g = \frac1M \sum_{j=1}^{M} \nabla \ell_j

    which is the full-batch value and gradient when ``loss_fn`` is a mean over rows
    (the microbatches are equally sized).

    Token-weighted mode, ``loss_fn(params, mb) -> (loss_sum, count)``:

    .. math::

        L = \frac{\sum_j s_j}{\sum_j n_j}, \qquad
        g = \frac{\sum_j \nabla s_j}{\sum_j n_j}

    the full-batch sum over the full-batch count (e.g. valid tokens under a padding
    mask), not the mean of per-microbatch ratios :math:`s_j / n_j`. ``count`` is not
    differentiated. A total count of 0 gives NaN/inf, visibly.

    Precision: gradients are accumulated in ``accum_dtype`` whatever their own dtype
    (bfloat16 params give bfloat16 microbatch gradients, summed in float32), and the
    **returned grads are in** ``accum_dtype``; loss and counts accumulate in float32 and
    the returned loss is float32. Nothing assumes the loss is unscaled: a loss multiplied
    by a loss scale gives scaled grads (inf/NaN from an overflow propagate into the sum),
    which the caller unscales.

    Args:
      loss_fn: ``loss_fn(params, batch)``; returns ``loss`` (mean mode) or
        ``(loss_sum, count)`` (token-weighted); with ``has_aux`` those are wrapped as
        ``(that, aux)``.
      num_microbatches: a static Python int >= 1 dividing the batch size.
      has_aux: ``loss_fn`` also returns ``aux``. The result is then
        ``((loss, aux), grads)`` where every leaf of ``aux`` is stacked along a new
        leading axis of size ``num_microbatches`` (entry j from microbatch j).
      accum_dtype: floating dtype of the gradient accumulator and returned grads.
      token_weighted: ``loss_fn`` returns ``(loss_sum, count)``; see above.
      split: how the batch becomes microbatches: ``"contiguous"``, ``"strided"``,
        ``"presplit"`` (the batch is already ``(num_microbatches, S, ...)``) or a callable
        ``splitter(batch, num_microbatches)``. The loss and gradient of a row-wise mean
        loss do not depend on it; per-microbatch ``aux`` follows the split's rows.
      with_index: call ``loss_fn(params, microbatch, index)`` with the microbatch's int32
        index ``0 <= index < num_microbatches`` (for a per-microbatch PRNG key, say).

    Returns:
      A function ``(params, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with
      ``has_aux``), traceable under ``jax.jit``.

    Raises:
      TypeError: ``num_microbatches`` is not an int, ``accum_dtype`` not floating or
        ``split`` not a splitter (now); the batch errors of the splitter (at call or
        trace time).
      ValueError: ``num_microbatches < 1`` or an unknown ``split`` name (now).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss_fn(w, batch):
      ...     return jnp.mean((batch["x"] * w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.array([1.0, 2.0, 3.0, 4.0]), "y": jnp.array([2.0, 4.0, 6.0, 9.0])}
      >>> w = jnp.float32(2.0)
      >>> microbatched_value_and_grad(loss_fn, 2)(w, batch)
      (Array(0.25, dtype=float32), Array(-2., dtype=float32))
      >>> jax.value_and_grad(loss_fn)(w, batch)
      (Array(0.25, dtype=float32), Array(-2., dtype=float32))
    """
    num_microbatches = check_num_microbatches(num_microbatches)
    dtype = _check_accum_dtype(accum_dtype)
    splitter = get_splitter(split)
    with_index = check_bool("with_index", with_index)

    def objective(params: Any, microbatch: Any, *index: jax.Array) -> tuple[jax.Array, tuple[Any, Any]]:
        # value_and_grad differentiates the first output only; count and aux ride along.
        out = loss_fn(params, microbatch, *index)
        value, aux = out if has_aux else (out, None)
        if token_weighted:
            loss_sum, count = value
        else:
            loss_sum, count = value, None
        return loss_sum, (count, aux)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def accumulate(params: Any, batch: Any) -> tuple[Any, Any]:
        microbatches = splitter(batch, num_microbatches)
        if with_index:  # the index rides along the scanned inputs, never inside the batch
            microbatches = (microbatches, jnp.arange(num_microbatches, dtype=jnp.int32))
        zero = jnp.zeros((), jnp.float32)
        init = (zero, zero, init_grad_accumulator(params, dtype))

        def body(carry: tuple, inputs: Any) -> tuple[tuple, Any]:
            loss_total, count_total, grads_total = carry
            (loss, (count, aux)), grads = grad_fn(params, *(inputs if with_index else (inputs,)))
            if token_weighted:
                count_total = count_total + jnp.asarray(count).astype(jnp.float32)
            grads_total = jax.tree.map(lambda a, g: a + g.astype(dtype), grads_total, grads)
            return (loss_total + loss.astype(jnp.float32), count_total, grads_total), aux

        (loss_total, count_total, grads_total), auxes = jax.lax.scan(
            body, init, microbatches, length=num_microbatches
        )
        denominator = count_total if token_weighted else jnp.float32(num_microbatches)
        loss = loss_total / denominator
        grads = jax.tree.map(lambda g: g / denominator.astype(dtype), grads_total)
        return ((loss, auxes) if has_aux else loss), grads

    return accumulate
