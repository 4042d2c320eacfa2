r"""FP8 matmuls any model can call: :func:`fp8_dot_general`, :func:`fp8_matmul` and their state.

.. code-block:: text

    forward     x8 = q(x, e4m3, s_x)   w8 = q(w, e4m3, s_w)   y  = dot32(x8, w8) * s_x s_w
    backward    g8 = q(g, e5m2, s_g)   dx = dot32_T(g8, w8) * s_g s_w   dw = dot32_T(x8, g8) * s_x s_g

(:func:`leanstep.blocks.fp8.quantize`): the FP8 arrays go into the dot itself and into its two
transposes, which accumulate in float32, are scaled by the product of their operands' scales and
cast to the compute dtype. That is the form XLA's GPU compiler turns into one FP8 GEMM with its
scales: on an H200 (JAX 0.11.2) an 8192-cubed forward product ran at 1,068-1,094 TFLOP/s against
bf16's 780-796 (``python -m benchmarks.fp8_gemm_forms``); the whole step, transposes included,
is not yet timed on a GPU (docs/fp8.md). Flax's ``Fp8DotGeneralOp`` instead quantizes and
dequantizes around a dot in the compute dtype (leanstep 0.10 did too); on that H200 XLA strips
the pair, leaving a bf16 GEMM and no FP8 rounding at all. XLA:CPU computes the same products
exactly (the products of FP8 values are exact in float32). The quantization is straight-through:
``x`` and ``w`` receive the gradient of their quantized copies. The name scope
``leanstep_fp8_<scaling>_<forward>_<backward>`` marks the matmul and its transposes for
:func:`leanstep.inspection.audit` (:func:`fp8_scope`).

Delayed scaling (:class:`leanstep.blocks.fp8.Fp8Recipe`) keeps one :class:`Fp8Meta` per matmul,
in the params tree: scales ``s_x, s_w, s_g`` from the amax histories of earlier steps, and the
histories, whose newest entry is this step's ``max |x|``, ``max |w|``, ``max |g|``. Its
"gradient" is its new value (:mod:`leanstep.blocks.fp8_state`), which
:func:`leanstep.make_train_step` combines by max over microbatches and devices and writes once
per step. Current scaling needs no state (``meta=None``).

Give every matmul its own :class:`Fp8Meta`, made with the recipe it runs under (its histories'
length is the recipe's ``history``; under a recipe of another, it is refused naming both), used once per loss
(per layer of a scanned stack: stack the metas and scan over them with the weights), on the whole
batch. A meta used by two matmuls would receive the sum of two new values; the step refuses one
used twice by name, but cannot see one closed over by a loop body, which sums it once per
iteration. A matmul under a ``jax.vmap`` that batches its operands but not its meta (an Equinox
layer vmapped over the examples) would record each example's amax and hand the step their sum:
it is refused when traced, since an FP8 scale is per tensor; call the matmul on the batch.

Example:
  >>> import jax, jax.numpy as jnp
  >>> meta = Fp8Meta.create(Fp8Recipe(history=4))
  >>> x, w = jnp.full((2, 3), 1.1, jnp.bfloat16), jnp.full((3, 2), 0.3, jnp.bfloat16)
  >>> y, new = jax.value_and_grad(lambda m: fp8_matmul(x, w, m).astype(jnp.float32).sum())(meta)
  >>> new.input_history  # this step's amax, the newest entry; s_x was 1 (no amax seen yet)
  Array([1.1015625, 0.       , 0.       , 0.       ], dtype=float32)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax._src.interpreters.batching import BatchTracer  # no public API tells a value vmap batches
from jax.typing import ArrayLike

from leanstep.blocks.fp8 import Fp8Recipe, amax_of, new_scale, quantize, record_amax
from leanstep.blocks.fp8_state import Fp8State

__all__ = ["Fp8Meta", "Fp8Scope", "fp8_dot_general", "fp8_matmul", "fp8_scope", "fp8_uses"]

_META_FIELDS = ("input_scale", "input_history", "kernel_scale", "kernel_history", "grad_scale", "grad_history")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_META_FIELDS), meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Fp8Meta(Fp8State):
    """One matmul's FP8 state under delayed scaling: a dequantization scale and an amax history
    for the input, the kernel and the output gradient (float32; scales ``(..., 1)``, histories
    ``(..., history)``, a leading stack shape for scanned layers)."""

    input_scale: Any
    input_history: Any
    kernel_scale: Any
    kernel_history: Any
    grad_scale: Any
    grad_history: Any

    @classmethod
    def create(cls, recipe: Fp8Recipe | None = None, *, stack: int | Sequence[int] = ()) -> Fp8Meta:
        """Scales of 1 and empty histories (zeros), as Flax and Transformer Engine start.

        Args:
          recipe: its ``history`` sets the histories' length (default :class:`Fp8Recipe`).
          stack: a leading shape, one meta per layer of a stacked, scanned model.

        Example:
          >>> meta = Fp8Meta.create(Fp8Recipe(history=16), stack=4)
          >>> meta.input_scale.shape, meta.grad_history.shape
          ((4, 1), (4, 16))
        """
        recipe = Fp8Recipe() if recipe is None else recipe
        if not isinstance(recipe, Fp8Recipe):
            raise TypeError(f"recipe must be an Fp8Recipe, got {type(recipe).__name__}")
        lead = (stack,) if isinstance(stack, int) else tuple(stack)
        ones, zeros = jnp.ones((*lead, 1), jnp.float32), jnp.zeros((*lead, recipe.history), jnp.float32)
        return cls(ones, zeros, ones, zeros, ones, zeros)


# --- the FP8 matmul: FP8 operands into the dot itself, its transposes likewise -------------------


def _transposed_dot(
    g: jax.Array, other: jax.Array, dimension_numbers: Any, *, wrt: str, ndims: tuple[int, int]
) -> jax.Array:
    """The cotangent of ``dot_general(lhs, rhs, dimension_numbers)`` with respect to ``lhs``
    (``wrt="lhs"``, ``other`` the rhs) or ``rhs`` (``other`` the lhs), as one ``dot_general`` of
    ``g`` and ``other`` accumulated in float32, then a transpose into the operand's axis order.

    The product's axes are ``[batch, lhs kept, rhs kept]``; the cotangent contracts ``g``'s
    axes of the other operand's kept dimensions with those dimensions, batched as the product
    was, and its result's axes, ``[batch, kept, contracted in the other operand's order]``,
    are put back where the operand had them.
    """
    (contract, other_contract), (batch, other_batch) = dimension_numbers
    if wrt == "rhs":
        (other_contract, contract), (other_batch, batch) = dimension_numbers
    ndim, other_ndim = ndims if wrt == "lhs" else ndims[::-1]
    kept = [d for d in range(ndim) if d not in contract and d not in batch]
    other_kept = [d for d in range(other_ndim) if d not in other_contract and d not in other_batch]
    nb = len(batch)
    # g's axes: batch first, then the lhs's kept dimensions, then the rhs's
    g_other = (
        range(nb + len(kept), nb + len(kept) + len(other_kept)) if wrt == "lhs" else range(nb, nb + len(other_kept))
    )
    dims = ((tuple(g_other), tuple(other_kept)), (tuple(range(nb)), tuple(other_batch)))
    out = jax.lax.dot_general(g, other, dims, preferred_element_type=jnp.float32)
    order = sorted(range(len(contract)), key=lambda i: other_contract[i])
    axes = [*batch, *kept, *(contract[i] for i in order)]  # the result's axes, as the operand's
    return jnp.transpose(out, tuple(sorted(range(ndim), key=lambda i: axes[i])))


def _scales(recipe: Fp8Recipe, fmt: str, x: jax.Array, scale: Any, history: Any) -> tuple[jax.Array, Any, jax.Array]:
    """The dequantization scale ``x`` is quantized with, and its history with ``max |x|`` recorded
    (delayed scaling); with current scaling (``history`` None), the scale of ``max |x|`` itself.
    Third, the factor that keeps a non-finite ``x`` non-finite through the product: 1 where
    ``max |x|`` is finite, NaN where not (the quantizer's clip would turn an inf into the
    format's largest value, and the step would train on it)."""
    amax = amax_of(x)
    propagate = jnp.where(jnp.isfinite(amax), jnp.float32(1.0), jnp.float32(jnp.nan))
    if history is None:
        return new_scale(amax, jnp.ones(1, jnp.float32), fmt, margin=recipe.margin), None, propagate
    s = new_scale(recipe.history_amax(history), scale, fmt, margin=recipe.margin)
    return s, record_amax(history, amax), propagate


def _scaled(product: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """A float32 product of FP8 operands times the product of their scales, in ``dtype``: the
    form XLA's GPU compiler fuses into one FP8 GEMM with its scales."""
    return (product * scale.reshape(())).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_dot(recipe: Fp8Recipe, dimension_numbers: Any, dtypes: tuple[Any, Any, Any], lhs: Any, rhs: Any, meta: Any):
    return _fp8_dot_fwd(recipe, dimension_numbers, dtypes, lhs, rhs, meta)[0]


def _fp8_dot_fwd(
    recipe: Fp8Recipe, dimension_numbers: Any, dtypes: tuple[Any, Any, Any], lhs: Any, rhs: Any, meta: Any
) -> tuple[jax.Array, tuple[Any, ...]]:
    delayed = isinstance(meta, Fp8Meta)
    sx, hx, finite_x = _scales(
        recipe, recipe.forward, lhs, *((meta.input_scale, meta.input_history) if delayed else (None, None))
    )
    sw, hw, finite_w = _scales(
        recipe, recipe.forward, rhs, *((meta.kernel_scale, meta.kernel_history) if delayed else (None, None))
    )
    x8, w8 = quantize(lhs, recipe.forward, sx), quantize(rhs, recipe.forward, sw)
    product = jax.lax.dot_general(x8, w8, dimension_numbers, preferred_element_type=jnp.float32)
    grad_state = (meta.grad_scale, meta.grad_history) if delayed else (None, None)
    # a non-finite operand makes the product NaN (as a bf16 matmul's would not be finite), so the
    # loss is not finite and the step is skipped; its cotangent is then NaN too (the backward below)
    return _scaled(product, sx * sw * finite_x * finite_w, dtypes[2]), (x8, w8, sx, sw, hx, hw, grad_state)


def _fp8_dot_bwd(
    recipe: Fp8Recipe, dimension_numbers: Any, dtypes: tuple[Any, Any, Any], res: tuple[Any, ...], g: jax.Array
) -> tuple[Any, ...]:
    x8, w8, sx, sw, hx, hw, (grad_scale, grad_history) = res
    sg, hg, finite_g = _scales(recipe, recipe.backward, g, grad_scale, grad_history)
    g8 = quantize(g, recipe.backward, sg)
    ndims = (x8.ndim, w8.ndim)
    dx = _transposed_dot(g8, w8, dimension_numbers, wrt="lhs", ndims=ndims)
    dw = _transposed_dot(g8, x8, dimension_numbers, wrt="rhs", ndims=ndims)
    # straight through: lhs and rhs get the cotangents of their quantized copies; the meta's
    # "gradient" is its new value (the scales used, the histories with this step's amax)
    meta = None if grad_history is None else Fp8Meta(sx, hx, sw, hw, sg, hg)
    # an overflowed (scaled) gradient stays non-finite: the step skips it and the loss scale backs off
    return _scaled(dx, sg * sw * finite_g, dtypes[0]), _scaled(dw, sg * sx * finite_g, dtypes[1]), meta


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


# --- a meta used twice, refused while leanstep traces a loss ---------------------------------------

_USES: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("leanstep_fp8_uses", default=None)


@contextlib.contextmanager
def fp8_uses() -> Iterator[None]:
    """While it is open, an :class:`Fp8Meta` passed to a second matmul is refused (the gradient
    stage opens it around each trace of the loss)."""
    token = _USES.set([])
    try:
        yield
    finally:
        _USES.reset(token)


def _note_use(meta: Fp8Meta) -> None:
    seen = _USES.get()
    if seen is None:
        return
    if any(meta.input_scale is other for other in seen):
        raise ValueError(
            "an Fp8Meta is used by a second matmul in one loss: its gradient would be the sum of two new "
            "values, not their max. Give each matmul its own Fp8Meta (for a layer applied in a loop, stack "
            "one per application and lax.scan over them with the weights)"
        )
    seen.append(meta.input_scale)


def _check_meta(meta: Fp8Meta, recipe: Fp8Recipe | None, lhs: jax.Array, rhs: jax.Array) -> None:
    """Refuses a meta whose histories are not the given ``recipe``'s length (None: none given), and
    a ``jax.vmap`` that batches an operand but not the meta (see the module doc)."""
    lengths = {int(h.shape[-1]) for h in (meta.input_history, meta.kernel_history, meta.grad_history)}
    if recipe is not None and lengths != {recipe.history}:
        raise ValueError(
            f"meta: an Fp8Meta whose amax histories hold {' and '.join(map(str, sorted(lengths)))} entries, under "
            f"recipe={recipe.to_string()!r} (history={recipe.history}): make the meta with Fp8Meta.create(recipe), or "
            "pass the recipe it was made with"
        )
    traces = [x._trace for x in (lhs, rhs) if isinstance(x, BatchTracer)]
    leaves = jax.tree.leaves(meta)
    # the innermost vmap of each operand must batch the meta too (a vmap over an ensemble of layers
    # that stacks their metas is fine; one more inside it, over the examples, is not)
    if not all(isinstance(leaf, BatchTracer) and leaf._trace is trace for trace in traces for leaf in leaves):
        raise ValueError(
            "an FP8 matmul with delayed scaling (its Fp8Meta) runs under a jax.vmap that batches its operands but "
            "not its meta: each example would record its own amax and the step would take their sum. Call the layer "
            "on the whole batch, (batch, ..., in_features), not under jax.vmap (an FP8 scale is per tensor), or vmap "
            "the meta with the operands (one per member)"
        )


# --- the matmuls -----------------------------------------------------------------------------------

_SCOPE = "leanstep_fp8_"


class Fp8Scope(NamedTuple):
    """What the name scope of an FP8 matmul says (:func:`fp8_scope`).

    Attributes:
      scaling: ``"delayed"`` or ``"current"``.
      lhs, rhs: the FP8 formats the operands carry: the forward format twice for the matmul
        itself; for its transposes in the backward pass (JAX puts the cotangent first), the
        gradient's format and the forward one.
      backward: the equation is a transpose, in the backward pass.
    """

    scaling: str
    lhs: str
    rhs: str
    backward: bool


def fp8_scope(name_stack: str) -> Fp8Scope | None:
    """The FP8 matmul an equation's name stack places it in, or None.

    Example:
      >>> fp8_scope("transpose(jvp(leanstep_fp8_delayed_e4m3_e5m2))")
      Fp8Scope(scaling='delayed', lhs='e5m2', rhs='e4m3', backward=True)
      >>> fp8_scope("jvp(mlp)") is None
      True
    """
    at = name_stack.rfind(_SCOPE)
    if at < 0:
        return None
    parts = name_stack[at + len(_SCOPE) :].split("/")[0].rstrip(")").split("_")
    if len(parts) != 3:
        return None
    scaling, forward, backward = parts
    transposed = "transpose(" in name_stack[:at]
    return Fp8Scope(scaling, backward if transposed else forward, forward, transposed)


def fp8_dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
    dimension_numbers: Any,
    *,
    meta: Fp8Meta | None = None,
    recipe: Fp8Recipe | None = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``jax.lax.dot_general`` with FP8 operands (the module doc): ``lhs`` the input, ``rhs`` the kernel.

    Args:
      lhs: the input operand, in the compute dtype (bfloat16, say); the product is in it too.
      rhs: the kernel operand, in the compute dtype.
      dimension_numbers: as ``jax.lax.dot_general``.
      meta: this matmul's :class:`Fp8Meta` (delayed scaling); None with current scaling.
      recipe: an :class:`leanstep.blocks.fp8.Fp8Recipe`, whose ``history`` the meta's histories
        must have; None: delayed scaling, with the meta's own history length.
      preferred_element_type: as ``jax.lax.dot_general``.

    Raises:
      TypeError: delayed scaling without an :class:`Fp8Meta`, or a meta with current scaling
        (it would never change), or operands that are not floating.
      ValueError: a meta whose histories are not a given ``recipe``'s ``history`` long, or a
        ``jax.vmap`` that batches an operand but not the meta (see the module doc).
    """
    given = recipe is not None
    recipe = Fp8Recipe() if recipe is None else recipe
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(operand.dtype, jnp.floating):
            raise TypeError(f"fp8_dot_general's {name} must be floating, got {operand.dtype}")
    if recipe.delayed != isinstance(meta, Fp8Meta):
        raise TypeError(
            "delayed scaling needs this matmul's meta=Fp8Meta.create(recipe)"
            if recipe.delayed
            else f"current scaling keeps no state: pass meta=None, got {type(meta).__name__}"
        )
    out_dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else jnp.dtype(preferred_element_type)
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))
    with jax.named_scope(f"{_SCOPE}{recipe.scaling}_{recipe.forward}_{recipe.backward}"):
        if isinstance(meta, Fp8Meta):
            _check_meta(meta, recipe if given else None, lhs, rhs)
            _note_use(meta)
        return _fp8_dot(recipe, dims, (lhs.dtype, rhs.dtype, out_dtype), lhs, rhs, meta)


def fp8_matmul(x: ArrayLike, w: ArrayLike, meta: Fp8Meta | None = None, recipe: Fp8Recipe | None = None) -> jax.Array:
    """``x @ w`` for ``x`` of shape ``(..., k)`` and ``w`` of shape ``(k, n)``, with FP8 operands.

    Example:
      >>> import jax.numpy as jnp
      >>> fp8_matmul(jnp.ones((1, 2)), jnp.full((2, 1), 3.3), recipe=Fp8Recipe("current"))
      Array([[6.6]], dtype=float32)
    """
    x = jnp.asarray(x)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return fp8_dot_general(x, w, dims, meta=meta, recipe=recipe)
