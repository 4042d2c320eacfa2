"""Global-norm gradient clipping that is exact in low precision and safe at zero.

:func:`optax.clip_by_global_norm` computes the norm in the leaves' own dtype: a bfloat16
tree whose true norm is 9486.8 reports 9472, and a float16 tree overflows to ``inf`` and is
clipped to all zeros. Its gradient at an all-zero tree is NaN, and it accepts a negative
``max_norm``. The functions here square and sum in (at least) float32, return a float32
norm, have a finite gradient at zero, let NaN show in the norm, and validate ``max_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from leanstep.common.checks import FLOAT32_RANGE, is_normal_float32

__all__ = [
    "NormParts",
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "clip_leaves",
    "global_norm",
    "norm_parts",
]

Tree = TypeVar("Tree")


def _float_leaves(tree: object, name: str) -> list[jax.Array]:
    """Leaves of ``tree`` as arrays; non-floating leaves are a TypeError."""
    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        array = jnp.asarray(leaf)
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise TypeError(
                f"{name}{jax.tree_util.keystr(path)} has dtype {array.dtype}; "
                "expected a floating dtype (bfloat16, float16, float32 or float64)"
            )
        leaves.append(array)
    return leaves


def _compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    # At least float32: bf16/f16 widen, float64 (with jax_enable_x64) stays float64.
    return jnp.promote_types(dtype, jnp.float32)


def _sum_of_squares(leaves: list[jax.Array]) -> jax.Array:
    if not leaves:
        return jnp.zeros((), jnp.float32)
    partials = []
    for leaf in leaves:
        wide = leaf.astype(_compute_dtype(leaf.dtype))
        partials.append(jnp.sum(wide * wide))
    total_dtype = jnp.result_type(*partials)
    return jnp.sum(jnp.stack([p.astype(total_dtype) for p in partials]))


def _safe_sqrt(sum_sq: jax.Array) -> jax.Array:
    # Double where: d sqrt(x)/dx = inf at 0 and inf * 0 = NaN, so the sqrt never sees 0.
    # The test is ``== 0`` rather than ``> 0`` so that a NaN sum stays NaN.
    is_zero = sum_sq == 0
    safe = jnp.where(is_zero, jnp.ones_like(sum_sq), sum_sq)
    return jnp.where(is_zero, jnp.zeros_like(sum_sq), jnp.sqrt(safe))


def _times_power_of_two(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x * 2**exponent``, exactly, as two products by powers of two within ``2**±75``: neither
    factor is a denormal (a TPU flushes ``2**-128`` to 0) nor overflows (``2**128``)."""
    half = exponent // 2
    return x * _power_of_two(half, x.dtype) * _power_of_two(exponent - half, x.dtype)


