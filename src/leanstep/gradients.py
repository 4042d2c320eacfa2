r"""The gradient stage: from float32 masters and a batch to the scaled, accumulated gradient.

.. code-block:: text

    p_c = cast(params, compute_dtype)                 # once; masters stay float32
    microbatches = split(cast(batch), M)              # contiguous, strided or presplit
    for j, m_j in enumerate(microbatches):            # one lax.scan, value_and_grad inside
        l_j, g_j = value_and_grad(S * loss_fn)(p_c, m_j[, fold_in(key, j)])
        G += float32(g_j)                             # float32 accumulator
    G /= M            (mean)    or    G /= sum_j n_j  (token-weighted: loss_fn gives (s_j, n_j))

It returns :class:`Gradients`: the whole batch's loss (unscaled), the gradient of the
*scaled* loss (unscaling, the finiteness check and clipping are the guarded update's job,
:func:`leanstep.guarded_update`) and the aux outputs stacked over microbatches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from leanstep._checks import check_bool, check_callable
from leanstep.accumulation import microbatched_value_and_grad
from leanstep.loss_scale import LossScale, NoOpLossScale
from leanstep.microbatches import Splitter, check_num_microbatches, get_splitter
from leanstep.precision import Precision, get_precision

__all__ = ["Gradients", "gradient_stage"]


class Gradients(NamedTuple):
    """What the gradient stage computes.

    Attributes:
      loss: float32 scalar, the unscaled loss of the whole batch (the mean of the
        microbatch losses, or the total ``loss_sum / count`` when token-weighted).
      grads: float32 tree shaped like the params: the accumulated gradient of the
        **scaled** loss, ``S * dL/dparams``.
      aux: the loss's aux output stacked over microbatches (``has_aux``), or None.
    """

    loss: jax.Array
    grads: Any
    aux: Any = None


def _check_loss(value: Any, name: str) -> jax.Array:
    """``loss_fn``'s ``name`` output as float32, checked at trace time (shape and dtype are static)."""
    if not hasattr(value, "dtype") and not isinstance(value, float):
        raise TypeError(f"loss_fn's {name} must be a real floating scalar, got {type(value).__name__}")
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"loss_fn's {name} must be a real floating scalar, got dtype {value.dtype}")
    if value.shape != ():
        raise ValueError(f"loss_fn's {name} must be a scalar, got shape {value.shape}; reduce it (e.g. jnp.mean)")
    return value.astype(jnp.float32)


def _unpack(out: Any, *, has_aux: bool, token_weighted: bool) -> tuple[Any, Any]:
    """``(value, aux)`` of one loss_fn output, after checking its structure."""
    expected = "(loss_sum, count)" if token_weighted else "loss"
    if has_aux:
        expected = f"({expected}, aux)"
    pair = isinstance(out, tuple) and len(out) == 2
    value, aux = out if has_aux and pair else (out, None)
    if (has_aux and not pair) or (token_weighted and not (isinstance(value, tuple) and len(value) == 2)):
        flags = " and ".join(f"{flag}=True" for flag, on in (("has_aux", has_aux), ("token_weighted", token_weighted))
                             if on)
        raise TypeError(f"{flags}: loss_fn must return {expected}, got {type(out).__name__}")
    return value, aux


