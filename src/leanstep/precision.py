"""Mixed-precision policies and strict low-precision rounding.

:class:`Precision` says which dtype parameters, computation and outputs use
(jmp's ``Policy``, plus a ``strict`` flag). :func:`strict_precision` makes a
function compute as if every bfloat16/float16 operation result, forward and
backward, were rounded to its dtype -- which XLA does not promise by default
(``xla_allow_excess_precision=true`` lets a compiled bf16 op whose result is
cast to float32 skip the bf16 rounding).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

__all__ = ["Precision", "get_precision", "strict_precision"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
# jmp's names (jmp/_src/policy.py ``dtype_to_names``), first one canonical.
# jmp maps "half" to bfloat16 on TPU and float16 elsewhere; here it is always
# float16 so a spec string means the same thing on every backend.
_DTYPE_NAMES = {
    jnp.dtype(jnp.float16): ("float16", "f16", "half"),
    jnp.dtype(jnp.bfloat16): ("bfloat16", "bf16"),
    jnp.dtype(jnp.float32): ("float32", "f32", "full"),
    jnp.dtype(jnp.float64): ("float64", "f64"),
}
_NAME_TO_DTYPE = {name: d for d, names in _DTYPE_NAMES.items() for name in names}
_KEY_TO_FIELD = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype",
                 "compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}
_ROUND_BITS = {jnp.dtype(d): (jnp.finfo(d).nexp, jnp.finfo(d).nmant)
               for d in (jnp.bfloat16, jnp.float16)}


def _check_float_dtype(name: str, value: Any) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} is not a dtype; expected one of "
                        f"{[d.name for d in _FLOAT_DTYPES]}") from e
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}={dtype.name} is not supported; expected one of "
                         f"{[d.name for d in _FLOAT_DTYPES]}")
    return dtype


def _cast_floating(tree: T, dtype: np.dtype) -> T:
    def cast(x: Any) -> Any:
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Precision:
    r"""Which dtype parameters, computation and outputs use (a static setting).

    .. math::
        \mathrm{cast}_X(\theta) = \mathrm{tree\_map}\big(\ell \mapsto
        \ell.\mathrm{astype}(X) \text{ if } \ell \text{ is a real floating array else } \ell,\ \theta\big)

    Only real floating leaves (float16/bfloat16/float32/float64 arrays) are
    cast. Integer, boolean and complex leaves and non-array leaves (Python
    scalars, ``None``) pass through unchanged -- as in jmp; there is no complex
    bfloat16 to cast to.

    Args:
      param_dtype: dtype of the master parameters. All three dtypes accept any
        ``jax.typing.DTypeLike`` and are stored as ``np.dtype``.
      compute_dtype: dtype the forward computation runs in.
      output_dtype: dtype of the function outputs (e.g. logits, loss).
      strict: whether :meth:`wrap` applies :func:`strict_precision`.

    Raises:
      TypeError: a dtype argument is not a dtype.
      ValueError: a dtype argument is not float16, bfloat16, float32 or float64.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.precision import Precision
      >>> p = Precision(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> print(p)
      params=float32,compute=bfloat16,output=float32
      >>> tree = p.cast_to_compute({"w": jnp.ones(2), "step": jnp.int32(3)})
      >>> tree["w"].dtype, tree["step"].dtype
      (dtype(bfloat16), dtype('int32'))
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    _: dataclasses.KW_ONLY
    strict: bool = False

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _check_float_dtype(field, getattr(self, field)))
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict={self.strict!r} must be a bool")

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``param_dtype``."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``output_dtype``."""
        return _cast_floating(tree, self.output_dtype)

    def wrap(self, fn: F) -> F:
        """Returns ``strict_precision(fn)`` if ``self.strict`` else ``fn`` itself."""
        return strict_precision(fn) if self.strict else fn

    @classmethod
    def from_string(cls, spec: str) -> Precision:
        """Parses jmp's policy string, plus an optional ``strict`` part.

        Grammar (comma-separated, whitespace and case ignored)::

            spec  := DTYPE                        # all three dtypes
                   | KEY=DTYPE ("," KEY=DTYPE)*
                   (either form may have one "strict" part, anywhere)
            KEY   := p | params | c | compute | o | output
            DTYPE := float32 | f32 | full | bfloat16 | bf16
                   | float16 | f16 | half | float64 | f64

        As in jmp, an omitted params is float32, an omitted compute follows
        params and an omitted output follows compute. Unlike jmp, ``half`` is
        always float16 (jmp picks bfloat16 on TPU).

        Args:
          spec: the policy string.

        Returns:
          The parsed :class:`Precision`; ``str()`` of it parses back to an equal one.

        Raises:
          TypeError: ``spec`` is not a string.
          ValueError: an unknown key or dtype name, a repeated key or
            ``strict``, an empty part, no dtype, or a bare dtype mixed with
            ``key=value`` parts.

        Example:
          >>> from leanstep.precision import Precision
          >>> print(Precision.from_string("c=bf16"))
          params=float32,compute=bfloat16,output=bfloat16
          >>> print(Precision.from_string("p=f32,c=bf16,o=full,strict"))
          params=float32,compute=bfloat16,output=float32,strict
          >>> Precision.from_string("p=f32,c=bf8")
          Traceback (most recent call last):
          ...
          ValueError: unknown dtype name 'bf8' in precision spec 'p=f32,c=bf8'; expected one of ...
        """
        if not isinstance(spec, str):
            raise TypeError(f"spec={spec!r} must be a str like 'params=float32,compute=bfloat16'")
        parts = [part.strip().lower() for part in spec.split(",")]
        strict = "strict" in parts
        if parts.count("strict") > 1:
            raise ValueError(f"'strict' more than once in precision spec {spec!r}")
        parts = [part for part in parts if part != "strict"]
        if not parts:
            raise ValueError(f"no dtype in precision spec {spec!r}; expected e.g. "
                             "'params=float32,compute=bfloat16,strict'")
        dtypes: dict[str, np.dtype] = {}
        for part in parts:
            if not part:
                raise ValueError(f"empty part in precision spec {spec!r}; expected comma-separated "
                                 "'key=dtype' parts or a single dtype name")
            if "=" not in part:
                if len(parts) != 1:
                    raise ValueError(f"bare dtype {part!r} in precision spec {spec!r}; use a single "
                                     "dtype name alone or only 'key=dtype' parts")
                dtype = _parse_dtype_name(part, spec)
                return cls(dtype, dtype, dtype, strict=strict)
            key, _, name = (t.strip() for t in part.partition("="))
            if key not in _KEY_TO_FIELD:
                raise ValueError(f"unknown key {key!r} in precision spec {spec!r}; expected one of "
                                 f"{', '.join(_KEY_TO_FIELD)}")
            field = _KEY_TO_FIELD[key]
            if field in dtypes:
                raise ValueError(f"key {key!r} sets {field} twice in precision spec {spec!r}")
            dtypes[field] = _parse_dtype_name(name, spec)
        param = dtypes.get("param_dtype", jnp.dtype(jnp.float32))
        compute = dtypes.get("compute_dtype", param)
        return cls(param, compute, dtypes.get("output_dtype", compute), strict=strict)

    def __str__(self) -> str:
        p, c, o = (_DTYPE_NAMES[d][0] for d in (self.param_dtype, self.compute_dtype, self.output_dtype))
        return f"params={p},compute={c},output={o}" + (",strict" if self.strict else "")


