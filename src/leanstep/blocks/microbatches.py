r"""Splitting a batch into microbatches: contiguous, strided, or already split.

A *splitter* turns a batch whose leaves share a leading axis of size :math:`B` into the same
tree with leaves of shape :math:`(M, B/M, \dots)`, microbatch :math:`j` at index :math:`j`:

.. code-block:: text

    name          microbatch j holds rows              use
    "contiguous"  j S, ..., (j+1) S - 1   (S = B/M)     one device: a reshape, no copy
    "strided"     j, j + M, j + 2M, ...                 rows split over devices: no row moves
    "presplit"    the batch is already (M, S, ...)     a pipeline that splits itself

:func:`get_splitter` resolves a name (:data:`SPLITS`) or passes a callable
``splitter(batch, num_microbatches)`` through, so the gradient stage takes any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from leanstep.common.checks import check_int

__all__ = ["SPLITS", "get_splitter", "presplit_microbatches", "split_microbatches", "split_strided_microbatches"]

Tree = TypeVar("Tree")
Splitter = Callable[[Any, int], Any]


def check_num_microbatches(num_microbatches: Any) -> int:
    """``num_microbatches`` as an int >= 1; it is static (it sets the scan length)."""
    return check_int("num_microbatches", num_microbatches, static=True)


def _leading_size(batch: Any, *, axis_name: str = "leading") -> int:
    """The shared leading size of every leaf of ``batch``; ValueError naming the leaf that differs."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError(f"batch must have at least one array leaf with a leading batch axis, got {batch!r}")
    size, first = 0, ""  # the first leaf's
    for path, leaf in leaves:
        name = f"batch{jax.tree_util.keystr(path)}"
        shape = jnp.shape(leaf)
        if len(shape) == 0:
            raise ValueError(f"{name} is a scalar; every batch leaf needs a {axis_name} axis")
        if not first:
            size, first = shape[0], name
        elif shape[0] != size:
            raise ValueError(
                f"{name} has leading size {shape[0]} but {first} has {size}; "
                f"every batch leaf must share the {axis_name} axis"
            )
    return size


def split_microbatches(batch: Tree, num_microbatches: int) -> Tree:
    r"""Reshape every leaf of ``batch`` from ``(B, ...)`` to ``(num_microbatches, S, ...)``.

    With :math:`S = B / \text{num\_microbatches}`, microbatch :math:`j` holds rows
    :math:`jS, \dots, (j+1)S - 1` of every leaf (a reshape: no copy, no reordering).

    Args:
      batch: a pytree whose leaves are arrays sharing a leading batch axis of size B >= 1.
      num_microbatches: a Python int >= 1 that divides B.

    Returns:
      ``batch`` with every leaf reshaped to ``(num_microbatches, S) + leaf.shape[1:]``.

    Raises:
      TypeError: ``num_microbatches`` is not an int.
      ValueError: ``num_microbatches < 1``; ``batch`` has no leaves; a leaf has no
        leading axis or a leading size different from the others (the message names the
        leaf path); B is 0 or not divisible by ``num_microbatches``.

    Example:
      >>> import jax.numpy as jnp
      >>> split = split_microbatches({"x": jnp.arange(6.0), "y": jnp.zeros((6, 2))}, 3)
      >>> split["x"], split["y"].shape
      (Array([[0., 1.],
             [2., 3.],
             [4., 5.]], dtype=float32), (3, 2, 2))
      >>> split_microbatches({"x": jnp.arange(6.0)}, 4)
      Traceback (most recent call last):
      ...
      ValueError: batch size 6 is not divisible by num_microbatches=4
    """
    num_microbatches = check_num_microbatches(num_microbatches)
    batch_size = _leading_size(batch, axis_name="leading batch")
    if batch_size == 0:
        raise ValueError("batch size is 0; an empty batch has no loss or gradient")
    if batch_size % num_microbatches:
        raise ValueError(f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches}")
    rows = batch_size // num_microbatches
    return jax.tree.map(lambda leaf: jnp.reshape(leaf, (num_microbatches, rows) + tuple(jnp.shape(leaf)[1:])), batch)


