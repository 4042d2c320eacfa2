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

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from leanstep.blocks.fp8_state import combine_fp8, has_fp8
from leanstep.blocks.loss_contract import LossContract, LossOutput, check_aux
from leanstep.blocks.microbatches import Splitter, check_num_microbatches, get_splitter
from leanstep.common.checks import check_bool, is_int

__all__ = ["Accumulation", "accumulate", "init_grad_accumulator", "microbatched_value_and_grad"]

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


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How a batch is walked: in how many microbatches, split how, unrolled how far.

    Checked once, when made: the splitter is resolved here and nowhere else.

    Attributes:
      num_microbatches: a static Python int >= 1 dividing the batch size.
      split: ``"contiguous"``, ``"strided"``, ``"presplit"`` or a callable
        ``splitter(batch, num_microbatches)`` (see :mod:`leanstep.blocks.microbatches`).
      unroll: forwarded to ``lax.scan``: ``True`` unrolls every microbatch into straight code
        (faster convolutions on XLA:CPU, more memory: the microbatches' activations are
        scheduled together).
      divide: divide the summed loss and gradient by ``M`` (or by the total token count);
        ``False`` leaves the sums, for a caller that adds them up across devices first and
        divides by the global count (:class:`leanstep.step.ShardingLayer` does, token-weighted: a
        device whose rows hold no token then adds 0, not 0/0).

    Raises:
      TypeError: ``num_microbatches`` not an int, ``split`` not a splitter, ``unroll`` not a
        bool or an int >= 1, ``divide`` not a bool.
      ValueError: ``num_microbatches`` < 1, or an unknown ``split`` name.

    Example:
      >>> import jax.numpy as jnp
      >>> accumulation = Accumulation(2, split="strided")
      >>> accumulation.split_batch({"x": jnp.arange(4)})["x"]
      Array([[0, 2],
             [1, 3]], dtype=int32)
    """

    num_microbatches: int = 1
    split: str | Splitter = "contiguous"
    unroll: int | bool = 1
    divide: bool = True
    #: The resolved ``split`` (:func:`leanstep.blocks.get_splitter`), once.
    splitter: Splitter = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_microbatches", check_num_microbatches(self.num_microbatches))
        object.__setattr__(self, "splitter", get_splitter(self.split))
        object.__setattr__(self, "divide", check_bool("divide", self.divide))
        if not (isinstance(self.unroll, bool) or is_int(self.unroll) and self.unroll >= 1):
            raise TypeError(f"unroll must be a bool or an int >= 1, got {self.unroll!r}")

    def split_batch(self, batch: Any) -> Any:
        """``batch`` as ``num_microbatches`` microbatches: every leaf ``(M, S, ...)``."""
        return self.splitter(batch, self.num_microbatches)

    def replace(self, **changes: Any) -> Accumulation:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


def accumulate(
    objective: Callable[..., tuple[jax.Array, LossOutput]],
    accumulation: Accumulation,
    *,
    token_weighted: bool,
    with_index: bool = False,
    accum_dtype: DTypeLike = jnp.float32,
    scan_single: bool = True,
) -> Callable[..., tuple[tuple[jax.Array, jax.Array, Any, Any], Any]]:
    r"""The microbatch scan over an objective that has already read its loss's output.

    ``objective(params, state, microbatch[, index])`` returns ``(value, parsed)``: the value to
    differentiate and the :class:`LossOutput` riding along (its ``value`` is not used here). The
    result, ``(params, batch, state) -> ((loss, count, auxes, state), grads)``, sums ``value``
    and ``count`` in float32 and the gradients in ``accum_dtype`` and divides by ``M`` (or by the
    total count when token-weighted; not at all with ``accumulation.divide=False``); ``auxes``
    are stacked over microbatches.

    FP8 state in ``params`` (:mod:`leanstep.blocks.fp8_state`): its "gradients" are new values,
    combined by elementwise max over the microbatches and never divided.
    """
    dtype = _check_accum_dtype(accum_dtype)
    num_microbatches = accumulation.num_microbatches
    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def run(params: Any, batch: Any, state: Any = None) -> tuple[tuple[jax.Array, jax.Array, Any, Any], Any]:
        microbatches = accumulation.split_batch(batch)
        if with_index:  # the index rides along the scanned inputs, never inside the batch
            microbatches = (microbatches, jnp.arange(num_microbatches, dtype=jnp.int32))
        zero = jnp.zeros((), jnp.float32)
        init = (zero, zero, init_grad_accumulator(params, dtype), state)

        def body(carry: tuple, inputs: Any) -> tuple[tuple, Any]:
            loss_total, count_total, grads_total, state = carry
            (loss, out), grads = grad_fn(params, state, *(inputs if with_index else (inputs,)))
            check_aux(out.aux)  # stacked below: a string in it is named here, not by indexing it
            if token_weighted:
                count_total = count_total + out.token_count
            grads_total = combine_fp8(
                grads_total, grads, lambda a, g: a + g.astype(dtype), lambda a, g: jnp.maximum(a, g.astype(a.dtype))
            )
            return (loss_total + loss.astype(jnp.float32), count_total, grads_total, out.model_state), out.aux

        if num_microbatches == 1 and not scan_single:
            carry, aux = body(init, jax.tree.map(lambda leaf: leaf[0], microbatches))
            (loss_total, count_total, grads_total, state), auxes = carry, jax.tree.map(lambda a: a[None], aux)
        else:
            (loss_total, count_total, grads_total, state), auxes = jax.lax.scan(
                body, init, microbatches, length=num_microbatches, unroll=accumulation.unroll
            )
        if not accumulation.divide:
            return (loss_total, count_total, auxes, state), grads_total
        denominator = count_total if token_weighted else jnp.float32(num_microbatches)
        if has_fp8(grads_total):
            grads = combine_fp8(grads_total, grads_total, lambda g, _: g / denominator.astype(dtype), lambda g, _: g)
        else:
            grads = jax.tree.map(lambda g: g / denominator.astype(dtype), grads_total)
        return (loss_total / denominator, count_total, auxes, state), grads

    return run


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    accum_dtype: DTypeLike = jnp.float32,
    token_weighted: bool = False,
    split: str | Splitter = "contiguous",
    with_index: bool = False,
    has_state: bool = False,
    unroll: int | bool = 1,
    scan_single: bool = True,
) -> Callable[..., tuple[Any, Any]]:
    r"""Like ``jax.value_and_grad(loss_fn)``, with the batch processed in microbatches.

    The returned function ``(params, batch) -> (loss, grads)`` splits ``batch`` with
    ``split`` (see :mod:`leanstep.blocks.microbatches`; contiguous by default) and runs **one**
    ``lax.scan`` of length ``num_microbatches``; its body calls
    ``jax.value_and_grad(loss_fn)`` on one microbatch of S rows and adds the result into
    the carry (a Python loop never unrolls the microbatches, and nothing differentiates
    through the scan). ``num_microbatches=1`` runs the same scan, so the traced program
    has one shape, unless ``scan_single=False``.

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

    Model state (``has_state``): ``loss_fn(params, state, mb) -> (out, new_state)`` with
    ``out`` as above; the state (batch statistics, counters) is carried through the scan in
    order, microbatch ``j`` seeing the state microbatch ``j - 1`` left, and is not
    differentiated.

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
      has_state: ``loss_fn`` takes and returns a model state (see above); the result is
        then ``(params, batch, state) -> ((value, new_state), grads)``.
      unroll: forwarded to ``lax.scan``: ``True`` unrolls every microbatch into straight
        code. On XLA:CPU a loop makes convolutions several times slower, and unrolling
        removes that cost, but XLA then schedules the microbatches' activations together,
        which spends the memory accumulation saves (see docs/frameworks.md).
      scan_single: ``False``: one microbatch runs without a scan (``value_and_grad`` once).

    Returns:
      A function ``(params, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with
      ``has_aux``), traceable under ``jax.jit``.

    Raises:
      TypeError: ``num_microbatches`` is not an int, ``accum_dtype`` not floating or
        ``split`` not a splitter (now); the batch errors of the splitter, a new state of
        another structure, or a loss output of another structure or dtype (at call or trace
        time).
      ValueError: ``num_microbatches < 1`` or an unknown ``split`` name (now); a loss or token
        count that is not a scalar (at call or trace time).

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
    accumulation = Accumulation(num_microbatches, split, unroll)
    _check_accum_dtype(accum_dtype)
    contract = LossContract(has_aux=has_aux, token_weighted=token_weighted, has_state=has_state)
    with_index, scan_single = check_bool("with_index", with_index), check_bool("scan_single", scan_single)

    def objective(params: Any, state: Any, microbatch: Any, *index: jax.Array) -> tuple[jax.Array, LossOutput]:
        # value_and_grad differentiates the first output only; count, aux and the state ride along.
        out = contract.parse(loss_fn(*contract.arguments(params, state, microbatch), *index), state)
        return out.value, out

    run = accumulate(
        objective,
        accumulation,
        token_weighted=token_weighted,
        with_index=with_index,
        accum_dtype=accum_dtype,
        scan_single=scan_single,
    )

    def value_and_grad(params: Any, batch: Any, state: Any = None) -> tuple[Any, Any]:
        (loss, _, auxes, state), grads = run(params, batch, state)
        value = (loss, auxes) if has_aux else loss
        return ((value, state) if has_state else value), grads

    return value_and_grad
