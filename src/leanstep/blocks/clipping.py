"""Global-norm gradient clipping that is exact in low precision and safe at zero.

:func:`optax.clip_by_global_norm` computes the norm in the leaves' own dtype: a bfloat16
tree whose true norm is 9486.8 reports 9472, and a float16 tree overflows to ``inf`` and is
clipped to all zeros. Its gradient at an all-zero tree is NaN, and it accepts a negative
``max_norm``. The functions here square and sum in (at least) float32, return a float32
norm, have a finite gradient at zero, let NaN show in the norm, and validate ``max_norm``.
"""

from __future__ import annotations

import math
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from leanstep.common.checks import FLOAT32_RANGE, is_normal_float32

__all__ = [
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "global_norm",
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


def global_norm(tree: object) -> jax.Array:
    r"""Return the L2 norm of all leaves of ``tree`` taken together, as float32.

    .. math::

        \lVert g \rVert = \sqrt{\textstyle\sum_\ell \sum_i g_{\ell,i}^2}

    Each leaf is widened to ``promote_types(leaf.dtype, float32)`` before squaring, so
    bfloat16 and float16 leaves are squared and summed in float32 (no float16 overflow,
    no bfloat16 rounding of the sum) and float64 leaves (under ``jax_enable_x64``) in
    float64. The result is always a float32 scalar; for float64 trees that is one final
    rounding of an exact-as-possible float64 norm.

    The value and the gradient are safe at zero: ``jax.grad(global_norm)`` at an all-zero
    tree is all zeros, not NaN. A NaN anywhere in the tree gives a NaN norm, an ``inf``
    gives ``inf``; so does a float32 sum of squares that overflows (norm above ~1.8e19).

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
      >>> jax.grad(global_norm)(jnp.zeros(3))
      Array([0., 0., 0.], dtype=float32)
    """
    return _safe_sqrt(_sum_of_squares(_float_leaves(tree, "tree"))).astype(jnp.float32)


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
    * an ``inf`` (or a norm overflowing float32) gives norm ``inf`` and ``s = 0``:
      finite entries become 0 and infinite ones NaN.

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
    wide_norm = _safe_sqrt(_sum_of_squares(arrays))
    limit = jnp.asarray(max_norm).astype(wide_norm.dtype)
    # ``norm <= limit`` is False for NaN, so a NaN norm gives s = NaN (visible), and
    # the inner where keeps c / norm away from norm = 0, whose gradient would be NaN.
    within = wide_norm <= limit
    safe_norm = jnp.where(within, jnp.ones_like(wide_norm), wide_norm)
    scale = jnp.where(within, jnp.ones_like(wide_norm), limit / safe_norm)
    clipped = []
    for leaf in arrays:
        compute = _compute_dtype(leaf.dtype)
        clipped.append((leaf.astype(compute) * scale.astype(compute)).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, clipped), wide_norm.astype(jnp.float32)


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
