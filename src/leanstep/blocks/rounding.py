r"""Strict low-precision rounding: every bfloat16/float16 result rounded, forward and backward.

:func:`strict_precision` makes a function compute as if every bfloat16/float16
operation result, forward and backward, were rounded to its dtype -- which XLA
does not promise by default (``xla_allow_excess_precision=true`` lets a compiled
bf16 op whose result is cast to float32 skip the bf16 rounding). It traces the
function and re-evaluates the program with every low-precision value
:math:`y` replaced by

.. math::
    \mathrm{round}(y) = \texttt{lax.reduce\_precision}(y,\ e,\ m), \qquad
    (e, m) = (8, 7) \text{ for bf16},\ (5, 10) \text{ for f16}.

:class:`leanstep.blocks.precision.Precision` applies it with ``strict=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import source_info_util  # no public API keeps an equation's name stack
from jax.extend import core as jex_core

from leanstep.common.jaxprs import map_sub_jaxprs

__all__ = ["strict_precision"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_ROUND_BITS = {jnp.dtype(d): (jnp.finfo(d).nexp, jnp.finfo(d).nmant) for d in (jnp.bfloat16, jnp.float16)}
# Sub-programs rebuilt with rounding inside; any other higher-order primitive runs as-is.
_REBUILT = ("scan", "while", "cond", "remat2")


def _round(x: Any) -> Any:
    bits = _ROUND_BITS.get(getattr(x, "dtype", None))
    if bits is None:
        return x
    return lax.reduce_precision(x, exponent_bits=bits[0], mantissa_bits=bits[1])


def _rounded_closed_jaxpr(closed: jex_core.ClosedJaxpr) -> jex_core.ClosedJaxpr:
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: _eval_rounded(closed.jaxpr, closed.consts, xs))(*specs)


def _rounded_sub_jaxpr(sub: Any) -> Any:
    """The rounded version of a sub-program, stored the way it came (closed, or open for remat2)."""
    if isinstance(sub, jex_core.ClosedJaxpr):
        return _rounded_closed_jaxpr(sub)
    # remat2 keeps an open jaxpr. It is re-bound rather than re-applied with jax.checkpoint so
    # that `differentiated=True` (which blocks CSE of the recomputation) survives.
    rounded = _rounded_closed_jaxpr(jex_core.ClosedJaxpr(sub, ()))
    if rounded.consts:
        raise NotImplementedError("strict_precision: checkpointed jaxpr gained constants")
    return rounded.jaxpr


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Evaluates one equation, rounding inside the sub-programs it runs."""
    params, name = dict(eqn.params), eqn.primitive.name
    if name in ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
        # Inlined: the call boundary does not change values, and custom rules
        # are not needed here because first-order derivatives come from
        # jax.vjp of the original program, which applies them.
        sub = params["jaxpr" if name in ("jit", "pjit") else "call_jaxpr"]
        return _eval_rounded(sub.jaxpr, sub.consts, invals)
    if name in _REBUILT:  # scan's body, while's cond and body, cond's branches, remat2's body
        params = map_sub_jaxprs(params, _rounded_sub_jaxpr)
    # Anything else (custom calls, shard_map, pallas_call, ...) runs as-is;
    # only its outputs are rounded.
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return outs if eqn.primitive.multiple_results else [outs]


