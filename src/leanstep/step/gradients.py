r"""The gradient stage: from float32 masters and a batch to the scaled, accumulated gradient.

.. code-block:: text

    p_c = cast(params, compute_dtype)                 # once; masters stay float32
    microbatches = split(cast(batch), M)              # contiguous, strided or presplit
    for j, m_j in enumerate(microbatches):            # one lax.scan (none for M = 1)
        (l_j, s), g_j = value_and_grad(S * loss_fn)(p_c, [s,] m_j[, fold_in(key, j)])
        G += float32(g_j)                             # float32 accumulator
    G /= M            (mean)    or    G /= sum_j n_j  (token-weighted: loss_fn gives (s_j, n_j))

It returns :class:`Gradients`: the whole batch's loss (unscaled), the gradient of the
*scaled* loss (unscaling, the finiteness check and clipping are the guarded update's job,
:func:`leanstep.guarded_update`), the aux outputs stacked over microbatches (in the policy's
output dtype) and, with ``has_state``, the model state ``s`` after the last microbatch (its
own dtypes: never cast to the compute dtype, never differentiated).

On the first trace the loss is traced once more, on abstract values (nothing runs): a
``"save:NAME"`` remat policy naming a tag the loss never sets is refused, and, with a compute
dtype below float32, a :class:`leanstep.PrecisionWarning` says so when none of its matmuls runs
in that dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp

from leanstep.blocks.accumulation import microbatched_value_and_grad
from leanstep.blocks.compute_dtype_check import PrecisionWarning, unused_compute_dtype
from leanstep.blocks.loss_scale import LossScale, NoOpLossScale
from leanstep.blocks.microbatches import Splitter, check_num_microbatches, get_splitter
from leanstep.blocks.precision import Precision, check_train_precision
from leanstep.blocks.rematerialization import check_saved_names
from leanstep.common.checks import check_bool, check_callable, check_scalar_output

__all__ = ["Gradients", "gradient_stage"]


class Gradients(NamedTuple):
    """What the gradient stage computes.

    Attributes:
      loss: float32 scalar, the unscaled loss of the whole batch (the mean of the
        microbatch losses, or the total ``loss_sum / count`` when token-weighted).
      grads: float32 tree shaped like the params: the accumulated gradient of the
        **scaled** loss, ``S * dL/dparams``.
      aux: the loss's aux output stacked over microbatches (``has_aux``), or None.
      model_state: the model state after the last microbatch (``has_state``), or None.
      token_count: float32 scalar, the total ``count`` the loss and gradient are divided by
        (``token_weighted``), or None. (Not ``count``: that would hide the tuple's ``count`` method.)
    """

    loss: jax.Array
    grads: Any
    aux: Any = None
    model_state: Any = None
    token_count: jax.Array | None = None


def _check_loss(value: Any, name: str) -> jax.Array:
    """``loss_fn``'s ``name`` output as float32, checked at trace time (shape and dtype are static)."""
    return check_scalar_output(
        f"loss_fn's {name}", value, reduce="jnp.sum" if name == "loss_sum" else "jnp.mean"
    ).astype(jnp.float32)


def _check_count(value: Any) -> jax.Array:
    """``loss_fn``'s token count as float32: a real scalar, the number of terms ``loss_sum`` adds up."""
    return check_scalar_output(
        "token_weighted=True: loss_fn's count", value, integer=True, reduce="jnp.sum(mask)"
    ).astype(jnp.float32)


def _unpack(out: Any, *, has_aux: bool, token_weighted: bool) -> tuple[Any, Any]:
    """``(value, aux)`` of one loss_fn output, after checking its structure."""
    expected = "(loss_sum, count)" if token_weighted else "loss"
    if has_aux:
        expected = f"({expected}, aux)"
    pair = isinstance(out, tuple) and len(out) == 2
    value, aux = out if has_aux and pair else (out, None)
    if (has_aux and not pair) or (token_weighted and not (isinstance(value, tuple) and len(value) == 2)):
        flags = " and ".join(
            f"{flag}=True" for flag, on in (("has_aux", has_aux), ("token_weighted", token_weighted)) if on
        )
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
    has_state: bool = False,
    unroll: int | bool = 1,
    params_layout: Callable[[Any, Callable[[Any], None]], Any] | None = None,
) -> Callable[..., Gradients]:
    r"""Builds ``gradients(params, batch, loss_scale=None, key=None, model_state=None) -> Gradients``.

    See the module doc for the computation. ``loss_scale`` (a :class:`LossScale`; None: no
    scaling) multiplies each microbatch loss in float32 before differentiation; ``key`` (a
    typed PRNG key, with ``uses_rng``) becomes ``fold_in(key, j)`` for microbatch ``j``,
    handed to ``loss_fn`` as its third argument (the index reaches the body through the
    scan, never through the batch).

    Args:
      loss_fn: ``loss_fn(params, microbatch[, key])`` returning a scalar ``loss``, or
        ``(loss_sum, count)`` with ``token_weighted``; with ``has_aux``, that paired with
        an ``aux`` output: ``(loss, aux)`` or ``((loss_sum, count), aux)``. With
        ``has_state`` it is ``loss_fn(params, model_state, microbatch[, key])`` and returns
        ``(that, new_model_state)``. It receives the params (and, with ``cast_batch``, the
        batch's floating leaves) in the compute dtype.
      precision: a :class:`Precision` or its string form, its params dtype float32; with
        ``strict`` the loss runs under :func:`strict_precision`.
      num_microbatches: static number of equal microbatches.
      split: ``"contiguous"``, ``"strided"``, ``"presplit"`` or a callable
        ``splitter(batch, num_microbatches)`` (see :mod:`leanstep.blocks.microbatches`).
      has_aux: ``loss_fn`` also returns aux; it comes back stacked over microbatches.
      token_weighted: ``loss_fn`` returns ``(loss_sum, count)``; the loss and gradient are
        the whole batch's ``sum / count``. With ``has_aux`` the stacked aux is
        ``(loss_sum, count, aux)`` per microbatch.
      uses_rng: pass a per-microbatch PRNG key to ``loss_fn``.
      cast_batch: cast the batch's floating leaves to the compute dtype (integer leaves
        such as token ids stay): a float32 input would otherwise promote a bf16 matmul
        back to float32.
      has_state: thread a model state (batch statistics, counters) through the
        microbatches in order; ``model_state=`` then holds its value before the step.
      unroll: forwarded to the microbatch ``lax.scan`` (see
        :func:`leanstep.microbatched_value_and_grad`: faster convolutions on CPU, more memory).
      params_layout: ``params_layout(params_c, probe)`` lays out the compute-dtype params
        before the loss sees them (the sharding layer, :class:`leanstep.ShardingLayer`);
        ``probe(params_c)`` traces the loss once on abstract values. None: nothing.

    Returns:
      The gradient function, traceable under ``jax.jit``.

    Raises:
      TypeError, ValueError: a bad argument, named (now), a ``precision`` whose params dtype is
        not float32 among them (the gradient is of float32 masters:
        :func:`leanstep.blocks.precision.check_train_precision`); at trace time, a loss output (or a
        token count) of the wrong structure, dtype or shape, a batch the splitter refuses, or a
        ``"save:NAME"`` remat policy in the loss naming a tag the loss never sets.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.blocks.loss_scale import StaticLossScale
      >>> def loss_fn(w, batch):
      ...     return jnp.mean((batch["x"] * w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.array([1.0, 2.0, 3.0, 4.0]), "y": jnp.array([2.0, 4.0, 6.0, 9.0])}
      >>> gradients = gradient_stage(loss_fn, num_microbatches=2)
      >>> gradients(jnp.float32(2.0), batch, StaticLossScale.create(8.0))
      Gradients(loss=Array(0.25, dtype=float32), grads=Array(-16., dtype=float32), aux=None, model_state=None, token_count=None)
    """
    check_callable("loss_fn", loss_fn)
    policy = check_train_precision(precision)
    num_microbatches = check_num_microbatches(num_microbatches)
    splitter = get_splitter(split)
    has_aux, token_weighted, uses_rng, cast_batch, has_state = (
        check_bool(name, value)
        for name, value in (
            ("has_aux", has_aux),
            ("token_weighted", token_weighted),
            ("uses_rng", uses_rng),
            ("cast_batch", cast_batch),
            ("has_state", has_state),
        )
    )
    if params_layout is not None:
        check_callable("params_layout", params_layout)
    model_loss = policy.wrap(loss_fn)
    checked: list[bool] = []  # the compute-dtype check runs on the first trace only

    def gradients(
        params: Any,
        batch: Any,
        loss_scale: LossScale | None = None,
        key: jax.Array | None = None,
        model_state: Any = None,
    ) -> Gradients:
        scale = NoOpLossScale() if loss_scale is None else loss_scale
        if uses_rng and key is None:
            raise ValueError("uses_rng=True: pass the step's PRNG key as key=")
        if has_state and model_state is None:
            raise ValueError("has_state=True: pass the model state before the step as model_state=")

        def scaled_loss(params_c: Any, *args: Any) -> tuple[Any, Any]:
            *state, microbatch, index = args if uses_rng else (*args, None)
            extra = (jax.random.fold_in(key, index),) if uses_rng and key is not None else ()  # key: checked above
            out = model_loss(params_c, *state, microbatch, *extra)
            if has_state:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError(
                        f"has_state=True: loss_fn must return (out, new_model_state), got {type(out).__name__}"
                    )
                out, new_state = out
            value, aux = _unpack(out, has_aux=has_aux, token_weighted=token_weighted)
            aux = policy.cast_to_output(aux)
            result: tuple[Any, Any]
            if token_weighted:
                loss_sum, count = value
                loss_sum, count = _check_loss(loss_sum, "loss_sum"), _check_count(count)
                result = (scale.scale(loss_sum), count), (loss_sum, count, aux)
            else:
                loss = _check_loss(value, "loss")
                result = scale.scale(loss), (loss, aux)
            return (result, new_state) if has_state else result

        accumulate = microbatched_value_and_grad(
            scaled_loss,
            num_microbatches,
            has_aux=True,
            token_weighted=token_weighted,
            split=splitter,
            with_index=uses_rng,
            has_state=has_state,
            unroll=unroll,
            scan_single=False,
        )
        data = policy.cast_to_compute(batch) if cast_batch else batch
        params_c = policy.cast_to_compute(params)
        state_in = model_state if has_state else None
        if params_layout is not None:

            def probe(p: Any) -> None:  # the loss on abstract values, for the layer to see what it gathers
                jax.eval_shape(
                    model_loss, *_abstract_loss_args(p, state_in, data, splitter, num_microbatches, uses_rng)
                )

            params_c = params_layout(params_c, probe)
        (value, scaled_grads) = accumulate(params_c, data, model_state) if has_state else accumulate(params_c, data)
        if not checked:  # after the outputs' own checks; marked only once passed, so a caught error comes again
            _check_traced_loss(
                model_loss, params_c, state_in, data, splitter, num_microbatches, uses_rng, policy.compute_dtype
            )
            checked.append(True)
        (_, per_microbatch), new_state = value if has_state else (value, None)
        count = None
        if token_weighted:
            loss_sums, counts, aux = per_microbatch
            count = jnp.sum(counts)
            loss = jnp.sum(loss_sums) / count
            aux = (loss_sums, counts, aux) if has_aux else None
        else:
            losses, aux = per_microbatch
            loss = jnp.mean(losses)
        # Gradients w.r.t. the compute-dtype copy come back float32 (the accumulator's dtype).
        return Gradients(loss=loss, grads=scaled_grads, aux=aux, model_state=new_state, token_count=count)

    return gradients


