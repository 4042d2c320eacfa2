"""Argument checks shared by every module (optax's ``_src/utils.py``).

Each check raises at call or trace time, never with ``assert``: ``TypeError`` for a value of
the wrong kind, ``ValueError`` for one out of range, and the message names the argument, shows
the value and says what would be right, e.g.
``ValueError: num_microbatches must be >= 1, got 0``. The names here have no leading
underscore: the module is private, its functions are shared.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
#: The range of a positive threshold applied in float32: normal (XLA flushes denormals to zero) and finite.
FLOAT32_RANGE = f"[{FLOAT32_TINY:.8g}, {FLOAT32_MAX:.8g}]"


def is_int(value: Any) -> TypeGuard[int | np.integer]:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A Python or NumPy real number (int or float), not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, static: bool = False) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``.

    Args:
      name: the argument's name, as the caller knows it.
      value: the value to check.
      minimum, maximum: the allowed range (no maximum: unbounded).
      static: the argument is static under ``jax.jit`` (the message says so).
    """
    if not is_int(value):
        kind = "a static Python int" if static else "an int"
        raise TypeError(f"{name} must be {kind} >= {minimum}, got {type(value).__name__} {value!r}")
    as_int = operator.index(value)
    if maximum is not None and not minimum <= as_int <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value!r}")
    if as_int < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return as_int


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool (NumPy bools accepted)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def is_normal_float32(value: float) -> bool:
    """Whether ``value`` rounds to a positive, normal, finite float32 (in :data:`FLOAT32_RANGE`)."""
    # Compared in float64 first, so that the float32 cast can neither overflow nor warn.
    return 0 < value <= FLOAT32_MAX and float(np.float32(value)) >= FLOAT32_TINY


def check_positive(name: str, value: Any, *, optional: bool = False) -> float | None:
    """``value`` as a positive finite float (or None with ``optional``), normal and finite in float32.

    The thresholds checked here are applied in float32: a denormal one is flushed to zero by XLA
    and one above the float32 maximum becomes ``inf``, and either silently disables what it sets.
    """
    if value is None and optional:
        return None
    none = " or None" if optional else ""
    if not is_real(value):
        raise TypeError(f"{name} must be a number{none}, got {type(value).__name__} {value!r}")
    if not is_normal_float32(float(value)):
        raise ValueError(
            f"{name} must be a positive finite number{none}, got {value!r}; it is applied in float32, "
            f"so it must be in {FLOAT32_RANGE} (normal and finite in float32)"
        )
    return float(value)


def check_callable(name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__}")


def check_keywords(
    where: str, given: Iterable[str], known: Iterable[str], hints: Mapping[str, str] | None = None
) -> None:
    """Refuses a keyword ``where`` does not take, saying what to do instead (``hints``) or naming
    the nearest one it takes (``difflib``), rather than Python's bare "unexpected keyword".

    Example:
      >>> check_keywords("make_train_step", ["num_microbatche"], ["num_microbatches", "max_grad_norm"])
      Traceback (most recent call last):
      ...
      TypeError: make_train_step() got an unexpected keyword argument 'num_microbatche'; did you mean num_microbatches=?
    """
    known = tuple(known)
    for name in given:
        if name in known:
            continue
        hint = (hints or {}).get(name)
        if hint is None:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]}=?" if near else f"it takes {', '.join(f'{k}=' for k in known)}"
        raise TypeError(f"{where}() got an unexpected keyword argument {name!r}; {hint}")


def check_optimizer(value: Any, name: str = "optimizer") -> None:
    import optax  # only where an optimizer is checked

    if isinstance(value, optax.GradientTransformation):
        return
    if callable(getattr(value, "gradient_transformation", None)):  # optax.MultiSteps, given whole
        raise TypeError(
            f"{name} must be an optax.GradientTransformation, got {type(value).__name__}; pass its "
            f".gradient_transformation() (e.g. optax.MultiSteps(tx, every_k_schedule=4).gradient_transformation())"
        )
    raise TypeError(f"{name} must be an optax.GradientTransformation, got {type(value).__name__}")


