"""Trees as verify compares them: named leaves in float64, bitwise equality, bounded differences.

Example:
  >>> import numpy as np
  >>> a = {"w": np.array([1.0, 2.0], np.float32), "b": np.zeros(1, np.float32)}
  >>> b = {"w": np.array([1.0, 2.5], np.float32), "b": np.zeros(1, np.float32)}
  >>> first_difference(a, b)
  ('w', 1)
  >>> worst_excess(b, a, {"w": np.full(2, 0.1), "b": np.zeros(1)})
  Excess(leaf='w', position=1, difference=0.5, bound=0.1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["Excess", "first_difference", "named_leaves", "on_arrays", "to_float64", "worst_excess"]


def _name(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "(root)"


def named_leaves(tree: Any) -> Iterator[tuple[str, np.ndarray]]:
    """``(path, array)`` for every array leaf of ``tree``, paths as ``"blocks/0/w"``."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf is None:
            continue
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)  # a typed key (Flax NNX's Rngs): its bits
        yield _name(path), np.asarray(jax.device_get(leaf))


def to_float64(tree: Any) -> dict[str, np.ndarray]:
    """``{path: float64 array}`` of the floating leaves of ``tree`` (keys and integers left out)."""
    return {
        name: np.asarray(leaf, np.float64)
        for name, leaf in named_leaves(tree)
        if np.issubdtype(leaf.dtype, np.floating) or leaf.dtype.name in ("bfloat16", "float16")
    }


def _bits(leaf: np.ndarray) -> np.ndarray:
    if leaf.dtype.kind in "fcV" or leaf.dtype.name == "bfloat16" or leaf.dtype.name.startswith("float8"):
        return np.ascontiguousarray(leaf).reshape(*leaf.shape, 1).view(np.uint8)
    return leaf


def on_arrays(fn: Callable[..., Any], tree: Any) -> tuple[Callable[..., Any], list[Any]]:
    """``(f, arrays)`` with ``f(arrays, *rest) == fn(tree, *rest)``: only the array leaves of ``tree``
    go in as arguments, the others (an Equinox module's strings and functions) are closed over, so
    that ``jax.jit`` and ``jax.make_jaxpr`` take a state that holds them.

    Example:
      >>> f, arrays = on_arrays(lambda t, x: t["w"] * x if t["act"] == "id" else x, {"w": np.ones(2), "act": "id"})
      >>> len(arrays), f(arrays, 3.0).tolist()
      (1, [3.0, 3.0])
    """
    leaves, treedef = jax.tree.flatten(tree)
    dynamic = [isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in leaves]

    def f(arrays: list[Any], *rest: Any) -> Any:
        given = iter(arrays)
        full = [next(given) if is_array else leaf for leaf, is_array in zip(leaves, dynamic, strict=True)]
        return fn(jax.tree.unflatten(treedef, full), *rest)

    return f, [leaf for leaf, is_array in zip(leaves, dynamic, strict=True) if is_array]


def first_difference(got: Any, want: Any) -> tuple[str, int] | None:
    """The first leaf (and flat index in it) where ``got`` and ``want`` differ bit for bit, or None.

    A differing structure is reported as the leaf ``"(structure)"``.
    """
    left, right = dict(named_leaves(got)), dict(named_leaves(want))
    if left.keys() != right.keys():
        return "(structure)", 0
    for name, a in left.items():
        b = right[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return name, 0
        unequal: np.ndarray = np.asarray(_bits(a) != _bits(b))
        if unequal.ndim > a.ndim:
            unequal = np.asarray(unequal.any(axis=-1))
        if unequal.any():
            return name, int(np.flatnonzero(unequal.reshape(-1))[0])
    return None


class Excess(NamedTuple):
    """Where a difference is largest against its bound: ``difference / bound`` is the worst ratio."""

    leaf: str
    position: int
    difference: float
    bound: float

    @property
    def ratio(self) -> float:
        """``difference / bound`` (inf for a nonzero difference under a zero bound)."""
        if self.bound > 0:
            return self.difference / self.bound
        return 0.0 if self.difference == 0 else float("inf")


def worst_excess(got: Any, want: Any, bound: Any) -> Excess:
    """The element where ``|got - want|`` is largest relative to ``bound`` (three trees of the same leaves).

    A NaN difference counts as infinitely large.
    """
    g, w, b = to_float64(got), to_float64(want), to_float64(bound)
    worst = Excess("", 0, 0.0, 0.0)
    for name, want_leaf in w.items():
        difference = np.abs(g[name] - want_leaf).reshape(-1)
        difference = np.where(np.isnan(difference), np.inf, difference)
        limit = np.broadcast_to(b[name], want_leaf.shape).reshape(-1)
        if difference.size == 0:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(limit > 0, difference / np.where(limit > 0, limit, 1), np.where(difference > 0, np.inf, 0))
        i = int(np.argmax(ratio))
        candidate = Excess(name, i, float(difference[i]), float(limit[i]))
        if not worst.leaf or candidate.ratio > worst.ratio:
            worst = candidate
    return worst
