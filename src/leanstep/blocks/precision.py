"""Mixed-precision policies: which dtype parameters, computation and outputs use.

:class:`Precision` is jmp's ``Policy`` plus a ``strict`` flag; :func:`get_precision`
parses jmp's policy strings. With ``strict=True``, :meth:`Precision.wrap` applies
:func:`leanstep.blocks.rounding.strict_precision`, which rounds every bfloat16/float16
result to its dtype, forward and backward.

A train step keeps float32 master weights whatever the policy says of compute and output:
:func:`check_train_precision` refuses a policy whose params dtype is anything else, so that no
setting is parsed and then ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from leanstep.blocks.fp8_state import is_fp8_state
from leanstep.blocks.rounding import strict_precision
from leanstep.common.checks import check_bool

__all__ = ["Precision", "check_train_precision", "get_precision"]

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
_KEY_TO_FIELD = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}


def _check_float_dtype(name: str, value: Any) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} is not a dtype; expected one of {[d.name for d in _FLOAT_DTYPES]}") from e
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}={dtype.name} is not supported; expected one of {[d.name for d in _FLOAT_DTYPES]}")
    return dtype


def _cast_floating(tree: T, dtype: np.dtype) -> T:
    """The floating leaves of ``tree`` in ``dtype``; FP8 state (scales, amax histories:
    :mod:`leanstep.blocks.fp8_state`) stays float32."""

    def cast(x: Any) -> Any:
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(lambda x: x if is_fp8_state(x) else cast(x), tree, is_leaf=is_fp8_state)


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
      strict: whether :meth:`wrap` applies :func:`leanstep.blocks.rounding.strict_precision`.

    Raises:
      TypeError: a dtype argument is not a dtype, or ``strict`` is not a bool.
      ValueError: a dtype argument is not float16, bfloat16, float32 or float64.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.blocks.precision import Precision
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
        object.__setattr__(self, "strict", check_bool("strict", self.strict))

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
          >>> from leanstep.blocks.precision import Precision
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
            raise ValueError(
                f"no dtype in precision spec {spec!r}; expected e.g. 'params=float32,compute=bfloat16,strict'"
            )
        dtypes: dict[str, np.dtype] = {}
        for part in parts:
            if not part:
                raise ValueError(
                    f"empty part in precision spec {spec!r}; expected comma-separated "
                    "'key=dtype' parts or a single dtype name"
                )
            if "=" not in part:
                if len(parts) != 1:
                    raise ValueError(
                        f"bare dtype {part!r} in precision spec {spec!r}; use a single "
                        "dtype name alone or only 'key=dtype' parts"
                    )
                dtype = _parse_dtype_name(part, spec)
                return cls(dtype, dtype, dtype, strict=strict)
            key, _, name = (t.strip() for t in part.partition("="))
            if key not in _KEY_TO_FIELD:
                raise ValueError(
                    f"unknown key {key!r} in precision spec {spec!r}; expected one of {', '.join(_KEY_TO_FIELD)}"
                )
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
        raise ValueError(
            f"unknown dtype name {name!r} in precision spec {spec!r}; expected one of {', '.join(_NAME_TO_DTYPE)}"
        )
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
      >>> from leanstep.blocks.precision import get_precision
      >>> get_precision("bf16") == get_precision(get_precision("bfloat16"))
      True
    """
    if isinstance(spec, Precision):
        return spec
    if isinstance(spec, str):
        return Precision.from_string(spec)
    raise TypeError(f"spec={spec!r} must be a Precision or a str like 'params=float32,compute=bfloat16'")


def check_train_precision(spec: str | Precision, name: str = "precision") -> Precision:
    """:func:`get_precision` for a train step, whose master weights are float32.

    A train step (:func:`leanstep.make_train_step`, :func:`leanstep.step.gradient_stage`) keeps
    float32 masters: :meth:`leanstep.TrainState.create` stores the parameters in float32, the
    gradient is accumulated, unscaled and clipped in float32 and the optimizer updates float32
    values. A bfloat16 or float16 master would lose every update smaller than its 8- or 11-bit
    mantissa can hold (``w + lr * g == w``), and a float64 one would only ever see float32
    gradients; so a params dtype other than float32 is refused rather than ignored. Low
    precision belongs in ``compute`` (and ``output``).

    Args:
      spec: a :class:`Precision` or its string form.
      name: the argument's name in the message.

    Returns:
      The :class:`Precision`, its ``param_dtype`` float32.

    Raises:
      TypeError, ValueError: ``spec`` does not parse (see :func:`get_precision`).
      ValueError: its params dtype is not float32; the message gives the policy to use instead.

    Example:
      >>> print(check_train_precision("compute=bf16"))
      params=float32,compute=bfloat16,output=bfloat16
      >>> check_train_precision("bfloat16")
      Traceback (most recent call last):
      ...
      ValueError: precision='bfloat16': params must be float32 (the master weights), got bfloat16; ...
    """
    if not isinstance(spec, (Precision, str)):  # named here: get_precision knows no argument name
        raise TypeError(
            f"{name} must be a leanstep.Precision or its string form (e.g. 'compute=bfloat16'), "
            f"got {type(spec).__name__} {spec!r}"
        )
    policy = get_precision(spec)
    if policy.param_dtype != jnp.float32:
        masters = dataclasses.replace(policy, param_dtype=jnp.dtype(jnp.float32))
        given = spec if isinstance(spec, str) else str(spec)
        raise ValueError(
            f"{name}={given!r}: params must be float32 (the master weights), got {policy.param_dtype.name}; "
            "a train step keeps float32 masters (TrainState.create stores the parameters in float32; the gradient "
            "is accumulated, unscaled and clipped in float32) and runs the loss in the compute dtype; use "
            f"{name}={str(masters)!r}"
        )
    return policy
