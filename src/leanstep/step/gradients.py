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
:func:`leanstep.step.guarded_update`), the aux outputs stacked over microbatches (in the policy's
output dtype) and, with ``has_state``, the model state ``s`` after the last microbatch (its
own dtypes: never cast to the compute dtype, never differentiated).

FP8 state in the params (:mod:`leanstep.blocks.fp8_state`) stays float32, and its "gradients"
(new values) are combined by max over the microbatches. With it, a mean loss is differentiated
as its share of the whole batch's loss: microbatch ``j`` of ``M``, on one of ``D`` devices that
reduce once per step, takes the gradient of ``S * l_j / (M * D)``, and the sum needs no division.
Every cotangent inside the model is then the one-microbatch, one-device step's (exactly, for
``M * D`` a power of two), and so is the amax of the output gradient each FP8 matmul records.

Each time the stage is traced (a jitted step: once for its inputs' shapes), the loss is traced once
more, on abstract values (nothing runs): a ``"save:NAME"`` remat policy naming a tag the loss never
sets is refused, and, with a compute dtype below float32, a :class:`leanstep.blocks.PrecisionWarning`
says so when none of its matmuls runs in that dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp

from leanstep.blocks.accumulation import Accumulation, accumulate
from leanstep.blocks.compute_dtype_check import PrecisionWarning, unused_compute_dtype
from leanstep.blocks.fp8_dot import fp8_uses
from leanstep.blocks.fp8_state import has_fp8
from leanstep.blocks.loss_contract import LossContract, LossOutput, loss_contract_of
from leanstep.blocks.loss_scale import LossScale, NoOpLossScale
from leanstep.blocks.precision import Precision, check_train_precision
from leanstep.blocks.rematerialization import check_saved_names
from leanstep.common.checks import check_bool, check_callable, is_int
from leanstep.common.removed import refuses_removed_keywords

__all__ = ["Gradients", "gradient_stage"]

#: What lays out the compute-dtype params before the loss sees them: ``layout(params_c, probe)``.
ParamsLayout = Callable[[Any, Callable[[Any], None]], Any]


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


@refuses_removed_keywords("gradient_stage")
def gradient_stage(
    loss_fn: Callable[..., Any],
    *,
    precision: str | Precision = "float32",
    accumulation: Accumulation | int = 1,
    loss: LossContract | None = None,
    cast_batch: bool = True,
) -> Callable[..., Gradients]:
    r"""Builds ``gradients(params, batch, loss_scale=None, key=None, model_state=None, *,
    params_layout=None, data_shards=1) -> Gradients``.

    See the module doc for the computation. ``loss_scale`` (a :class:`LossScale`; None: no
    scaling) multiplies each microbatch loss in float32 before differentiation; ``key`` (a
    typed PRNG key, with ``uses_rng``) becomes ``fold_in(key, j)`` for microbatch ``j``,
    handed to ``loss_fn`` as its third argument (the index reaches the body through the
    scan, never through the batch). Where the call runs on a mesh, its caller (the sharding
    layer, :class:`leanstep.step.ShardingLayer`) says so through the two keywords:
    ``params_layout(params_c, probe)`` lays out the compute-dtype params before the loss sees
    them (``probe(params_c)`` traces the loss once on abstract values); ``data_shards`` is how
    many devices split the batch and reduce once per step, of which this call computes one's
    share (a mean loss with FP8 state is seeded with ``1 / (M * D)``: the module doc).

    Args:
      loss_fn: ``loss_fn(params, microbatch)`` returning a scalar ``loss``, or whatever
        ``loss`` says it takes and returns (:class:`leanstep.LossContract`: aux, a token
        count, a PRNG key, a model state). It receives the params (and, with ``cast_batch``,
        the batch's floating leaves) in the compute dtype.
      precision: a :class:`Precision` or its string form, its params dtype float32; with
        ``strict`` the loss runs under :func:`strict_precision`.
      accumulation: an :class:`leanstep.Accumulation` (microbatches, split, unroll), or the
        number of contiguous microbatches.
      loss: what ``loss_fn`` takes and returns; None: ``LossContract()``, a scalar loss of
        ``(params, batch)``. Token-weighted with aux, the stacked aux is
        ``(loss_sum, count, aux)`` per microbatch.
      cast_batch: cast the batch's floating leaves to the compute dtype (integer leaves
        such as token ids stay): a float32 input would otherwise promote a bf16 matmul
        back to float32.

    Returns:
      The gradient function, traceable under ``jax.jit``.

    Raises:
      TypeError, ValueError: a bad argument, named (now), a keyword removed in 0.12
        (``num_microbatches=``, ``has_aux=``, ...: the TypeError names its new spelling), a
        ``precision`` whose params dtype is not float32 among them (the gradient is of float32 masters:
        :func:`leanstep.blocks.precision.check_train_precision`); at trace time, a ``params_layout``
        that is not callable or a ``data_shards`` that is not a positive int, a loss output (or a
        token count) of the wrong structure, dtype or shape, a batch the splitter refuses, or a
        ``"save:NAME"`` remat policy in the loss naming a tag the loss never sets.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.blocks.loss_scale import StaticLossScale
      >>> def loss_fn(w, batch):
      ...     return jnp.mean((batch["x"] * w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.array([1.0, 2.0, 3.0, 4.0]), "y": jnp.array([2.0, 4.0, 6.0, 9.0])}
      >>> gradients = gradient_stage(loss_fn, accumulation=2)
      >>> gradients(jnp.float32(2.0), batch, StaticLossScale.create(8.0))
      Gradients(loss=Array(0.25, dtype=float32), grads=Array(-16., dtype=float32), aux=None, model_state=None, token_count=None)
    """
    check_callable("loss_fn", loss_fn)
    policy = check_train_precision(precision)
    contract, accumulation = loss_contract_of(loss, {}), _accumulation_of(accumulation)
    contract.check_signature(loss_fn)
    cast_batch = check_bool("cast_batch", cast_batch)
    model_loss = _naming_settings(policy.wrap(loss_fn), contract)

    def gradients(
        params: Any,
        batch: Any,
        loss_scale: LossScale | None = None,
        key: jax.Array | None = None,
        model_state: Any = None,
        *,
        params_layout: ParamsLayout | None = None,
        data_shards: int = 1,
    ) -> Gradients:
        scale = NoOpLossScale() if loss_scale is None else loss_scale
        _check_call(contract, key, model_state, params_layout, data_shards)
        # With FP8 state a mean loss is seeded with its share of the batch (the module doc).
        seeded = has_fp8(params) and not contract.token_weighted
        share = accumulation.num_microbatches * data_shards if seeded else 1

        def scaled_loss(params_c: Any, state: Any, microbatch: Any, *index: jax.Array) -> tuple[jax.Array, LossOutput]:
            microbatch_key = jax.random.fold_in(key, index[0]) if key is not None and contract.uses_rng else None
            with fp8_uses():  # an Fp8Meta used by two matmuls is refused
                out = contract.parse(
                    model_loss(*contract.arguments(params_c, state, microbatch, microbatch_key)), state
                )
            # The unscaled loss (and count) ride along in aux, for the batch's loss below.
            kept = (out.value, out.token_count, policy.cast_to_output(out.aux))
            value = scale.scale(out.value)
            return (value if share == 1 else value * jnp.float32(1.0 / share)), out._replace(aux=kept)

        run = accumulate(
            scaled_loss,
            accumulation if share == 1 else accumulation.replace(divide=False),
            token_weighted=contract.token_weighted,
            with_index=contract.uses_rng,
            scan_single=False,
        )
        data = policy.cast_to_compute(batch) if cast_batch else batch
        params_c = policy.cast_to_compute(params)
        state_in = model_state if contract.has_state else None
        if params_layout is not None:

            def probe(p: Any) -> None:  # the loss on abstract values, for the layer to see what it gathers
                jax.eval_shape(model_loss, *_abstract_loss_args(p, state_in, data, accumulation, contract))

            params_c = params_layout(params_c, probe)
        (_, _, (values, counts, aux), new_state), scaled_grads = run(params_c, data, state_in)
        # after the outputs' own checks; once a trace (a jitted step traces once for its inputs' shapes)
        _check_traced_loss(model_loss, params_c, state_in, data, accumulation, contract, policy.compute_dtype)
        count = None
        # Without division (accumulation.divide=False) the loss is the sum the caller divides.
        if contract.token_weighted:
            count = jnp.sum(counts)
            loss = jnp.sum(values) / count if accumulation.divide else jnp.sum(values)
            aux = (values, counts, aux) if contract.has_aux else None
        else:
            loss = jnp.mean(values) if accumulation.divide else jnp.sum(values)
            aux = aux if contract.has_aux else None
        # Gradients w.r.t. the compute-dtype copy come back float32 (the accumulator's dtype).
        return Gradients(loss=loss, grads=scaled_grads, aux=aux, model_state=new_state, token_count=count)

    return gradients


def _check_call(contract: LossContract, key: Any, model_state: Any, params_layout: Any, data_shards: Any) -> None:
    """What one call of the gradient function must be given, named."""
    if contract.uses_rng and key is None:
        raise ValueError("uses_rng=True: pass the step's PRNG key as key=")
    if contract.has_state and model_state is None:
        raise ValueError("has_state=True: pass the model state before the step as model_state=")
    if params_layout is not None:
        check_callable("params_layout", params_layout)
    if not is_int(data_shards) or data_shards < 1:
        raise ValueError(f"data_shards must be a positive int (devices that split the batch), got {data_shards!r}")


def _naming_settings(loss_fn: Callable[..., Any], contract: LossContract) -> Callable[..., Any]:
    """``loss_fn``, whose errors a setting causes (no key for its Dropout, an unbound axis name) come
    out as one leanstep line naming it (:meth:`LossContract.call_error`); other errors pass unchanged."""

    def loss_naming_settings(*args: Any) -> Any:
        try:
            return loss_fn(*args)
        except Exception as error:
            named = contract.call_error(error)
            if named is None:
                raise
            raise named from None

    return loss_naming_settings


def _abstract_loss_args(
    params_c: Any, model_state: Any, batch: Any, accumulation: Accumulation, contract: LossContract
) -> tuple[Any, ...]:
    """The loss's arguments for one microbatch, as ``jax.ShapeDtypeStruct`` s."""
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)
    microbatches = jax.eval_shape(accumulation.split_batch, batch)
    microbatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatches)
    key = jax.eval_shape(lambda: jax.random.key(0)) if contract.uses_rng else None
    return contract.arguments(abstract(params_c), abstract(model_state), microbatch, key)


