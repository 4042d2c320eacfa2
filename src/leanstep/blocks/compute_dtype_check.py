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

from leanstep.common.jaxprs import MATMUL_PRIMITIVES, matmul_flops, weighted_equations

__all__ = ["PrecisionWarning", "unused_compute_dtype"]


class PrecisionWarning(UserWarning):
    """The compute dtype of a precision policy is not what the model computes in."""


def unused_compute_dtype(fn: Callable[..., Any], args: tuple[Any, ...], compute_dtype: Any) -> str | None:
    """A message when ``compute_dtype`` is below float32 and a matmul or convolution of ``fn(*args)``
    does not run in it, else None.

    A matmul runs in the compute dtype when each operand is in it or narrower (FP8); one wider
    operand (bf16 x float32) makes it run in float32. The message
    names how many do not, by operand dtypes, and their share of the FLOPs of the
    matmuls and convolutions (a scan's body counted times its length), so that one float32
    matmul a model keeps on purpose (a loss head) reads as the small share it is.

    Args:
      fn: the loss function; traced with ``jax.make_jaxpr`` (``args`` may be abstract).
      args: its arguments.
      compute_dtype: the policy's compute dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.ones((2, 2), jnp.bfloat16)
      >>> print(unused_compute_dtype(lambda w: jnp.sum(w.astype(jnp.float32) @ w.astype(jnp.float32)),
      ...                            (w,), jnp.bfloat16))
      compute dtype bfloat16, but none of the loss's 1 matmuls and convolutions runs in it (float32 x float32: 1, 100.0% of their FLOPs): ...
      >>> unused_compute_dtype(lambda w: jnp.sum(w @ w), (w,), jnp.bfloat16) is None
      True
    """
    compute_dtype = np.dtype(compute_dtype)
    if compute_dtype.itemsize >= 4:
        return None
    jaxpr = jax.make_jaxpr(fn)(*args)
    counts: collections.Counter[tuple[str, ...]] = collections.Counter()
    flops: collections.defaultdict[tuple[str, ...], float] = collections.defaultdict(float)
    for eqn, times in weighted_equations(jaxpr):
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            kind = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
            counts[kind] += 1
            flops[kind] += matmul_flops(eqn) * times
    # A matmul whose every operand is in the compute dtype, or narrower (FP8), is what the policy
    # asked for. One wider operand makes the product run in its dtype (bf16 x float32 computes in
    # float32), as the audit and verify's compute_dtype check count it.
    in_compute = lambda name: name == compute_dtype.name or np.dtype(name).itemsize < compute_dtype.itemsize
    off = {kind: n for kind, n in counts.items() if not all(in_compute(name) for name in kind)}
    if not off:
        return None
    total = sum(flops.values()) or 1.0
    found = ", ".join(
        f"{' x '.join(kind)}: {n}, {100 * flops[kind] / total:.1f}% of their FLOPs"
        for kind, n in sorted(off.items(), key=lambda kv: -flops[kv[0]])
    )
    how_many = "none" if len(off) == len(counts) and sum(off.values()) == sum(counts.values()) else None
    head = (
        f"none of the loss's {sum(counts.values())} matmuls and convolutions runs in it"
        if how_many
        else f"{sum(off.values())} of the loss's {sum(counts.values())} matmuls and convolutions do not run in it"
    )
    return (
        f"compute dtype {compute_dtype.name}, but {head} ({found}): the model casts their inputs back up. "
        "The usual causes: a framework dtype= argument (e.g. flax.linen.Dense(dtype=jnp.float32)): build "
        "the model with the compute dtype (dtype=jnp.bfloat16; dtype=None lets flax layers follow their "
        "inputs, but in model code that calls x.astype(dtype), as flax's lm1b does, None means float32); "
        "a float32 model state (batch statistics) that promotes what follows it; or an explicit "
        "astype(jnp.float32) in the model"
    )
