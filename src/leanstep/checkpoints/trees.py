"""The state pytree as a checkpoint sees it: leaf specs, the JSON ``extra``, zero-size leaves.

Helpers of :mod:`leanstep.checkpoints.checkpointer`: what a leaf must be, what ``extra`` may hold, and how
zero-size leaves (which orbax refuses to write) travel as a one-element placeholder and come back
in the template's shape, dtype and sharding.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

__all__ = ["abstract_leaf", "check_json", "check_step", "leaf_specs", "with_placeholders", "zero_size_from_template"]


def leaf_specs(tree: Any, name: str, *, abstract_ok: bool) -> list[list[Any]]:
    """``[keypath, shape, dtype]`` per leaf; raises TypeError for a leaf that is not an array."""
    specs = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        is_abstract = isinstance(leaf, jax.ShapeDtypeStruct)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or (is_abstract and not abstract_ok):
            allowed = "jax.Array or np.ndarray" + (" or jax.ShapeDtypeStruct" if abstract_ok else "")
            raise TypeError(
                f"{name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; every leaf of "
                f"{name} must be a {allowed}"
            )
        specs.append([jax.tree_util.keystr(path), [int(d) for d in leaf.shape], str(leaf.dtype)])
    return specs


def abstract_leaf(leaf: Any) -> jax.ShapeDtypeStruct:
    if leaf.size == 0:  # saved as a placeholder (see with_placeholders)
        return jax.ShapeDtypeStruct((1,), leaf.dtype)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    # A concrete jax.Array carries the sharding the restored array must have.
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))


def with_placeholders(state: Any) -> Any:
    """``state`` with each zero-size leaf (which orbax refuses) replaced by one zero of its dtype."""
    return jax.tree.map(lambda leaf: np.zeros((1,), leaf.dtype) if leaf.size == 0 else leaf, state)


def zero_size_from_template(template: Any, restored: Any) -> Any:
    """The template's zero-size leaves (shape, dtype, sharding) in place of their placeholders."""

    def pick(wanted: Any, leaf: Any) -> Any:
        if wanted.size:
            return leaf
        sharding = getattr(wanted, "sharding", None)
        empty = np.zeros(wanted.shape, wanted.dtype)
        return jax.device_put(empty, sharding) if sharding is not None else jax.numpy.asarray(empty)

    return jax.tree.map(pick, template, restored)


def check_step(step: Any) -> int:
    """Accepts any integer scalar (Python, NumPy, a jax scalar array), not a bool."""
    try:
        index = operator.index(step) if not isinstance(step, (bool, np.bool_)) else -1
    except TypeError:
        index = -1
    if index < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return index


def check_json(value: Any, where: str) -> None:
    """Rejects what JSON would silently change (tuples, non-str keys) or cannot hold."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has key {key!r} of type {type(key).__name__}; JSON keys must be str")
            check_json(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]")
    elif value is not None and type(value) not in (bool, int, float, str):
        raise TypeError(
            f"{where} is a {type(value).__name__} ({value!r}); extra must hold only dict (str keys), "
            "list, str, int, float, bool and None (convert arrays with float()/int()/.tolist())"
        )