def _eval_rounded(jaxpr: jex_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``eval_jaxpr`` that rounds every bf16/f16 input and equation result."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, map(_round, args)))

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, jex_core.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        # Each equation keeps its name stack (as jax.core.eval_jaxpr does): the audit and the
        # planner find FP8 matmuls, and place every matmul, by it.
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = _bind(eqn, [read(a) for a in eqn.invars])
        env.update(zip(eqn.outvars, map(_round, outs)))
    return [read(a) for a in jaxpr.outvars]


def _trace_rounded(fn: Callable[..., T], *args: Any) -> T:
    """Traces ``fn(*args)`` and evaluates the program with rounding."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs = _eval_rounded(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _strict_call(closed: jex_core.ClosedJaxpr, args: list[Any]) -> list[Any]:
    # Closed-over tracers (outer jit/grad values) become explicit inputs so the
    # custom_vjp below can differentiate with respect to them.
    hoist = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    inputs = args + [c for c, h in zip(closed.consts, hoist) if h]
    num_args = len(args)
    in_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in inputs]
    out_float = [jnp.issubdtype(a.dtype, jnp.inexact) for a in closed.out_avals]

    def consts_of(hoisted: Sequence[Any]) -> list[Any]:
        it = iter(hoisted)
        return [next(it) if h else c for c, h in zip(closed.consts, hoist)]

    @jax.custom_vjp
    def call(*xs: Any) -> list[Any]:
        return _eval_rounded(closed.jaxpr, consts_of(xs[num_args:]), xs[:num_args])

    def primal_and_vjp(*xs: Any) -> tuple[list[Any], Any]:
        def float_outputs(*float_xs: Any) -> tuple[list[Any], list[Any]]:
            it = iter(float_xs)
            full = [next(it) if f else x for x, f in zip(xs, in_float)]
            outs = jax.core.eval_jaxpr(closed.jaxpr, consts_of(full[num_args:]), *full[:num_args])
            return ([o for o, f in zip(outs, out_float) if f], [o for o, f in zip(outs, out_float) if not f])

        float_outs, vjp_fn, other_outs = jax.vjp(float_outputs, *[x for x, f in zip(xs, in_float) if f], has_aux=True)
        fl, ot = iter(float_outs), iter(other_outs)
        return [next(fl) if f else next(ot) for f in out_float], vjp_fn

    def fwd(*xs: Any) -> tuple[list[Any], Any]:
        # The whole linearized forward (primal plus residual arithmetic that
        # JVP rules add) is traced and rounded, not just the primal ops.
        return _trace_rounded(primal_and_vjp, *xs)

    def bwd(vjp_fn: Any, cts: list[Any]) -> tuple[Any, ...]:
        float_cts = [c for c, f in zip(cts, out_float) if f]
        in_cts = iter(_trace_rounded(lambda v, c: v(c), vjp_fn, float_cts))
        return tuple(next(in_cts) if f else None for f in in_float)

    call.defvjp(fwd, bwd)
    return call(*inputs)


def strict_precision(fn: F) -> F:
    r"""Makes ``fn`` round every bfloat16/float16 result, forward and backward.

    XLA keeps excess precision by default: compiled, a bf16 ``dot`` or ``add``
    whose result is cast to float32 may skip its bf16 rounding, so a jitted
    function differs from the same function run op by op. The wrapper traces
    ``fn`` and re-evaluates the program so that every bf16/f16 input and
    operation result :math:`y` becomes

    .. math::
        \mathrm{round}(y) = \texttt{lax.reduce\_precision}(y,\ e,\ m), \qquad
        (e, m) = (8, 7) \text{ for bf16},\ (5, 10) \text{ for f16},

    also inside ``scan``, ``while``, ``cond`` and ``jax.checkpoint`` bodies
    (re-bound, so remat policies survive) and inlined ``jit``, ``custom_jvp``
    and ``custom_vjp`` bodies. Other higher-order primitives (``shard_map``,
    ``pallas_call``, ...) run as they are, with only their outputs rounded.
    The gradient is a ``jax.custom_vjp`` whose forward is the rounded
    ``jax.vjp`` program of ``fn`` and whose backward is the rounded cotangent
    program, so every backward operation is rounded too -- cotangent sums and
    the arithmetic inside JVP rules included -- and custom derivative rules
    inside ``fn`` are honoured. Results then equal op-by-op execution up to the
    accumulation order inside single operations (dots, reductions) and float32
    reassociation outside low-precision operations.

    One limit, float16 on a CPU with AVX512-FP16 (a Sapphire Rapids Xeon): XLA:CPU
    drops a float16 ``reduce_precision`` to float16's own bits as a no-op and then
    computes a fused chain such as ``exp(x * y + 1)`` without rounding in between
    (an optimization barrier or an integer bitcast round trip is dropped too), so
    such results can be a few float16 ulps off op-by-op execution there (2 in
    ``tests/test_rounding.py``'s float16 forward, up to 8, 0.46% relative, in its
    gradient). bfloat16, and float16 elsewhere, are exact as above.

    Array leaves of the arguments are traced; other leaves (Python scalars,
    strings, ``None``) are static. Outputs must be arrays. Each call retraces
    ``fn``; under ``jax.jit`` that happens once per compilation.

    Args:
      fn: the function to wrap.

    Returns:
      A function with ``fn``'s signature and the strict semantics. It works
      under ``jax.jit``, ``jax.grad``/``jax.vjp`` (higher orders and
      ``jax.hessian`` differentiate the rounded programs as usual),
      ``jax.vmap``, ``lax.scan`` and ``jax.checkpoint``.

    Raises:
      TypeError: from JAX, when forward mode (``jax.jvp``, ``jax.jacfwd``) is
        applied to the wrapped function itself, as for any ``custom_vjp``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from leanstep.blocks.rounding import strict_precision
      >>> def f(a, b):
      ...     s = a.astype(jnp.bfloat16) * b.astype(jnp.bfloat16) + jnp.bfloat16(1)
      ...     return s.astype(jnp.float32)
      >>> a = b = jnp.float32(1.1)
      >>> print(jax.jit(f)(a, b))  # the bf16 add result escapes unrounded
      2.2109375
      >>> print(jax.jit(strict_precision(f))(a, b))
      2.21875
      >>> with jax.disable_jit():
      ...     print(f(a, b))  # op by op
      2.21875
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]

        def flat_fn(*arrays: Any) -> Any:
            it = iter(arrays)
            call_args, call_kwargs = jax.tree.unflatten(
                treedef, [next(it) if a else x for x, a in zip(leaves, is_array)]
            )
            return fn(*call_args, **call_kwargs)

        arrays = [x for x, a in zip(leaves, is_array) if a]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
        outs = _strict_call(closed, arrays)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped  # type: ignore[return-value]
