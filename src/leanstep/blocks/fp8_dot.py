r"""FP8 matmuls any model can call: :func:`fp8_dot_general`, :func:`fp8_matmul` and their state.

.. code-block:: text

    forward     x_q = qdq(x, e4m3, s_x)      w_q = qdq(w, e4m3, s_w)      y = dot(x_q, w_q)
    backward    g_q = qdq(g, e5m2, s_g)      dx = dot_T(g_q, w_q)         dw = dot_T(x_q, g_q)

(:func:`leanstep.blocks.fp8.qdq`), the structure of Flax's ``Fp8DotGeneralOp``: the operands are
quantized and dequantized around an ordinary ``dot_general`` in the compute dtype, which XLA on
an FP8 GPU (H100, H200, MI300) rewrites into one FP8 GEMM with its scales, and which XLA:CPU
runs exactly as written (emulated: the operands carry FP8 values in the compute dtype). The
quantization is straight-through: ``x`` and ``w`` receive the gradient of their quantized
copies. The name scope ``leanstep_fp8_<scaling>_<forward>_<backward>`` marks the matmul, and
JAX's transpose of it, for :func:`leanstep.audit` (:func:`fp8_scope`).

Delayed scaling (:class:`leanstep.blocks.fp8.Fp8Recipe`) keeps one :class:`Fp8Meta` per matmul,
in the params tree: scales ``s_x, s_w, s_g`` from the amax histories of earlier steps, and the
histories, whose newest entry is this step's ``max |x|``, ``max |w|``, ``max |g|``. Its
"gradient" is its new value (:mod:`leanstep.blocks.fp8_state`), which
:func:`leanstep.make_train_step` combines by max over microbatches and devices and writes once
per step. Current scaling needs no state (``meta=None``).

Give every matmul its own :class:`Fp8Meta`, used once per loss (per layer of a scanned stack:
stack the metas and scan over them with the weights), on the whole batch. A meta used by two
matmuls would receive the sum of two new values; the step refuses one used twice by name, but
cannot see one closed over by a loop body, which sums it once per iteration, nor a matmul under
a ``jax.vmap`` over the batch, where each example would record its own amax (and the sum of
their new values would arrive): an FP8 scale is per tensor, so call the matmul on the batch.

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
from jax.typing import ArrayLike

from leanstep.blocks.fp8 import Fp8Recipe, amax_of, new_scale, qdq, record_amax
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


# --- the quantize-dequantize steps, as Flax's in_qdq / out_qdq -------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _in_qdq(recipe: Fp8Recipe, fmt: str, x: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    return _in_qdq_fwd(recipe, fmt, x, scale, history)[0]


def _in_qdq_fwd(
    recipe: Fp8Recipe, fmt: str, x: jax.Array, scale: jax.Array, history: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    s = new_scale(recipe.history_amax(history), scale, fmt, margin=recipe.margin)
    return qdq(x, fmt, s), (s, record_amax(history, amax_of(x)))


def _in_qdq_bwd(recipe: Fp8Recipe, fmt: str, new: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, ...]:
    return (g, *new)  # straight through; the state's "gradient" is its new value


_in_qdq.defvjp(_in_qdq_fwd, _in_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _out_qdq(recipe: Fp8Recipe, fmt: str, y: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    return y


def _out_qdq_fwd(
    recipe: Fp8Recipe, fmt: str, y: jax.Array, scale: jax.Array, history: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return y, (scale, history)


def _out_qdq_bwd(recipe: Fp8Recipe, fmt: str, old: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, ...]:
    scale, history = old
    s = new_scale(recipe.history_amax(history), scale, fmt, margin=recipe.margin)
    return qdq(g, fmt, s), s, record_amax(history, amax_of(g))


_out_qdq.defvjp(_out_qdq_fwd, _out_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _current_in(recipe: Fp8Recipe, fmt: str, x: jax.Array) -> jax.Array:
    return qdq(x, fmt, new_scale(amax_of(x), jnp.ones(1, jnp.float32), fmt, margin=recipe.margin))


_current_in.defvjp(lambda recipe, fmt, x: (_current_in(recipe, fmt, x), None), lambda recipe, fmt, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _current_out(recipe: Fp8Recipe, fmt: str, y: jax.Array) -> jax.Array:
    return y


def _current_out_bwd(recipe: Fp8Recipe, fmt: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (qdq(g, fmt, new_scale(amax_of(g), jnp.ones(1, jnp.float32), fmt, margin=recipe.margin)),)


_current_out.defvjp(lambda recipe, fmt, y: (y, None), _current_out_bwd)


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
      recipe: an :class:`leanstep.blocks.fp8.Fp8Recipe`; default delayed scaling.
      preferred_element_type: as ``jax.lax.dot_general``.

    Raises:
      TypeError: delayed scaling without an :class:`Fp8Meta`, or a meta with current scaling
        (it would never change), or operands that are not floating.
    """
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
    with jax.named_scope(f"{_SCOPE}{recipe.scaling}_{recipe.forward}_{recipe.backward}"):
        if isinstance(meta, Fp8Meta):
            _note_use(meta)
            x = _in_qdq(recipe, recipe.forward, lhs, meta.input_scale, meta.input_history)
            w = _in_qdq(recipe, recipe.forward, rhs, meta.kernel_scale, meta.kernel_history)
            y = jax.lax.dot_general(x, w, dimension_numbers, preferred_element_type=preferred_element_type)
            return _out_qdq(recipe, recipe.backward, y, meta.grad_scale, meta.grad_history)
        x, w = _current_in(recipe, recipe.forward, lhs), _current_in(recipe, recipe.forward, rhs)
        y = jax.lax.dot_general(x, w, dimension_numbers, preferred_element_type=preferred_element_type)
        return _current_out(recipe, recipe.backward, y)


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