def _power_of_two(k: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``2**k`` for an int ``k`` in the dtype's normal range, from its bits (``exp2`` may round)."""
    info = jnp.finfo(dtype)
    bits = jnp.int64 if info.bits == 64 else jnp.int32
    biased = (k.astype(bits) - info.minexp + 1) << (info.nmant)
    return jax.lax.bitcast_convert_type(biased.astype(bits), dtype)


class NormParts(NamedTuple):
    r"""A global norm as ``2**exponent * sqrt(total)``, exact where its squares would overflow.

    .. code-block:: text

        e     = the exponent of max |g_i|: 2**(e-1) <= max |g_i| < 2**e (0 for zeros, inf or NaN)
        total = sum of (g_i * 2**-e)**2, each term at most 1

    Scaling by a power of two is exact, and so is a square root's of ``4**-e``: the norm is the
    unscaled sum's root to the bit wherever that sum neither overflows nor underflows, and finite
    wherever it is at most the dtype's largest value (entries of 1e20 square past float32's).

    Attributes:
      exponent: int32, ``e``.
      total: the sum of the squares of the scaled entries (float32, float64 under x64).
      finite: bool, whether every entry is finite.
    """

    exponent: jax.Array
    total: jax.Array
    finite: jax.Array

    @property
    def norm(self) -> jax.Array:
        """``2**exponent * sqrt(total)``: the norm, ``inf`` only where it exceeds the dtype's largest value."""
        return _times_power_of_two(_safe_sqrt(self.total), self.exponent)

    def merge(self, other: NormParts) -> NormParts:
        """The parts of the norm of both trees together: each total scaled to the larger exponent
        by a power of two (exact but for underflow), a zero total taking no part in the choice."""
        exponent = jnp.where(
            self.total == 0, other.exponent, jnp.where(other.total == 0, self.exponent, jnp.maximum(self.exponent, other.exponent))
        )  # fmt: skip
        # A part 2**74 below the other adds nothing to its square (a factor past 2**-148 would be no power of two).
        down = lambda part: _times_power_of_two(part.total, jnp.maximum(2 * (part.exponent - exponent), -148))
        total = down(self) + down(other)
        return NormParts(exponent.astype(jnp.int32), total, self.finite & other.finite)

    def clip_factors(self, max_norm: ArrayLike) -> tuple[jax.Array, jax.Array]:
        """``(k, f)``: an entry ``g`` clipped to ``max_norm`` is ``g * 2**k * f``. ``(0, 1)`` where
        the norm is at most ``max_norm``; ``(-exponent, max_norm / sqrt(total))`` otherwise, so
        that a finite gradient whose norm exceeds the dtype is clipped right (``max_norm / norm``
        would be a denormal, flushed to 0); NaN for a NaN entry, 0 (and NaN at the inf) for an inf."""
        limit = jnp.asarray(max_norm).astype(self.total.dtype)
        # ``norm <= limit`` is False for NaN, so a NaN norm gives f = NaN (visible), and
        # the inner where keeps the division away from a zero norm, whose gradient would be NaN.
        within = self.norm <= limit
        one = jnp.ones_like(self.total)
        factor = jnp.where(within, one, limit / jnp.where(within, one, _safe_sqrt(self.total)))
        return jnp.where(within, 0, -self.exponent), factor


def norm_parts(tree: object, prepare: Callable[[list[jax.Array]], list[jax.Array]] = list) -> NormParts:
    """The global norm of ``prepare(leaves of tree)`` as :class:`NormParts`, squared and summed in
    at least float32.

    Two reductions over the leaves: the largest magnitude, then the sum of squares scaled by its
    power of two. ``prepare`` (the loss scale's unscaling, say) is applied to the leaves inside
    each, so that XLA fuses it into both and never keeps its result whole.

    Raises:
      TypeError: a leaf does not have a floating dtype.
    """
    leaves = _float_leaves(tree, "tree")
    if not leaves:
        return NormParts(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32), jnp.ones((), bool))
    wide = [x.astype(_compute_dtype(x.dtype)) for x in prepare(leaves)]
    dtype = jnp.result_type(*wide)
    peak = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0).astype(dtype) for x in wide]))
    usable = jnp.isfinite(peak) & (peak > 0)  # max propagates NaN
    exponent = jnp.where(usable, jnp.frexp(jnp.where(usable, peak, 1))[1], 0).astype(jnp.int32)
    total = _sum_of_squares([_times_power_of_two(x, -exponent) for x in wide])
    return NormParts(exponent, total, jnp.isfinite(peak) & jnp.isfinite(total))


