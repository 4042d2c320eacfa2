"""A function of an array's rows, run on slices of rows in turn when the array is large.

``map_row_slices(fn, x, max_entries)`` is ``fn(x)`` for a function that treats each row (each
index of ``x``'s leading axes, the last axis whole) on its own, computed a slice of rows at a
time under ``jax.lax.map`` once ``x`` holds more than ``max_entries`` entries: ``fn``'s
temporaries are then a slice's, not the whole array's. Rows are the same computation either way,
so the values are too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["map_row_slices", "row_slices"]


def row_slices(rows: int, entries: int, max_entries: int) -> int:
    """The fewest slices, a divisor of ``rows``, each of at most ``max_entries`` of the ``entries``
    (or one row a slice where no divisor is enough).

    Example:
      >>> row_slices(rows=12, entries=12 * 100, max_entries=500), row_slices(7, 700, 500), row_slices(4, 400, 500)
      (3, 7, 1)
    """
    for parts in range(max(1, -(-entries // max_entries)), rows + 1):
        if rows % parts == 0:
            return parts
    return max(rows, 1)


def map_row_slices(fn: Callable[[jax.Array], Any], x: jax.Array, max_entries: int) -> Any:
    """``fn(x)``, where every leaf ``fn`` returns keeps ``x``'s leading axes (see the module doc).

    Example:
      >>> x = jnp.arange(12.0).reshape(2, 3, 2)
      >>> y = map_row_slices(lambda rows: {"max": rows.max(axis=-1, keepdims=True)}, x, max_entries=4)
      >>> y["max"].shape, bool((y["max"][..., 0] == x.max(axis=-1)).all())
      ((2, 3, 1), True)
    """
    shape = jnp.shape(x)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    parts = row_slices(rows, math.prod(shape), max_entries)
    if parts == 1:
        return fn(x)
    sliced = jnp.reshape(x, (parts, rows // parts, shape[-1]))
    out = jax.lax.map(fn, sliced)
    return jax.tree.map(lambda leaf: jnp.reshape(leaf, (*shape[:-1], *leaf.shape[2:])), out)