def _parse_dtype_name(name: str, spec: str) -> np.dtype:
    if name not in _NAME_TO_DTYPE:
        raise ValueError(f"unknown dtype name {name!r} in precision spec {spec!r}; expected one of "
                         f"{', '.join(_NAME_TO_DTYPE)}")
    return _NAME_TO_DTYPE[name]


def get_precision(spec: str | Precision) -> Precision:
    """Returns ``spec`` if it is a :class:`Precision`, else parses it.

    Args:
      spec: a :class:`Precision` or a string for :meth:`Precision.from_string`.

    Returns:
      The :class:`Precision`.

    Raises:
      TypeError: ``spec`` is neither.
      ValueError: the string does not parse.

    Example:
      >>> from leanstep.precision import get_precision
      >>> get_precision("bf16") == get_precision(get_precision("bfloat16"))
      True
    """
    if isinstance(spec, Precision):
        return spec
    if isinstance(spec, str):
        return Precision.from_string(spec)
    raise TypeError(f"spec={spec!r} must be a Precision or a str like 'params=float32,compute=bfloat16'")


def _round(x: Any) -> Any:
    bits = _ROUND_BITS.get(getattr(x, "dtype", None))
    if bits is None:
        return x
    return lax.reduce_precision(x, exponent_bits=bits[0], mantissa_bits=bits[1])


def _rounded_closed_jaxpr(closed: jex_core.ClosedJaxpr) -> jex_core.ClosedJaxpr:
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: _eval_rounded(closed.jaxpr, closed.consts, xs))(*specs)


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Evaluates one equation, rounding inside the sub-programs it runs."""
    params, name = dict(eqn.params), eqn.primitive.name
    if name in ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
        # Inlined: the call boundary does not change values, and custom rules
        # are not needed here because first-order derivatives come from
        # jax.vjp of the original program, which applies them.
        sub = params["jaxpr" if name in ("jit", "pjit") else "call_jaxpr"]
        return _eval_rounded(sub.jaxpr, sub.consts, invals)
    if name == "scan":
        params["jaxpr"] = _rounded_closed_jaxpr(params["jaxpr"])
    elif name == "while":
        params["cond_jaxpr"] = _rounded_closed_jaxpr(params["cond_jaxpr"])
        params["body_jaxpr"] = _rounded_closed_jaxpr(params["body_jaxpr"])
    elif name == "cond":
        params["branches"] = tuple(map(_rounded_closed_jaxpr, params["branches"]))
    elif name == "remat2":
        # Re-bound rather than re-applied with jax.checkpoint so that
        # `differentiated=True` (which blocks CSE of the recomputation) survives.
        rounded = _rounded_closed_jaxpr(jex_core.ClosedJaxpr(params["jaxpr"], ()))
        if rounded.consts:
            raise NotImplementedError("strict_precision: checkpointed jaxpr gained constants")
        params["jaxpr"] = rounded.jaxpr
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
        with eqn.ctx.manager:
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
            return ([o for o, f in zip(outs, out_float) if f],
                    [o for o, f in zip(outs, out_float) if not f])
        float_outs, vjp_fn, other_outs = jax.vjp(
            float_outputs, *[x for x, f in zip(xs, in_float) if f], has_aux=True)
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
      >>> from leanstep.precision import strict_precision
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
                treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])
            return fn(*call_args, **call_kwargs)

        arrays = [x for x, a in zip(leaves, is_array) if a]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
        outs = _strict_call(closed, arrays)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped  # type: ignore[return-value]
