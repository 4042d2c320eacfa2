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
import numpy as np
from jax.typing import DTypeLike

__all__ = [
    "split_microbatches",
    "init_grad_accumulator",
    "microbatched_value_and_grad",
]

Tree = TypeVar("Tree")


def _check_num_microbatches(num_microbatches: Any) -> int:
    if isinstance(num_microbatches, (bool, np.bool_)) or not isinstance(
        num_microbatches, (int, np.integer)
    ):
        raise TypeError(
            "num_microbatches must be a static Python int >= 1, got "
            f"{num_microbatches!r} of type {type(num_microbatches).__name__}"
        )
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got num_microbatches={num_microbatches}")
    return int(num_microbatches)


def split_microbatches(batch: Tree, num_microbatches: int) -> Tree:
    r"""Reshape every leaf of ``batch`` from ``(B, ...)`` to ``(num_microbatches, S, ...)``.

    With :math:`S = B / \text{num\_microbatches}`, microbatch :math:`j` holds rows
    :math:`jS, \dots, (j+1)S - 1` of every leaf (a reshape: no copy, no reordering).

    Args:
      batch: a pytree whose leaves are arrays sharing a leading batch axis of size B >= 1.
      num_microbatches: a Python int >= 1 that divides B.

    Returns:
      ``batch`` with every leaf reshaped to ``(num_microbatches, S) + leaf.shape[1:]``.

    Raises:
      TypeError: ``num_microbatches`` is not an int.
      ValueError: ``num_microbatches < 1``; ``batch`` has no leaves; a leaf has no
        leading axis or a leading size different from the others (the message names the
        leaf path); B is 0 or not divisible by ``num_microbatches``.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.accumulation import split_microbatches
      >>> split = split_microbatches({"x": jnp.arange(6.0), "y": jnp.zeros((6, 2))}, 3)
      >>> split["x"], split["y"].shape
      (Array([[0., 1.],
             [2., 3.],
             [4., 5.]], dtype=float32), (3, 2, 2))
      >>> split_microbatches({"x": jnp.arange(6.0)}, 4)
      Traceback (most recent call last):
      ...
      ValueError: batch size 6 is not divisible by num_microbatches=4
    """
    num_microbatches = _check_num_microbatches(num_microbatches)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not leaves_with_paths:
        raise ValueError(
            "batch must have at least one array leaf with a leading batch axis, got "
            f"{batch!r}"
        )
    batch_size = None
    first_path = ""
    for path, leaf in leaves_with_paths:
        name = f"batch{jax.tree_util.keystr(path)}"
        shape = jnp.shape(leaf)
        if len(shape) == 0:
            raise ValueError(f"{name} is a scalar; every batch leaf needs a leading batch axis")
        if batch_size is None:
            batch_size, first_path = shape[0], name
        elif shape[0] != batch_size:
            raise ValueError(
                f"{name} has leading size {shape[0]} but {first_path} has {batch_size}; "
                "every batch leaf must share the leading batch axis"
            )
    if batch_size == 0:
        raise ValueError("batch size is 0; an empty batch has no loss or gradient")
    if batch_size % num_microbatches:
        raise ValueError(
            f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches}"
        )
    rows = batch_size // num_microbatches
    split = [
        jnp.reshape(leaf, (num_microbatches, rows) + tuple(jnp.shape(leaf)[1:]))
        for _, leaf in leaves_with_paths
    ]
    return jax.tree.unflatten(treedef, split)


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
      >>> from leanstep.accumulation import init_grad_accumulator
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
) -> Callable[[Any, Any], tuple[Any, Any]]:
    r"""Like ``jax.value_and_grad(loss_fn)``, with the batch processed in microbatches.

    The returned function ``(params, batch) -> (loss, grads)`` splits ``batch`` with
    :func:`split_microbatches` and runs **one** ``lax.scan`` of length
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

    Returns:
      A function ``(params, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with
      ``has_aux``), traceable under ``jax.jit``.

    Raises:
      TypeError: ``num_microbatches`` is not an int or ``accum_dtype`` not floating
        (now); the batch errors of :func:`split_microbatches` (at call or trace time).
      ValueError: ``num_microbatches < 1`` (now).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from leanstep.accumulation import microbatched_value_and_grad
      >>> def loss_fn(w, batch):
      ...     return jnp.mean((batch["x"] * w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.array([1.0, 2.0, 3.0, 4.0]), "y": jnp.array([2.0, 4.0, 6.0, 9.0])}
      >>> w = jnp.float32(2.0)
      >>> microbatched_value_and_grad(loss_fn, 2)(w, batch)
      (Array(0.25, dtype=float32), Array(-2., dtype=float32))
      >>> jax.value_and_grad(loss_fn)(w, batch)
      (Array(0.25, dtype=float32), Array(-2., dtype=float32))
    """
    num_microbatches = _check_num_microbatches(num_microbatches)
    dtype = _check_accum_dtype(accum_dtype)

    def objective(params: Any, microbatch: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        # value_and_grad differentiates the first output only; count and aux ride along.
        out = loss_fn(params, microbatch)
        value, aux = out if has_aux else (out, None)
        if token_weighted:
            loss_sum, count = value
        else:
            loss_sum, count = value, None
        return loss_sum, (count, aux)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def accumulate(params: Any, batch: Any) -> tuple[Any, Any]:
        microbatches = split_microbatches(batch, num_microbatches)
        zero = jnp.zeros((), jnp.float32)
        init = (zero, zero, init_grad_accumulator(params, dtype))

        def body(carry: tuple, microbatch: Any) -> tuple[tuple, Any]:
            loss_total, count_total, grads_total = carry
            (loss, (count, aux)), grads = grad_fn(params, microbatch)
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