def split_strided_microbatches(batch: Tree, num_microbatches: int) -> Tree:
    r"""Reshapes every leaf from ``(B, ...)`` to ``(M, B/M, ...)`` with microbatch ``j`` = rows ``j, j+M, ...``.

    .. math::

        \text{out}[j, r] = \text{batch}[r M + j], \qquad 0 \le j < M,\; 0 \le r < B/M

    A reshape to ``(B/M, M, ...)`` then a swap of the first two axes. If the rows are split
    contiguously over ``D`` devices and ``D M`` divides ``B``, device ``d``'s rows
    ``[d B/D, (d+1) B/D)`` are exactly rows ``r`` in ``[d B/(DM), (d+1) B/(DM))`` of axis 1 for
    every ``j``: splitting axis 1 the same way keeps every row on its device. (The contiguous
    split, ``batch[j B/M + r]``, puts whole microbatches on a few devices, and XLA must move
    rows between devices to spread each one.) Microbatch composition does not depend on ``D``.

    Args:
      batch: a pytree of arrays sharing a leading batch axis.
      num_microbatches: a Python int >= 1 that divides the batch size.

    Returns:
      ``batch`` with every leaf of shape ``(num_microbatches, B / num_microbatches) + leaf.shape[1:]``.

    Raises:
      ValueError, TypeError: as :func:`split_microbatches`.

    Example:
      >>> import jax.numpy as jnp
      >>> split_strided_microbatches({"x": jnp.arange(6)}, 3)["x"]
      Array([[0, 3],
             [1, 4],
             [2, 5]], dtype=int32)
    """
    num_microbatches = check_num_microbatches(num_microbatches)
    # Validates the tree (shared leading axis, divisibility) with the contiguous split's messages.
    rows = jax.tree.leaves(jax.eval_shape(lambda b: split_microbatches(b, num_microbatches), batch))[0].shape[1]
    return jax.tree.map(lambda leaf: jnp.swapaxes(leaf, 0, 1), split_microbatches(batch, rows))


def presplit_microbatches(batch: Tree, num_microbatches: int) -> Tree:
    """Checks that ``batch`` is already split into ``(num_microbatches, S, ...)`` leaves and returns it.

    Raises:
      ValueError: a leaf's leading axis is not ``num_microbatches``, the leaves disagree on
        it, or a leaf has no microbatch-row axis ``S``.

    Example:
      >>> import jax.numpy as jnp
      >>> presplit_microbatches({"x": jnp.zeros((2, 3))}, 2)["x"].shape
      (2, 3)
      >>> presplit_microbatches({"x": jnp.zeros((6,))}, 2)
      Traceback (most recent call last):
      ...
      ValueError: batch['x'] has shape (6,); a presplit batch needs leaves of shape (num_microbatches=2, rows, ...)
    """
    num_microbatches = check_num_microbatches(num_microbatches)
    size = _leading_size(batch, axis_name="leading microbatch")
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = jnp.shape(leaf)
        if size != num_microbatches or len(shape) < 2:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has shape {shape}; a presplit batch needs "
                f"leaves of shape (num_microbatches={num_microbatches}, rows, ...)"
            )
    rows = {jnp.shape(leaf)[1] for leaf in jax.tree.leaves(batch)}
    if len(rows) != 1:
        raise ValueError(f"the leaves of a presplit batch must share their rows axis, got sizes {sorted(rows)}")
    if rows == {0}:
        raise ValueError("batch size is 0; an empty batch has no loss or gradient")
    return batch


#: Splitter names accepted by :func:`get_splitter` (and ``split=`` of the gradient stage).
SPLITS: dict[str, Splitter] = {
    "contiguous": split_microbatches,
    "strided": split_strided_microbatches,
    "presplit": presplit_microbatches,
}


def get_splitter(split: str | Splitter) -> Splitter:
    """Resolves a splitter name from :data:`SPLITS`, or passes a callable through.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
      TypeError: neither a string nor a callable.

    Example:
      >>> get_splitter("strided") is split_strided_microbatches
      True
      >>> get_splitter("rows")
      Traceback (most recent call last):
      ...
      ValueError: unknown split='rows'; expected one of 'contiguous', 'strided', 'presplit' or a callable splitter(batch, num_microbatches)
    """
    if isinstance(split, str):
        if split not in SPLITS:
            known = ", ".join(repr(name) for name in SPLITS)
            raise ValueError(
                f"unknown split={split!r}; expected one of {known} or a callable splitter(batch, num_microbatches)"
            )
        return SPLITS[split]
    if not callable(split):
        raise TypeError(
            f"split must be a name or a callable splitter(batch, num_microbatches), got "
            f"{type(split).__name__} {split!r}"
        )
    return split
