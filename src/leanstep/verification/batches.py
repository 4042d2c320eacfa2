"""The batches verify's checks build from the setup's own batch.

.. code-block:: text

    microbatch_rows(B, M, split)[j]   the rows of microbatch j (contiguous or strided)
    rows_of(batch, rows)              those rows of every leaf
    uneven_mask(batch, mask, rows)    token weights that give each microbatch a different count
    poison_row(batch, row)            NaN in every floating input of one row

Example:
  >>> microbatch_rows(8, 4, "contiguous")[1], microbatch_rows(8, 4, "strided")[1]
  ([2, 3], [1, 5])
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["batch_rows", "microbatch_rows", "poison_row", "rows_of", "uneven_mask", "with_leaf"]


def batch_rows(batch: Any) -> int:
    """The number of rows of ``batch`` (its leaves' common leading dimension).

    Raises:
      ValueError: the batch has no array leaf, or its leaves disagree on the number of rows.
    """
    sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batch) if np.ndim(leaf) > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"batch: expected array leaves that share the leading (row) dimension, got row counts {sorted(sizes)}"
        )
    return sizes.pop()


def microbatch_rows(rows: int, num_microbatches: int, split: str) -> list[list[int]]:
    """The rows of each microbatch when ``rows`` rows are split ``split``-wise into ``num_microbatches``."""
    if split not in ("contiguous", "strided"):
        raise ValueError(f"split: expected 'contiguous' or 'strided', got {split!r}")
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"num_microbatches: expected a divisor of the batch's {rows} rows, got {num_microbatches}")
    size = rows // num_microbatches
    if split == "contiguous":
        return [list(range(j * size, (j + 1) * size)) for j in range(num_microbatches)]
    return [list(range(j, rows, num_microbatches)) for j in range(num_microbatches)]


def rows_of(batch: Any, rows: list[int]) -> Any:
    """Rows ``rows`` of every leaf of ``batch``, in that order (NumPy arrays)."""
    index = np.asarray(rows)
    return jax.tree.map(lambda leaf: np.asarray(leaf)[index], batch)


def with_leaf(batch: Any, name: str, value: np.ndarray) -> Any:
    """``batch`` (a dict) with leaf ``name`` replaced by ``value``."""
    if not isinstance(batch, dict) or name not in batch:
        raise ValueError(f"mask: expected the name of a leaf of a dict batch, got {name!r}")
    return {**batch, name: value}


def uneven_mask(batch: Any, mask: str, rows: list[list[int]]) -> tuple[Any, list[float]]:
    """``batch`` with token weights that keep a different share of each microbatch's tokens.

    Microbatch ``j`` keeps the first ``(j + 1) / (2 M)`` of every row's weights, at least one
    token, so its count grows with ``j`` (under a per-microbatch mean the first microbatch would
    weigh as much as the last). Returns the batch and each microbatch's count.
    """
    weights = np.array(np.asarray(batch[mask]), copy=True)
    if weights.ndim < 2:
        raise ValueError(f"mask: expected token weights shaped (rows, tokens, ...), got the shape {weights.shape}")
    tokens = weights.shape[1]
    counts = []
    for j, microbatch in enumerate(rows):
        keep = max(1, (tokens * (j + 1)) // (2 * len(rows)))
        for r in microbatch:
            weights[r] = 0
            weights[r, :keep] = 1
        counts.append(float(weights[microbatch].sum()))
    return with_leaf(batch, mask, weights.astype(np.asarray(batch[mask]).dtype)), counts


def poison_row(batch: Any, row: int) -> Any:
    """``batch`` with NaN in every floating leaf of row ``row``.

    Raises:
      ValueError: the batch has no floating leaf to carry the NaN (give the step a ``poison``).
    """
    leaves, treedef = jax.tree.flatten(batch)
    poisoned, done = [], False
    for leaf in leaves:
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.floating) and array.ndim > 0:
            array = np.array(array, copy=True)
            array[row] = np.nan
            done = True
        poisoned.append(array)
    if not done:
        raise ValueError(
            "batch: no floating leaf to make a row's loss non-finite; give the step a poison(batch, row) "
            "method (e.g. NaN token weights for that row)"
        )
    return jax.tree.unflatten(treedef, poisoned)