def _check_traced_loss(
    loss_fn: Callable[..., Any],
    params_c: Any,
    model_state: Any,
    batch: Any,
    accumulation: Accumulation,
    contract: LossContract,
    compute_dtype: Any,
) -> None:
    """The loss, traced once on abstract values (nothing runs), checked for what a setting would not do.

    A ``"save:NAME"`` remat policy naming a tag the loss never sets is a ValueError
    (:func:`leanstep.blocks.rematerialization.check_saved_names`); a low compute dtype that no matmul
    runs in is one :class:`PrecisionWarning`.
    """
    args = _abstract_loss_args(params_c, model_state, batch, accumulation, contract)
    # Only the program matters here, not the outputs (whose structure the real trace checks).
    jaxpr = jax.make_jaxpr(lambda *a: [x for x in jax.tree.leaves(loss_fn(*a)) if isinstance(x, jax.Array)])(*args)
    check_saved_names(jaxpr)
    if jnp.dtype(compute_dtype).itemsize >= 4:
        return
    # The traced program, not the loss again: re-tracing a jaxpr does not run the model's Python.
    message = unused_compute_dtype(jax.extend.core.jaxpr_as_fun(jaxpr), tuple(jax.tree.leaves(args)), compute_dtype)
    if message is not None:
        warnings.warn(message, PrecisionWarning, stacklevel=4)


def _accumulation_of(accumulation: Accumulation | int) -> Accumulation:
    """``accumulation``, or that many contiguous microbatches."""
    if isinstance(accumulation, Accumulation):
        return accumulation
    if isinstance(accumulation, bool) or not isinstance(accumulation, int):
        raise TypeError(
            f"accumulation must be a leanstep.Accumulation or a number of microbatches, got {accumulation!r}"
        )
    return Accumulation(accumulation)