def _abstract_loss_args(
    params_c: Any, model_state: Any, batch: Any, splitter: Splitter, num_microbatches: int, uses_rng: bool
) -> tuple[Any, ...]:
    """The loss's arguments for one microbatch, as ``jax.ShapeDtypeStruct`` s."""
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)
    microbatches = jax.eval_shape(lambda b: splitter(b, num_microbatches), batch)
    microbatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatches)
    args = (abstract(params_c), *(() if model_state is None else (abstract(model_state),)), microbatch)
    if uses_rng:
        args += (jax.eval_shape(lambda: jax.random.key(0)),)
    return args


def _check_traced_loss(
    loss_fn: Callable[..., Any],
    params_c: Any,
    model_state: Any,
    batch: Any,
    splitter: Splitter,
    num_microbatches: int,
    uses_rng: bool,
    compute_dtype: Any,
) -> None:
    """The loss, traced once on abstract values (nothing runs), checked for what a setting would not do.

    A ``"save:NAME"`` remat policy naming a tag the loss never sets is a ValueError
    (:func:`leanstep.blocks.rematerialization.check_saved_names`); a low compute dtype that no matmul
    runs in is one :class:`PrecisionWarning`.
    """
    args = _abstract_loss_args(params_c, model_state, batch, splitter, num_microbatches, uses_rng)
    # Only the program matters here, not the outputs (whose structure the real trace checks).
    jaxpr = jax.make_jaxpr(lambda *a: [x for x in jax.tree.leaves(loss_fn(*a)) if isinstance(x, jax.Array)])(*args)
    check_saved_names(jaxpr)
    if jnp.dtype(compute_dtype).itemsize >= 4:
        return
    # The traced program, not the loss again: re-tracing a jaxpr does not run the model's Python.
    message = unused_compute_dtype(jax.extend.core.jaxpr_as_fun(jaxpr), tuple(jax.tree.leaves(args)), compute_dtype)
    if message is not None:
        warnings.warn(message, PrecisionWarning, stacklevel=4)
