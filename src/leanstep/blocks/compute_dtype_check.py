"""Is the compute dtype really used? bf16 that a model silently undoes, found at trace time.

A policy's ``compute=bfloat16`` casts the parameters and the batch; a model that casts them
back (a Flax ``dtype=jnp.float32`` argument, an explicit ``astype(jnp.float32)``) then runs
every matmul in float32 and nothing says so. :func:`unused_compute_dtype` traces the loss
(nothing runs) and looks at the operand dtypes of every matmul and convolution.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from leanstep.common.jaxprs import equations

__all__ = ["PrecisionWarning", "unused_compute_dtype"]

_MATMULS = ("dot_general", "conv_general_dilated")


class PrecisionWarning(UserWarning):
    """The compute dtype of a precision policy is not what the model computes in."""


def unused_compute_dtype(fn: Callable[..., Any], args: tuple[Any, ...], compute_dtype: Any) -> str | None:
    """A message when ``compute_dtype`` is below float32 and no matmul of ``fn(*args)`` uses it, else None.

    Args:
      fn: the loss function; traced with ``jax.make_jaxpr`` (``args`` may be abstract).
      args: its arguments.
      compute_dtype: the policy's compute dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.ones((2, 2), jnp.bfloat16)
      >>> print(unused_compute_dtype(lambda w: jnp.sum(w.astype(jnp.float32) @ w.astype(jnp.float32)),
      ...                            (w,), jnp.bfloat16))
      compute dtype bfloat16, but none of the loss's 1 matmuls runs in it (float32 x float32: 1): ...
      >>> unused_compute_dtype(lambda w: jnp.sum(w @ w), (w,), jnp.bfloat16) is None
      True
    """
    compute_dtype = np.dtype(compute_dtype)
    if compute_dtype.itemsize >= 4:
        return None
    jaxpr = jax.make_jaxpr(fn)(*args)
    kinds = collections.Counter(
        tuple(str(v.aval.dtype) for v in eqn.invars[:2]) for eqn in equations(jaxpr) if eqn.primitive.name in _MATMULS
    )
    if not kinds or any(compute_dtype.name in kind for kind in kinds):
        return None
    found = ", ".join(f"{' x '.join(kind)}: {count}" for kind, count in kinds.most_common())
    return (
        f"compute dtype {compute_dtype.name}, but none of the loss's {sum(kinds.values())} matmuls runs in it "
        f"({found}): the model casts its inputs back up. The usual cause is a framework dtype= argument "
        "(e.g. flax.linen.Dense(dtype=jnp.float32)); build the model with dtype=None or the compute dtype"
    )
