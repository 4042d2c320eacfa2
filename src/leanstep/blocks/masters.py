r"""Master weights in bfloat16 with stochastic rounding, and optionally compensated summation.

Round-to-nearest bfloat16 masters lose every update smaller than half an ulp: for
:math:`|\Delta| < 2^{-9} |w|`, :math:`\mathrm{rn}(w + \Delta) = w`, so a long run with a small
learning rate stops moving. Stochastic rounding rounds up with the probability of the distance
from the lower neighbour, so the rounded update is the update in expectation:

.. math::

    \mathrm{sr}(x) = \begin{cases} \lceil x \rceil & \text{with probability } (x - \lfloor x \rfloor)
    / (\lceil x \rceil - \lfloor x \rfloor) \\ \lfloor x \rfloor & \text{otherwise} \end{cases}
    \qquad \mathbb{E}[\mathrm{sr}(x)] = x

computed on float32 bits: 16 random bits added to the 16 bits bfloat16 drops, then truncated
(a magnitude, so it is symmetric in sign; infinities and NaNs stay what they are). The random
bits come from the state's key folded with the step and the leaf's index: deterministic, so a
resumed run is bit-identical. With compensated (Kahan) summation a bfloat16 buffer keeps what
rounding lost and adds it to the next update:

.. code-block:: text

    y  = update + c                    float32
    w' = round(w + y)                  bfloat16 (stochastic)
    c  = y - (w' - w)                  the part of y the new weight did not take, in bfloat16

A master format is one of :data:`MASTERS`: ``"float32"`` (leanstep's default), ``"bfloat16-sr"``,
``"bfloat16-sr-kahan"``. Plain ``"bfloat16"`` (round to nearest) is refused, naming these.

Example:
  >>> import jax, jax.numpy as jnp
  >>> w = jnp.ones(4096, jnp.bfloat16)
  >>> nearest = (w.astype(jnp.float32) + 1e-4).astype(jnp.bfloat16)       # 1e-4 < half an ulp of 1
  >>> rounded = stochastic_round(w.astype(jnp.float32) + 1e-4, jax.random.key(0))
  >>> bool(jnp.all(nearest == 1)), round(float(jnp.mean(rounded.astype(jnp.float32)) - 1), 5)
  (True, 0.0001)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

__all__ = [
    "MASTERS",
    "apply_to_master",
    "apply_to_masters",
    "check_master",
    "master_dtype",
    "rows_bits",
    "rows_can_split",
    "stochastic_round",
]

#: The master formats (see the module doc).
MASTERS = ("float32", "bfloat16-sr", "bfloat16-sr-kahan")


class _RoundToNearestControl:
    """The test-only master format: bfloat16 rounded to nearest (see :data:`ROUND_TO_NEAREST_CONTROL`)."""

    def __repr__(self) -> str:
        return "ROUND_TO_NEAREST_CONTROL"


#: A test-only master format: bfloat16 rounded to nearest, refused by :func:`check_master` unless
#: this very object is given (no string names it); the control the stochastic formats are measured
#: against.
ROUND_TO_NEAREST_CONTROL = _RoundToNearestControl()

_REFUSAL = (
    "master={!r}: bfloat16 masters rounded to nearest lose every update smaller than half an ulp of "
    "the weight (w + lr * g == w for |lr * g| < |w| / 512), so a run stalls; use master='bfloat16-sr' "
    "(stochastic rounding: unbiased, 2 bytes a weight), 'bfloat16-sr-kahan' (and a bfloat16 buffer "
    "of what rounding lost, 4 bytes), or float32 masters ('float32') with moments='int8' or "
    "'bfloat16' to save the memory in the optimizer state instead"
)


def check_master(master: Any) -> Any:
    """``master`` if it is one of :data:`MASTERS` (or the test-only control).

    Raises:
      ValueError: another value; plain bfloat16 with the reason and the working alternatives.
    """
    if master is ROUND_TO_NEAREST_CONTROL:
        return master
    if not isinstance(master, str) or master not in MASTERS:
        if isinstance(master, str) and master.strip().lower() in ("bfloat16", "bf16", "bfloat16-nearest"):
            raise ValueError(_REFUSAL.format(master))
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    return master


def master_dtype(master: Any) -> Any:
    """The dtype masters of format ``master`` are kept in."""
    return jnp.float32 if master == "float32" else jnp.bfloat16


def stochastic_round(x: jax.Array, key: jax.Array, *, first_row: Any = None, leaf_shape: Any = None) -> jax.Array:
    """``x`` (float32) rounded stochastically to bfloat16 (see the module doc).

    With ``first_row`` and ``leaf_shape``, ``x`` is rows ``first_row, first_row + 1, ...`` (its
    leading axis) of a leaf of shape ``leaf_shape``, and takes the random bits those rows take
    when the whole leaf is rounded with ``key`` (:func:`rows_bits`): a leaf rounded in slices is
    rounded as it is whole.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.full(8, 1.0 + 2.0**-9, jnp.float32)   # halfway between two bfloat16 neighbours
      >>> sorted(set(stochastic_round(x, jax.random.key(1)).astype(float).tolist()))
      [1.0, 1.0078125]
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    if first_row is None:
        noise = jax.random.bits(key, bits.shape, jnp.uint32)
    else:
        noise = rows_bits(key, tuple(leaf_shape), first_row, bits.shape[0])
    noise = noise & jnp.uint32(0xFFFF)
    finite = jnp.isfinite(x)
    rounded = jnp.where(finite, (bits + noise) & jnp.uint32(0xFFFF0000), bits)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def rows_can_split(key: jax.Array, leaf_shape: tuple[int, ...]) -> bool:
    """Whether :func:`rows_bits` can give the bits of a slice of a leaf of this shape: a threefry
    key with JAX's partitionable bits (``jax_threefry_partitionable``, the default), fewer than
    2**32 entries, and a leading axis."""
    partitionable = bool(jax.config.jax_threefry_partitionable)  # type: ignore[attr-defined]
    impl = str(jax.random.key_impl(key))
    return partitionable and "threefry" in impl and len(leaf_shape) >= 1 and math.prod(leaf_shape) < 2**32