def global_norm(tree: object) -> jax.Array:
    r"""Return the L2 norm of all leaves of ``tree`` taken together, as float32.

    .. math::

        \lVert g \rVert = \sqrt{\textstyle\sum_\ell \sum_i g_{\ell,i}^2}

    Each leaf is widened to ``promote_types(leaf.dtype, float32)`` before squaring, so
    bfloat16 and float16 leaves are squared and summed in float32 (no float16 overflow,
    no bfloat16 rounding of the sum) and float64 leaves (under ``jax_enable_x64``) in
    float64. The result is always a float32 scalar; for float64 trees that is one final
    rounding of an exact-as-possible float64 norm.

    The squares are summed with every entry scaled by the power of two above the largest
    magnitude, and the root scaled back (:func:`norm_parts`), so squares past float32's range
    (entries above about 1.8e19) do not overflow it: the norm is ``inf`` only where it exceeds
    float32's largest value itself.
    The value and the gradient are safe at zero: ``jax.grad(global_norm)`` at an all-zero
    tree is all zeros, not NaN. A NaN anywhere in the tree gives a NaN norm, an ``inf``
    gives ``inf``.

    Args:
      tree: a pytree of floating-point arrays (any shapes, including empty arrays).

    Returns:
      A float32 array of shape ``()``; ``0.0`` for a tree without leaves.

    Raises:
      TypeError: a leaf does not have a floating dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from leanstep.blocks.clipping import global_norm
      >>> global_norm({"w": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)})
      Array(5., dtype=float32)
      >>> global_norm([jnp.full((9000,), 100.0, jnp.bfloat16)])  # optax says 9472
      Array(9486.833, dtype=float32)
      >>> global_norm({"w": jnp.array([3e20, 4e20])})  # its squares overflow float32
      Array(5.e+20, dtype=float32)
      >>> jax.grad(global_norm)(jnp.zeros(3))
      Array([0., 0., 0.], dtype=float32)
    """
    return norm_parts(tree).norm.astype(jnp.float32)


def _check_max_norm(max_norm: ArrayLike) -> None:
    """Validate ``max_norm``: always a real scalar; finite and > 0 when concrete."""
    if isinstance(max_norm, (bool, np.bool_)):
        raise TypeError(f"max_norm must be a real number, got {max_norm!r}")
    traced = isinstance(max_norm, jax.core.Tracer)
    # Shape and dtype are static even when the value is traced.
    value = max_norm if isinstance(max_norm, jax.core.Tracer) else np.asarray(max_norm)
    if value.ndim != 0:
        raise ValueError(f"max_norm must be a scalar, got shape {value.shape}: {max_norm!r}")
    if not (jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)):
        raise TypeError(f"max_norm must be a real number, got {max_norm!r}")
    if traced:
        return  # Its value is unknown while tracing; a bad traced value cannot be raised on.
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"max_norm must be finite and > 0, got max_norm={max_norm!r}")
    if not is_normal_float32(number):  # the clip runs in float32: denormals flush to 0, the max overflows
        raise ValueError(
            f"max_norm must be finite and > 0, got max_norm={max_norm!r}; it is applied in float32, "
            f"so it must be in {FLOAT32_RANGE} (normal and finite in float32)"
        )