def gradient_stage(
    loss_fn: Callable[..., Any],
    *,
    precision: str | Precision = "float32",
    num_microbatches: int = 1,
    split: str | Splitter = "contiguous",
    has_aux: bool = False,
    token_weighted: bool = False,
    uses_rng: bool = False,
    cast_batch: bool = True,
    params_layout: Callable[[Any], Any] | None = None,
) -> Callable[..., Gradients]:
    r"""Builds ``gradients(params, batch, loss_scale=None, key=None) -> Gradients``.

    See the module doc for the computation. ``loss_scale`` (a :class:`LossScale`; None: no
    scaling) multiplies each microbatch loss in float32 before differentiation; ``key`` (a
    typed PRNG key, with ``uses_rng``) becomes ``fold_in(key, j)`` for microbatch ``j``,
    handed to ``loss_fn`` as its third argument (the index reaches the body through the
    scan, never through the batch).

    Args:
      loss_fn: ``loss_fn(params, microbatch[, key])`` returning a scalar ``loss``, or
        ``(loss_sum, count)`` with ``token_weighted``; with ``has_aux``, that paired with
        an ``aux`` output: ``(loss, aux)`` or ``((loss_sum, count), aux)``. It receives
        the params (and, with ``cast_batch``, the batch's floating leaves) in the compute
        dtype.
      precision: a :class:`Precision` or its string form; with ``strict`` the loss runs
        under :func:`strict_precision`.
      num_microbatches: static number of equal microbatches.
      split: ``"contiguous"``, ``"strided"``, ``"presplit"`` or a callable
        ``splitter(batch, num_microbatches)`` (see :mod:`leanstep.microbatches`).
      has_aux: ``loss_fn`` also returns aux; it comes back stacked over microbatches.
      token_weighted: ``loss_fn`` returns ``(loss_sum, count)``; the loss and gradient are
        the whole batch's ``sum / count``. With ``has_aux`` the stacked aux is
        ``(loss_sum, count, aux)`` per microbatch.
      uses_rng: pass a per-microbatch PRNG key to ``loss_fn``.
      cast_batch: cast the batch's floating leaves to the compute dtype (integer leaves
        such as token ids stay): a float32 input would otherwise promote a bf16 matmul
        back to float32.
      params_layout: applied to the compute-dtype params before the loss sees them (the
        sharding layer's constraint, :class:`leanstep.ShardingLayer`); None: nothing.

    Returns:
      The gradient function, traceable under ``jax.jit``.

    Raises:
      TypeError, ValueError: a bad argument, named (now); a loss output of the wrong
        structure, dtype or shape, or a batch the splitter refuses (at trace time).

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.loss_scale import StaticLossScale
      >>> def loss_fn(w, batch):
      ...     return jnp.mean((batch["x"] * w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.array([1.0, 2.0, 3.0, 4.0]), "y": jnp.array([2.0, 4.0, 6.0, 9.0])}
      >>> gradients = gradient_stage(loss_fn, num_microbatches=2)
      >>> gradients(jnp.float32(2.0), batch, StaticLossScale.create(8.0))
      Gradients(loss=Array(0.25, dtype=float32), grads=Array(-16., dtype=float32), aux=None)
    """
    check_callable("loss_fn", loss_fn)
    policy = get_precision(precision)
    num_microbatches = check_num_microbatches(num_microbatches)
    splitter = get_splitter(split)
    has_aux, token_weighted, uses_rng, cast_batch = (
        check_bool(name, value) for name, value in (("has_aux", has_aux), ("token_weighted", token_weighted),
                                                    ("uses_rng", uses_rng), ("cast_batch", cast_batch)))
    if params_layout is not None:
        check_callable("params_layout", params_layout)
    model_loss = policy.wrap(loss_fn)

    def gradients(params: Any, batch: Any, loss_scale: LossScale | None = None,
                  key: jax.Array | None = None) -> Gradients:
        scale = NoOpLossScale() if loss_scale is None else loss_scale
        if uses_rng and key is None:
            raise ValueError("uses_rng=True: pass the step's PRNG key as key=")

        def scaled_loss(params_c: Any, microbatch: Any, *index: jax.Array) -> tuple[Any, Any]:
            extra = (jax.random.fold_in(key, index[0]),) if uses_rng else ()
            value, aux = _unpack(model_loss(params_c, microbatch, *extra),
                                 has_aux=has_aux, token_weighted=token_weighted)
            if token_weighted:
                loss_sum, count = value
                loss_sum = _check_loss(loss_sum, "loss_sum")
                return (scale.scale(loss_sum), count), (loss_sum, jnp.asarray(count, jnp.float32), aux)
            loss = _check_loss(value, "loss")
            return scale.scale(loss), (loss, aux)

        accumulate = microbatched_value_and_grad(scaled_loss, num_microbatches, has_aux=True,
                                                 token_weighted=token_weighted, split=splitter, with_index=uses_rng)
        data = policy.cast_to_compute(batch) if cast_batch else batch
        params_c = policy.cast_to_compute(params)
        if params_layout is not None:
            params_c = params_layout(params_c)
        (_, per_microbatch), scaled_grads = accumulate(params_c, data)
        if token_weighted:
            loss_sums, counts, aux = per_microbatch
            loss = jnp.sum(loss_sums) / jnp.sum(counts)
            aux = (loss_sums, counts, aux) if has_aux else None
        else:
            losses, aux = per_microbatch
            loss = jnp.mean(losses)
        # Gradients w.r.t. the compute-dtype copy come back float32 (the accumulator's dtype).
        return Gradients(loss=loss, grads=scaled_grads, aux=aux)

    return gradients