def rows_bits(key: jax.Array, leaf_shape: tuple[int, ...], first_row: Any, rows: int) -> jax.Array:
    """Rows ``[first_row, first_row + rows)`` of ``jax.random.bits(key, leaf_shape, uint32)``,
    without drawing the rest (``first_row`` may be traced; see :func:`rows_can_split`).

    JAX's partitionable threefry draws entry ``n`` (flat index) as
    ``threefry2x32(key, (n >> 32, n & 0xFFFFFFFF))``, the two words XORed; a slice of rows is
    the flat indices from ``first_row * row_size`` on.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> key = jax.random.key(3)
      >>> whole = jax.random.bits(key, (5, 3), jnp.uint32)
      >>> bool(jnp.all(rows_bits(key, (5, 3), 2, 2) == whole[2:4]))
      True
    """
    row_size = math.prod(leaf_shape[1:])
    shape = (rows, *leaf_shape[1:])
    start = jnp.asarray(first_row, jnp.uint32) * jnp.uint32(row_size)
    low = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) + start
    k1, k2 = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros(shape, jnp.uint32), low)
    return bits1 ^ bits2


def apply_to_master(
    p: jax.Array,
    u: jax.Array,
    master: Any,
    key: jax.Array,
    c: Any = None,
    *,
    first_row: Any = None,
    leaf_shape: Any = None,
) -> tuple[jax.Array, Any]:
    """One leaf of :func:`apply_to_masters` (``key`` is the leaf's); with ``first_row`` and
    ``leaf_shape``, ``p`` is a slice of rows of the leaf and is rounded as they are in the whole
    leaf (:func:`stochastic_round`). Returns ``(new, new_error)``."""
    wide = p.astype(jnp.float32)
    y = u.astype(jnp.float32) + (0.0 if c is None else c.astype(jnp.float32))
    if master is ROUND_TO_NEAREST_CONTROL:
        new = (wide + y).astype(jnp.bfloat16)
    else:
        new = stochastic_round(wide + y, key, first_row=first_row, leaf_shape=leaf_shape)
    return new, (None if c is None else (y - (new.astype(jnp.float32) - wide)).astype(jnp.bfloat16))


def apply_to_masters(params: Any, updates: Any, master: Any, key: jax.Array, error: Any = None) -> tuple[Any, Any]:
    """``params + updates`` in the master format; returns ``(new_params, new_error)``.

    ``key`` is the step's key (the state's key folded with the step); leaf ``i`` takes
    ``fold_in(key, i)``. ``error`` is the Kahan buffer (``"bfloat16-sr-kahan"``), else None.
    """
    if master == "float32":
        return jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates), None
    leaves, treedef = jax.tree.flatten(params)
    update_leaves = treedef.flatten_up_to(updates)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
    error_leaves = treedef.flatten_up_to(error) if error is not None else [None] * len(leaves)  # type: ignore[attr-defined]
    new_leaves, new_errors = [], []
    for index, (p, u, c) in enumerate(zip(leaves, update_leaves, error_leaves)):
        new, new_error = apply_to_master(p, u, master, jax.random.fold_in(key, index), c)
        new_leaves.append(new)
        new_errors.append(new_error)
    new_params = jax.tree.unflatten(treedef, new_leaves)
    return new_params, (None if error is None else jax.tree.unflatten(treedef, new_errors))