def clip_by_global_norm(tree: Tree, max_norm: ArrayLike) -> tuple[Tree, jax.Array]:
    r"""Scale ``tree`` so that its global norm is at most ``max_norm``.

    .. math::

        s = \begin{cases} 1 & \lVert g \rVert \le c \\
                          c / \lVert g \rVert & \text{otherwise} \end{cases},
        \qquad \tilde g_\ell = \operatorname{cast}_{\mathrm{dtype}(g_\ell)}(s \, g_\ell)

    with :math:`\lVert g \rVert` from :func:`global_norm` and :math:`c` = ``max_norm``.
    The case is chosen with ``jnp.where`` (``max_norm`` may be traced), ``s`` is float32
    (float64 if a leaf is float64), and every leaf is multiplied by ``s`` in
    ``promote_types(leaf.dtype, float32)`` and cast back to its own dtype. The pre-clip
    norm is returned so that callers (logging, non-finite checks) need not compute it
    again.

    Edge cases:

    * all-zero gradients come back unchanged with norm 0, and the gradient of the
      clipped output with respect to the input is finite there;
    * a NaN in the tree gives a NaN norm and ``s = NaN``, so **every** clipped leaf is
      NaN (never a silently half-clipped update; check ``jnp.isfinite(norm)``);
    * an ``inf`` gives norm ``inf`` and ``s = 0``: finite entries become 0 and infinite
      ones NaN;
    * a finite tree whose squares overflow float32 is clipped as any other: its squares are
      summed scaled by a power of two (:func:`norm_parts`), and ``s`` is taken from those parts
      (:meth:`NormParts.clip_factors`), so it is right even where the norm itself exceeds
      float32 (the returned norm is then ``inf``).

    Args:
      tree: a pytree of floating-point arrays.
      max_norm: the largest allowed global norm :math:`c`. A concrete Python/NumPy/JAX
        number is checked to be a normal, finite float32 > 0 (in ``[2**-126, float32 max]``);
        a traced scalar is used as is.

    Returns:
      ``(clipped, norm)``: a tree with the structure, shapes and dtypes of ``tree``, and
      the float32 global norm of ``tree`` before clipping, shape ``()``.

    Raises:
      ValueError: a concrete ``max_norm`` is not a normal, finite float32 > 0, or is not a scalar.
      TypeError: ``max_norm`` is not a real number, or a leaf is not floating point.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.blocks.clipping import clip_by_global_norm
      >>> clipped, norm = clip_by_global_norm(
      ...     {"w": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)}, 1.0)
      >>> clipped["w"], clipped["b"], norm
      (Array([0.6, 0. ], dtype=float32), Array(0.8, dtype=float32), Array(5., dtype=float32))
      >>> clip_by_global_norm({"w": jnp.array([3.0, 0.0])}, 10.0)[0]["w"]  # under the bound
      Array([3., 0.], dtype=float32)
      >>> clip_by_global_norm({"w": jnp.array([1.0])}, -1.0)
      Traceback (most recent call last):
      ...
      ValueError: max_norm must be finite and > 0, got max_norm=-1.0
    """
    _check_max_norm(max_norm)
    arrays = _float_leaves(tree, "tree")
    treedef = jax.tree.structure(tree)
    # float32 unless a leaf is float64; then s is float64 too, not rounded to float32.
    parts = norm_parts(arrays)
    return jax.tree.unflatten(treedef, clip_leaves(arrays, parts, max_norm)), parts.norm.astype(jnp.float32)


def clip_leaves(leaves: list[jax.Array], parts: NormParts, max_norm: ArrayLike) -> list[jax.Array]:
    """``leaves`` clipped by ``parts.clip_factors(max_norm)``, each in ``promote_types(dtype, float32)``
    and cast back to its dtype (the clip of :func:`clip_by_global_norm`, from norm parts already had)."""
    exponent, factor = parts.clip_factors(max_norm)

    def clip(x: jax.Array) -> jax.Array:
        compute = _compute_dtype(x.dtype)
        return (_times_power_of_two(x.astype(compute), exponent) * factor.astype(compute)).astype(x.dtype)

    return [clip(x) for x in leaves]


def clip_by_global_norm_transform(max_norm: ArrayLike) -> optax.GradientTransformation:
    """Return :func:`clip_by_global_norm` as a stateless optax transformation.

    ``init`` returns :class:`optax.EmptyState`; ``update(updates, state, params=None)``
    returns ``(clipped_updates, state)``. Use :func:`clip_by_global_norm` directly when
    the pre-clip norm is wanted.

    Args:
      max_norm: the largest allowed global norm, validated now (when concrete).

    Returns:
      An :class:`optax.GradientTransformation` that chains with :func:`optax.chain`.

    Raises:
      ValueError: a concrete ``max_norm`` is not a normal, finite float32 > 0.
      TypeError: ``max_norm`` is not a real number.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from leanstep.blocks.clipping import clip_by_global_norm_transform
      >>> optimizer = optax.chain(clip_by_global_norm_transform(1.0), optax.sgd(0.5))
      >>> grads = {"w": jnp.array([3.0, 4.0])}
      >>> updates, _ = optimizer.update(grads, optimizer.init(grads))
      >>> updates["w"]
      Array([-0.3, -0.4], dtype=float32)
    """
    _check_max_norm(max_norm)

    def init_fn(params: object) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(
        updates: Tree, state: optax.EmptyState, params: object | None = None
    ) -> tuple[Tree, optax.EmptyState]:
        del params
        clipped, _ = clip_by_global_norm(updates, max_norm)
        return clipped, state

    return optax.GradientTransformation(init_fn, update_fn)
