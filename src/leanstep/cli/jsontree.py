"""JSON <-> pytree conversion in the seed contracts' form.

The seeds' rule: a JSON object is a dict node; a JSON list whose items are all
objects is a list node; any other list, or a number, is one array leaf. Output
floats are rounded to 6 decimals (huge ones are written as the shortest decimal
that round-trips their float32 value).

Every input number must stay finite in float32 (``|x| <= 3.4028235e+38`` after rounding); one
that underflows becomes 0, as rounding makes it. Nesting is bounded (:data:`MAX_ARRAY_DIMS`,
:data:`MAX_TREE_DEPTH`) so that no check recurses past Python's stack.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np


class InputError(ValueError):
    """Bad CLI input; its message is printed as one line and the CLI exits with 2."""


class DuplicateKeyError(ValueError):
    """A JSON object names a key twice (json.loads would keep the last silently)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object as a dict, refusing a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"the JSON key {key!r} appears twice in one object; give each key once")
        out[key] = value
    return out


#: The smallest positive normal float32. XLA flushes smaller (subnormal) values to 0.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
#: How messages write them: the shortest decimals that round-trip in float32.
FLOAT32_MAX_TEXT, FLOAT32_TINY_TEXT = str(np.finfo(np.float32).max), str(np.finfo(np.float32).tiny)
#: The least magnitude that rounds to inf in float32: the midpoint between the largest finite
#: value and 2**128, which round-half-to-even sends up.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103
#: Arrays deeper than this are refused (NumPy itself stops at 64 dimensions).
MAX_ARRAY_DIMS = 32
#: Dicts and lists of dicts nested deeper than this are refused.
MAX_TREE_DEPTH = 32


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def describe(value: Any) -> str:
    """``value`` for an error message: short, one line, and safe for integers of any size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        digits = len(str(value).lstrip("-")) if value.bit_length() < 10_000 else int(math.log10(abs(value))) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _in_float32(value: float) -> bool:
    # Exact for ints of any size.
    return -_FLOAT32_OVERFLOW < value < _FLOAT32_OVERFLOW


def float32_number(value: Any, where: str) -> float:
    """``value``, a decoded JSON number that is to become a float32, checked and as a Python float.

    Values that underflow (nonzero but below float32's subnormals) round to 0 like any other
    rounding to float32; callers for which 0 is invalid check :data:`FLOAT32_TINY` themselves.

    Raises:
      InputError: ``value`` is not a number (bools are not), is NaN or infinite, or rounds to
        infinity in float32 (its magnitude is past ``3.4028235e+38``).
    """
    if not _is_number(value):
        raise InputError(f"{where}: expected a number, got {type(value).__name__} {describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{where}: expected finite numbers, got {value!r}")
    # Checked again as a float: an int just below the bound can round up to it on the way.
    if not (_in_float32(value) and _in_float32(float(value))):
        raise InputError(f"{where}: {describe(value)} is outside float32's range (|x| <= {FLOAT32_MAX_TEXT})")
    return float(value)


def _array_shape(value: Any, where: str, dims: int) -> tuple[int, ...]:
    """The shape of ``value``, a number or a rectangular nested list of numbers, all checked."""
    if _is_number(value):
        float32_number(value, where)
        return ()
    if not isinstance(value, list):
        raise InputError(
            f"{where}: expected a number or a nested list of numbers, got {type(value).__name__} {describe(value)}"
        )
    if dims == MAX_ARRAY_DIMS:
        raise InputError(
            f"{where}: lists nest deeper than {MAX_ARRAY_DIMS}; expected an array of at most "
            f"{MAX_ARRAY_DIMS} dimensions"
        )
    shape = None
    for i, item in enumerate(value):
        item_shape = _array_shape(item, f"{where}[{i}]", dims + 1)
        if shape is None:
            shape = item_shape
        elif item_shape != shape:
            raise InputError(f"{where}: rows of different lengths; expected a rectangular array")
    return (len(value), *(shape or ()))


def tree_from_json(value: Any, where: str, *, depth: int = 0) -> Any:
    """Converts a decoded JSON value to a pytree of float32 NumPy arrays by the seeds' rule.

    Every number must be finite in float32 (see :func:`float32_number`); arrays have at most
    :data:`MAX_ARRAY_DIMS` dimensions and trees at most :data:`MAX_TREE_DEPTH` levels, so
    neither the checks nor the task recurse without bound.

    Args:
      value: the decoded JSON value.
      where: the name of the value, used in error messages (``"params['w']"``).
      depth: how many tree levels lie above ``value``.

    Returns:
      Dicts and lists of ``np.ndarray`` leaves.

    Raises:
      InputError: a leaf is not a rectangular array of numbers finite in float32, or the tree or
        an array nests too deeply.
    """
    is_node = isinstance(value, dict) or (
        isinstance(value, list) and value and all(isinstance(item, dict) for item in value)
    )
    if is_node and depth == MAX_TREE_DEPTH:
        raise InputError(f"{where}: the tree nests deeper than {MAX_TREE_DEPTH} levels")
    if isinstance(value, dict):
        return {key: tree_from_json(item, f"{where}[{key!r}]", depth=depth + 1) for key, item in value.items()}
    if is_node:
        return [tree_from_json(item, f"{where}[{i}]", depth=depth + 1) for i, item in enumerate(value)]
    _array_shape(value, where, 0)
    return np.asarray(value, dtype=np.float32)


def _float_out(value: float) -> float:
    if abs(value) < 1e15:
        rounded = round(value, 6)
    else:
        # No decimals to round here: the shortest repr of the float32 value (1.5e+38, not 1.5000000079e+38).
        rounded = float(str(np.float32(value)))
    return 0.0 if rounded == 0 else rounded


def _leaf_out(leaf: Any) -> Any:
    array = np.asarray(leaf)
    if array.dtype == np.bool_:
        return array.tolist()
    if np.issubdtype(array.dtype, np.integer):
        return array.tolist()
    if array.ndim == 0:
        return _float_out(float(array))
    return [_leaf_out(row) for row in array]


def tree_to_json(tree: Any) -> Any:
    """Converts a pytree of arrays (dicts, lists, tuples) to plain JSON values."""
    if isinstance(tree, dict):
        return {key: tree_to_json(item) for key, item in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [tree_to_json(item) for item in tree]
    return _leaf_out(tree)


def dumps(value: Any) -> str:
    """One line of JSON with finite floats; non-finite floats are written as JSON strings."""
    return json.dumps(replace_non_finite(value), separators=(", ", ": "))


def write_json_or_print(path: Any, result: Any, log: Any) -> str | None:
    """Writes ``result`` as indented strict JSON to ``path`` atomically; if that fails, prints the
    JSON on stdout (every number, where the user can still save it) and returns what failed."""
    from leanstep.common.outputs import write_bytes_atomic

    text = json.dumps(replace_non_finite(result), indent=2) + "\n"
    try:
        write_bytes_atomic(path, text.encode("utf-8"))
    except OSError as error:
        sys.stdout.write(text)
        return f"--json {str(path)!r} ({error.strerror or error})"
    log(f"JSON written to {path}")
    return None


def replace_non_finite(value: Any) -> Any:
    """``value`` with every non-finite float as its string (``"nan"``, ``"inf"``), tuples as lists:
    what strict JSON can hold.

    Example:
      >>> replace_non_finite({"a": [1.0, float("nan")], "b": (float("-inf"),)})
      {'a': [1.0, 'nan'], 'b': ['-inf']}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: replace_non_finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [replace_non_finite(item) for item in value]
    return value


def mismatch(actual: Any, expected: Any, where: str = "output") -> float:
    """The largest difference between two JSON values of the same structure, in units.

    The unit is the 6th decimal, or a float32 ulp where a float32 has no 6th
    decimal (past about 8e6): values that agree "to 6 decimals" give at most 1.

    Raises:
      InputError: the structures or types differ.
    """
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            raise InputError(f"{where}: keys differ")
        return max((mismatch(actual[k], expected[k], f"{where}[{k!r}]") for k in expected), default=0.0)
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            raise InputError(f"{where}: lengths differ")
        return max((mismatch(a, e, f"{where}[{i}]") for i, (a, e) in enumerate(zip(actual, expected))), default=0.0)
    if isinstance(expected, bool) or isinstance(actual, bool):
        return 0.0 if actual == expected else math.inf
    return abs(float(actual) - float(expected)) / max(1e-6, abs(float(expected)) * 2.0**-23)
