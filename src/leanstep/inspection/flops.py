r"""FLOPs of a traced program, each loop body counted times its trip count.

:func:`count_flops` walks the program and every sub-program in it (``jit``, ``scan``,
``while``, ``cond``, ``remat2``, custom derivatives) and adds up, per equation:

.. code-block:: text

    dot_general   2 * prod(output shape) * prod(contracted sizes)
    convolution   2 * prod(output shape) * prod(kernel shape) / kernel out-features
    elementwise   prod(output shape)     (add, mul, tanh, exp, select_n, ...)
    reduction     prod(input shape)      (reduce_sum, argmax, cumsum, ...)
    scan          its body times its length
    cond          the most expensive branch
    while         its body once (the trip count is not known when tracing)
    anything else 0, plus its sub-programs

XLA's own ``cost_analysis()`` counts a while loop's body once, whatever its trip
count, so it cannot compare two microbatch counts; the count here can.
"""

from __future__ import annotations

import math
from typing import Any

from leanstep.common.jaxprs import (
    ELEMENTWISE_PRIMITIVES,
    MATMUL_PRIMITIVES,
    is_remat_primitive,
    matmul_flops,
    sub_jaxprs,
)

__all__ = ["ELEMENTWISE_PRIMITIVES", "REDUCTION_PRIMITIVES", "count_flops", "equation_flops"]

#: Primitives that cost one FLOP per input element.
REDUCTION_PRIMITIVES: frozenset[str] = frozenset(
    [
        "argmax",
        "argmin",
        "cumlogsumexp",
        "cummax",
        "cummin",
        "cumprod",
        "cumsum",
        "reduce_and",
        "reduce_max",
        "reduce_min",
        "reduce_or",
        "reduce_prod",
        "reduce_sum",
        "reduce_xor",
    ]
)


def _size(var: Any) -> int:
    return math.prod(getattr(var.aval, "shape", ()))


def equation_flops(eqn: Any) -> float:
    """FLOPs of one equation by itself, its sub-programs not included (see the module doc).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> eqn, = jax.make_jaxpr(jnp.matmul)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns
      >>> equation_flops(eqn)  # 2 * (2 * 4) * 3
      48.0
    """
    name = eqn.primitive.name
    if name in MATMUL_PRIMITIVES:
        return matmul_flops(eqn)
    if name in ELEMENTWISE_PRIMITIVES:
        return float(sum(_size(v) for v in eqn.outvars))
    if name in REDUCTION_PRIMITIVES:
        return float(sum(_size(v) for v in eqn.invars))
    return 0.0


def _jaxpr_flops(jaxpr: Any, dots_only: bool = False) -> float:
    flops = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        flops += equation_flops(eqn) if not dots_only or name in MATMUL_PRIMITIVES else 0.0
        subs = [sub for _, sub in sub_jaxprs(eqn)]
        if name == "scan":
            flops += eqn.params["length"] * _jaxpr_flops(subs[0], dots_only)
        elif name == "cond":
            flops += max(_jaxpr_flops(sub, dots_only) for sub in subs)
        elif is_remat_primitive(name):
            flops += _jaxpr_flops(subs[0], dots_only)
        else:
            for sub in subs:
                flops += _jaxpr_flops(sub, dots_only)
    return flops


def count_flops(closed_jaxpr: Any, *, dots_only: bool = False) -> float:
    """FLOPs of a traced program, each loop body counted times its trip count (see the module doc).

    Args:
      closed_jaxpr: a ``ClosedJaxpr`` or ``Jaxpr`` (``jax.make_jaxpr(f)(*args)``).
      dots_only: count matrix multiplies and convolutions (``dot_general``,
        ``conv_general_dilated``) only.

    Returns:
      The FLOP count, a float.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(w, x):
      ...     return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[0]
      >>> count_flops(jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4))))  # 3 * (2*2*4*4 + 2*4)
      216.0
    """
    return _jaxpr_flops(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), dots_only)
