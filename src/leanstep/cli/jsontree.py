"""JSON <-> pytree conversion in the seed contracts' form.

The seeds' rule: a JSON object is a dict node; a JSON list whose items are all
objects is a list node; any other list, or a number, is one array leaf. Output
floats are rounded to 6 decimals (huge ones are written as the shortest decimal
that round-trips their float32 value).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


class InputError(ValueError):
    """Bad CLI input; its message is printed as one line and the CLI exits with 2."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rectangular(value: Any, where: str) -> None:
    """Raises InputError unless ``value`` is a number or a rectangular nested list of numbers."""
    if _is_number(value):
        if not math.isfinite(value):
            raise InputError(f"{where}: expected finite numbers, got {value!r}")
        return
    if not isinstance(value, list):
        raise InputError(
            f"{where}: expected a number or a nested list of numbers, got {type(value).__name__} {value!r}"
        )
    for i, item in enumerate(value):
        _check_rectangular(item, f"{where}[{i}]")
    shapes = {np.shape(item) for item in value}
    if len(shapes) > 1:
        raise InputError(f"{where}: rows of different lengths; expected a rectangular array")


def tree_from_json(value: Any, where: str, dtype: Any = np.float32) -> Any:
    """Converts a decoded JSON value to a pytree of NumPy arrays by the seeds' rule.

    Args:
      value: the decoded JSON value.
      where: the name of the value, used in error messages (``"params['w']"``).
      dtype: the dtype of every array leaf.

    Returns:
      Dicts and lists of ``np.ndarray`` leaves.

    Raises:
      InputError: a leaf is not a rectangular array of finite numbers.
    """
    if isinstance(value, dict):
        return {key: tree_from_json(item, f"{where}[{key!r}]", dtype) for key, item in value.items()}
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return [tree_from_json(item, f"{where}[{i}]", dtype) for i, item in enumerate(value)]
    _check_rectangular(value, where)
    return np.asarray(value, dtype=dtype)


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
    return json.dumps(_replace_non_finite(value), separators=(", ", ": "))


def _replace_non_finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _replace_non_finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace_non_finite(item) for item in value]
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
