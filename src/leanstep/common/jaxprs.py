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

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["equations", "is_remat_primitive", "is_sub_jaxpr", "map_sub_jaxprs", "sub_jaxprs"]


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