def leaf_dtype(leaf: Any) -> np.dtype | None:
    """The dtype of an array-like leaf (arrays, NumPy and Python scalars), else None."""
    if hasattr(leaf, "dtype"):
        return np.dtype(leaf.dtype)
    if isinstance(leaf, (bool, int, float, complex)):
        return np.dtype(jnp.result_type(leaf))
    return None


def check_floating_tree(tree: Any, name: str, *, what: str = "floating-point arrays") -> None:
    """Every leaf of ``tree`` is a real floating array; the message names the first that is not."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        where = f"{name}{jax.tree_util.keystr(path)}"
        dtype = leaf_dtype(leaf)
        if dtype is None:
            raise TypeError(f"{where} is a {type(leaf).__name__}; expected {what}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{where} has dtype {dtype}; expected {what}")


def check_positive_int32(name: str, value: Any) -> int:
    """``value`` as a Python int in ``[1, 2**31 - 1]``: anything ``operator.index`` takes (a jax or
    NumPy integer scalar too), not a bool."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if not 1 <= as_int <= INT32_MAX:
        raise ValueError(f"{name} must be an int in [1, 2**31 - 1], got {value!r}")
    return as_int


def check_finite_float32(name: str, value: Any) -> float:
    """``value``, a real number finite in float32, rounded to float32 (the precision it is applied in)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    as_float = float(value)
    # Checked before the float32 cast so that the cast cannot overflow.
    if not math.isfinite(as_float) or abs(as_float) > FLOAT32_MAX:
        raise ValueError(f"{name} must be finite in float32 (|x| <= {FLOAT32_MAX:.7g}), got {value!r}")
    return float(np.float32(as_float))


def check_positive_float32_scalar(name: str, value: Any) -> jax.Array:
    """``value`` as a float32 scalar array; a concrete (not traced) value must be a normal, finite float32 > 0."""
    if np.shape(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    try:
        dtype = None if value is None else jnp.result_type(value)
    except TypeError:
        dtype = None
    if dtype is None or not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not isinstance(value, jax.core.Tracer):
        as_float = float(np.asarray(value, np.float64))
        if not is_normal_float32(as_float):
            raise ValueError(
                f"{name} must be finite and > 0 in float32, got {as_float!r}; expected a normal "
                f"float32 in {FLOAT32_RANGE} (XLA flushes a denormal to zero; a larger value is inf)"
            )
    return jnp.asarray(value, jnp.float32)


def check_bool_scalar(name: str, value: Any) -> jax.Array:
    """``value`` as a bool scalar array (traced or not)."""
    as_array = jnp.asarray(value)
    if as_array.dtype != jnp.bool_:
        raise TypeError(f"{name} must be a bool array, got dtype {as_array.dtype}")
    if as_array.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {as_array.shape}")
    return as_array


def check_scalar_output(name: str, value: Any, *, integer: bool = False, reduce: str = "jnp.mean") -> jax.Array:
    """A function's output ``value`` as a real floating (or, with ``integer``, integer) scalar array.

    Checked at trace time: shape and dtype are static even when the value is traced.
    """
    kind = "real" if integer else "real floating"
    if isinstance(value, (bool, np.bool_)) or not (hasattr(value, "dtype") or isinstance(value, (int, float))):
        raise TypeError(f"{name} must be a {kind} scalar, got {type(value).__name__}")
    if isinstance(value, int) and not integer:
        raise TypeError(f"{name} must be a {kind} scalar, got int")
    value = jnp.asarray(value)
    if not (jnp.issubdtype(value.dtype, jnp.floating) or integer and jnp.issubdtype(value.dtype, jnp.integer)):
        raise TypeError(f"{name} must be a {kind} scalar, got dtype {value.dtype}")
    if value.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {value.shape}; reduce it (e.g. {reduce})")
    return value


_MISSING = object()


def _child(tree: Any, keys: tuple[Any, ...]) -> Any:
    """The node of ``tree`` at the key path ``keys``, or ``_MISSING``."""
    for key in keys:
        try:
            if isinstance(key, jax.tree_util.SequenceKey):
                tree = tree[key.idx]
            elif isinstance(key, jax.tree_util.DictKey):
                tree = tree[key.key]
            elif isinstance(key, jax.tree_util.GetAttrKey):
                tree = getattr(tree, key.name)
            else:
                return _MISSING
        except (KeyError, IndexError, AttributeError, TypeError):
            return _MISSING
    return tree


def _is_array(node: Any) -> bool:
    return hasattr(node, "shape") and hasattr(node, "dtype") or is_real(node) or isinstance(node, (bool, complex))


def _signature(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(np.shape(leaf)), str(leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf))


def _describe(node: Any) -> str:
    if node is _MISSING:
        return "missing"
    if node is None:
        return "None"
    if _is_array(node):
        shape, dtype = _signature(node)
        what = f"{dtype}{list(shape)} array"
    else:
        what = type(node).__name__
    return f"{'an' if what[0].lower() in 'aeiou' else 'a'} {what}"


def _same_kind(a: Any, b: Any) -> bool:
    """Two nodes of one type; any two arrays (concrete, traced or abstract) are of one kind."""
    return (_is_array(a) and _is_array(b)) or type(a) is type(b)


def same_treedef(a: Any, b: Any) -> bool:
    """``a == b`` for two ``PyTreeDef`` s (typed Any: JAX's ``PyTreeDef`` is jaxlib's, which ships no type stubs)."""
    return bool(a == b)


def same_structure(tree: Any, other: Any) -> bool:
    """Whether two pytrees have the same structure: ``jax.tree.structure(tree) == jax.tree.structure(other)``."""
    return same_treedef(jax.tree.structure(tree), jax.tree.structure(other))


def tree_difference(tree: Any, reference: Any, name: str, reference_name: str) -> str | None:
    """Where ``tree`` first differs from ``reference`` in structure, leaf shape or leaf dtype; None: nowhere.

    Node types (``NamedTuple`` state classes, dicts, ``None``) count, weak types do not.

    Example:
      >>> tree_difference({"a": jnp.ones(2)}, {"a": jnp.ones(3)}, "x", "y")
      "x['a'] is a float32[2] array, y['a'] is a float32[3] array"
      >>> tree_difference((None,), (jnp.ones(1),), "x", "y")
      'x[0] is None, y[0] is a float32[1] array'
    """
    got, got_def = jax.tree_util.tree_flatten_with_path(tree)
    want, want_def = jax.tree_util.tree_flatten_with_path(reference)
    if same_treedef(got_def, want_def):
        for (path, leaf), (_, expected) in zip(got, want):
            if _signature(leaf) != _signature(expected):
                where = jax.tree_util.keystr(path)
                return f"{name}{where} is {_describe(leaf)}, {reference_name}{where} is {_describe(expected)}"
        return None
    # The first leaf path that differs leads to the first node that does; then every other path.
    got_paths, want_paths = [tuple(p) for p, _ in got], [tuple(p) for p, _ in want]
    first = next(
        (i for i, (a, b) in enumerate(zip(got_paths, want_paths)) if a != b), min(len(got_paths), len(want_paths))
    )
    candidates = want_paths[first : first + 1] + got_paths[first : first + 1] + want_paths + got_paths
    for path in candidates:
        for depth in range(len(path) + 1):
            a, b = _child(tree, path[:depth]), _child(reference, path[:depth])
            if a is _MISSING or b is _MISSING or not _same_kind(a, b):
                where = jax.tree_util.keystr(path[:depth])
                return f"{name}{where} is {_describe(a)}, {reference_name}{where} is {_describe(b)}"
    return f"{name} has the structure {str(got_def)[:300]}, {reference_name} has {str(want_def)[:300]}"
