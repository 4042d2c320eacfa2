"""Where the sub-programs of a jaxpr equation live, for the modules that walk or rewrite programs.

A higher-order primitive keeps the programs it runs in its parameters: ``jit`` in ``jaxpr``,
``scan`` in ``jaxpr``, ``while`` in ``cond_jaxpr`` and ``body_jaxpr``, ``cond`` in the tuple
``branches``, ``jax.checkpoint`` (``remat2``) in an open ``jaxpr``, custom derivatives in
``call_jaxpr``. One rule finds them all, whatever the primitive:

.. code-block:: text

    a parameter value, or an item of a tuple/list value, is a sub-program
        if it has equations (an open Jaxpr) or holds a .jaxpr that has them (a ClosedJaxpr)

:mod:`leanstep.inspection.auditing` and :mod:`leanstep.inspection.flops` walk the sub-programs with
:func:`sub_jaxprs`; :mod:`leanstep.blocks.rounding` rebuilds them with :func:`map_sub_jaxprs`. The
names here have no leading underscore: the module is private, its functions are shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "ELEMENTWISE_PRIMITIVES",
    "MATMUL_PRIMITIVES",
    "OPTIMIZER_UPDATE_SCOPE",
    "equations",
    "is_remat_primitive",
    "is_sub_jaxpr",
    "map_sub_jaxprs",
    "matmul_flops",
    "scan_operands",
    "sub_jaxprs",
    "weighted_equations",
]

#: Primitives computed entry by entry at one FLOP an output element (the FLOP count's and the
#: chunked update's dependence analysis read this one list).
ELEMENTWISE_PRIMITIVES: frozenset[str] = frozenset(
    [
        "abs",
        "acos",
        "acosh",
        "add",
        "add_any",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "cos",
        "cosh",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "igamma",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "or",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "sub",
        "tan",
        "tanh",
        "xor",
    ]
)

#: The primitives a tensor core or a CPU's matrix units run: matmuls and convolutions.
MATMUL_PRIMITIVES: tuple[str, ...] = ("dot_general", "conv_general_dilated")

#: The ``jax.named_scope`` leanstep's step applies its optimizer in: the scans and matmuls under it
#: are the optimizer's (8-bit moments' searches, chunked updates, Muon's Newton-Schulz loops), not
#: the microbatch loop's, which is how the audit tells them apart.
OPTIMIZER_UPDATE_SCOPE = "leanstep_optimizer_update"


def is_sub_jaxpr(value: Any) -> bool:
    """Whether a parameter value (or an item of one) is a program: an open or a closed jaxpr."""
    return hasattr(getattr(value, "jaxpr", value), "eqns")


def sub_jaxprs(eqn: Any) -> Iterator[tuple[str, Any]]:
    """``(param name, open jaxpr)`` for every sub-program of an equation, in parameter order.

    Example:
      >>> import jax
      >>> jaxpr = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jax.numpy.sin, jax.numpy.cos, x))(1.0)
      >>> eqn = jaxpr.eqns[-1]  # the cond
      >>> [(key, type(jaxpr).__name__) for key, jaxpr in sub_jaxprs(eqn)]
      [('branches', 'Jaxpr'), ('branches', 'Jaxpr')]
    """
    for key, value in eqn.params.items():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if is_sub_jaxpr(item):
                yield key, getattr(item, "jaxpr", item)


def scan_operands(eqn: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """A ``scan`` equation's operands split as ``(consts, carry, xs)``, on every JAX leanstep runs on.

    JAX 0.10 and earlier keep the split as the counts ``num_consts`` and ``num_carry``; JAX
    0.11 as ``ft_in``, a flat tree of the three groups.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> w = jnp.ones(2)
      >>> jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x * w, None), c, xs))(w, jnp.ones((3, 2)))
      >>> [[v.aval.shape for v in group] for group in scan_operands(jaxpr.eqns[0])]
      [[(2,)], [(2,)], [(3, 2)]]
    """
    params, operands = eqn.params, list(eqn.invars)
    if "num_consts" in params:
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    else:
        consts, carry, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    return operands[:num_consts], operands[num_consts : num_consts + num_carry], operands[num_consts + num_carry :]


def map_sub_jaxprs(params: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A copy of ``params`` with every sub-program ``p`` (as stored: open or closed) replaced by ``fn(p)``.

    Tuple and list values that hold sub-programs are rebuilt with the replacements; every other
    value is kept as is.

    Example:
      >>> import jax
      >>> jaxpr = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jax.numpy.sin, jax.numpy.cos, x))(1.0)
      >>> eqn = jaxpr.eqns[-1]  # the cond
      >>> new = map_sub_jaxprs(eqn.params, lambda closed: len(closed.jaxpr.eqns))
      >>> new["branches"]
      (1, 1)
    """
    out = dict(params)
    for key, value in params.items():
        if isinstance(value, (tuple, list)):
            if any(is_sub_jaxpr(item) for item in value):
                out[key] = type(value)(fn(item) if is_sub_jaxpr(item) else item for item in value)
        elif is_sub_jaxpr(value):
            out[key] = fn(value)
    return out


def is_remat_primitive(name: str) -> bool:
    """Whether a primitive name is a ``jax.checkpoint`` region (``remat2``, its relatives, ``checkpoint``)."""
    return name.startswith("remat") or name == "checkpoint"


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr and of its sub-programs, depth first.

    Example:
      >>> import jax
      >>> jaxpr = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jax.numpy.sin, jax.numpy.cos, x))(1.0)
      >>> [eqn.primitive.name for eqn in equations(jaxpr)]
      ['gt', 'convert_element_type', 'cond', 'cos', 'sin']
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for _, sub in sub_jaxprs(eqn):
            yield from equations(sub)


def matmul_flops(eqn: Any) -> float:
    r"""FLOPs of one matmul or convolution equation (0 for any other).

    .. code-block:: text

        dot_general           2 * prod(out shape) * prod(contracted sizes)
        conv_general_dilated  2 * prod(out shape) * prod(kernel shape) / kernel out-features

    A convolution's output element sums ``in_features / groups x kernel window`` products:
    the kernel's size less its output-feature dimension (its ``rhs_spec[0]``). That holds for
    the weight- and input-gradient convolutions JAX's transpose rules emit, whose "kernel"
    is the other operand.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
      ...                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
      >>> eqn, = jax.make_jaxpr(conv)(jnp.ones((1, 8, 8, 3)), jnp.ones((3, 3, 3, 16))).eqns
      >>> matmul_flops(eqn)  # 2 * (8 * 8 * 16) * (3 * 3 * 3)
      55296.0
    """
    name = eqn.primitive.name
    out = math.prod(eqn.outvars[0].aval.shape)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs_shape[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        kernel = eqn.invars[1].aval.shape
        out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out * math.prod(kernel) / out_features
    return 0.0


def weighted_equations(jaxpr: Any, multiplier: float = 1.0) -> Iterator[tuple[Any, float]]:
    """``(equation, times it runs)`` for every equation of a program and its sub-programs.

    A scan's body runs ``length`` times; everything else once (a while loop's trip count is
    not known when tracing; each branch of a cond counts once).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jaxpr = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, length=5)[0])(1.0)
      >>> [(eqn.primitive.name, n) for eqn, n in weighted_equations(jaxpr)]
      [('scan', 1.0), ('sin', 5.0)]
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn, multiplier
        inner = multiplier * eqn.params["length"] if eqn.primitive.name == "scan" else multiplier
        for _, sub in sub_jaxprs(eqn):
            yield from weighted_equations(sub, inner)
