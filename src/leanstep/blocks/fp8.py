r"""FP8 quantization: the recipe, the scale, quantize, and quantize-dequantize (the reference).

A tensor :math:`x` goes through FP8 as Flax's ``fp8_ops`` and Transformer Engine define it, with
a per-tensor *dequantization* scale :math:`s` (Flax's convention; TE's ``scale_inv``):

.. math::

    q = \mathrm{fp8}\big(\mathrm{clip}(x \cdot s^{-1},\ -m,\ m)\big), \qquad \hat x = q \cdot s

where :math:`m` is the format's largest finite value (448 for e4m3, 57344 for e5m2) and the cast
rounds to nearest even. The scale comes from an amax :math:`a` and a margin :math:`\mu`:

.. math::

    s = \frac{1}{(m / a) \cdot 2^{-\mu}} \quad\text{if } 0 < a < \infty,
    \qquad s = s_{\text{before}} \text{ otherwise}

**Delayed scaling** takes :math:`a` from a history of the amaxes of earlier steps (its ``max``,
or its ``most_recent`` entry), so the step quantizes with a scale it knew before it saw the
tensor, and records the tensor's amax :math:`\max|x|` as the history's newest entry. **Current
scaling** takes :math:`a = \max|x|` of the tensor itself (one more reduction, no state).

Where leanstep differs from Flax's ``fp8_ops``, and why: the quotient, the clip and the
dequantizing product run in float32, not in the compute dtype (bfloat16 there): rounding
:math:`x/s` to bfloat16 first and then to FP8 rounds twice, which can land one FP8 step away
from the single rounding of the exact quotient (TE also quantizes from float32). The quotient
is :math:`x` times the float32 reciprocal :math:`s^{-1}`, as TE's quantize multiplies by its
scale, not a division: XLA rewrites a division by a scale it knows at compile time into that
product, so a division would round differently with a constant scale than with a stored one.
The FP8 matmul takes :math:`q` itself and applies the scales to its float32 product
(:mod:`leanstep.blocks.fp8_dot`), where Flax dequantizes each operand into the compute dtype
first; :func:`qdq` computes :math:`\hat x` for references. And an amax so small (a denormal) that :math:`m / a` overflows
keeps the scale before, where Flax's formula gives 0.

Example:
  >>> import jax.numpy as jnp
  >>> recipe = Fp8Recipe(scaling="delayed", history=4)
  >>> scale = new_scale(jnp.float32(896.0), jnp.float32(1.0), "e4m3", margin=0)
  >>> float(scale), float(qdq(jnp.float32(100.0), "e4m3", scale)[()])
  (2.0, 96.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from leanstep.common.checks import is_int

__all__ = [
    "FP8_FORMATS",
    "MAX_HISTORY",
    "Fp8Recipe",
    "amax_of",
    "fp8_dtype",
    "fp8_max",
    "new_scale",
    "qdq",
    "quantize",
    "record_amax",
]

#: The FP8 formats by name: e4m3 (finite only, max 448) for activations and weights, e5m2 (max
#: 57344) for gradients, as the OCP FP8 formats on H100/H200 and Transformer Engine name them.
FP8_FORMATS: dict[str, Any] = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}

_SCALINGS = ("delayed", "current")
_AMAX_ALGOS = ("max", "most_recent")
#: The longest amax history: 64 times Transformer Engine's and Flax's 1024 (each FP8 matmul keeps
#: three float32 histories, so at most 768 KiB a matmul); a longer one is a typo, not a recipe.
MAX_HISTORY = 2**16
#: The settings :meth:`Fp8Recipe.from_string` reads after the scaling, and how it reads each.
_SETTINGS: dict[str, Any] = {"history": int, "amax": str, "margin": float, "forward": str, "backward": str}
#: The settings of delayed scaling's history, with their defaults (current scaling keeps none).
_HISTORY_SETTINGS = {"history": 1024, "amax": "max"}


def fp8_dtype(fmt: str) -> Any:
    """The dtype of the FP8 format ``"e4m3"`` or ``"e5m2"``.

    Raises:
      ValueError: another name.
    """
    if fmt not in FP8_FORMATS:
        raise ValueError(f"an FP8 format is one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    return FP8_FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    """The largest finite value of the format: 448.0 (e4m3) or 57344.0 (e5m2).

    Example:
      >>> fp8_max("e4m3"), fp8_max("e5m2")
      (448.0, 57344.0)
    """
    return float(jnp.finfo(fp8_dtype(fmt)).max)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 matmuls quantize their operands (a static setting, hashable).

    Attributes:
      scaling: ``"delayed"`` (the scale from an amax history kept in the FP8 state) or
        ``"current"`` (the scale from the tensor's own amax, no state).
      history: the length of each amax history (delayed scaling only), an int in
        ``[1, MAX_HISTORY]``; 1024 as in Transformer Engine and Flax.
      amax: how a history gives the amax (delayed scaling only): ``"max"`` (of the whole history)
        or ``"most_recent"`` (its newest entry).
      margin: a non-negative number :math:`\\mu`; the scale keeps :math:`2^{\\mu}` of headroom.
      forward: the format of the forward operands (activations and weights): ``"e4m3"`` (or ``"e5m2"``).
      backward: the format of the output gradient in the backward pass: ``"e5m2"`` (or ``"e4m3"``).

    Raises:
      ValueError, TypeError: a field outside its form, named.

    Example:
      >>> Fp8Recipe("current")
      Fp8Recipe(scaling='current', history=1024, amax='max', margin=0, forward='e4m3', backward='e5m2')
    """

    scaling: str = "delayed"
    history: int = 1024
    amax: str = "max"
    margin: float = 0
    forward: str = "e4m3"
    backward: str = "e5m2"

    def __post_init__(self) -> None:
        if self.scaling not in _SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {_SCALINGS}, got {self.scaling!r}")
        if not is_int(self.history) or not 1 <= self.history <= MAX_HISTORY:
            raise ValueError(
                f"Fp8Recipe.history must be an int in [1, {MAX_HISTORY}] (entries per amax history), got {self.history!r}"
            )
        if self.amax not in _AMAX_ALGOS:
            raise ValueError(f"Fp8Recipe.amax must be one of {_AMAX_ALGOS}, got {self.amax!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 64:
            raise ValueError(f"Fp8Recipe.margin must be a number in [0, 64) (headroom 2**margin), got {self.margin!r}")
        for name in ("forward", "backward"):
            if getattr(self, name) not in FP8_FORMATS:
                raise ValueError(
                    f"Fp8Recipe.{name} must be an FP8 format, one of {', '.join(FP8_FORMATS)}, got {getattr(self, name)!r}"
                )
        for name, default in _HISTORY_SETTINGS.items():  # current scaling keeps no history to set
            if self.scaling == "current" and getattr(self, name) != default:
                raise ValueError(
                    f"Fp8Recipe.{name} applies to delayed scaling only (current scaling scales by each tensor's "
                    f"own amax and keeps no history), got {name}={getattr(self, name)!r} with scaling='current'"
                )

    @property
    def delayed(self) -> bool:
        """Whether the scales come from amax histories kept in the FP8 state."""
        return self.scaling == "delayed"

    @classmethod
    def from_string(cls, spec: str) -> Fp8Recipe | None:
        """``"none"`` (None: no FP8), or a scaling with optional settings, comma-separated:
        ``"delayed"``, ``"current"``, ``"delayed,history=16,amax=most_recent,margin=1,forward=e4m3,backward=e5m2"``
        (``history`` and ``amax`` with delayed scaling only).

        Raises:
          ValueError: another form, naming the setting as written and the expected form.

        Example:
          >>> Fp8Recipe.from_string("delayed,history=16").history, Fp8Recipe.from_string("none")
          (16, None)
          >>> Fp8Recipe.from_string("current,history=16")
          Traceback (most recent call last):
          ...
          ValueError: history=16: history applies to delayed scaling only (current scaling ...
        """
        if not isinstance(spec, str):
            raise TypeError(f"an FP8 recipe is a string, got {type(spec).__name__}")
        expected = (
            "none, or delayed|current[,margin=X][,forward=e4m3|e5m2][,backward=e4m3|e5m2], "
            f"and with delayed [,history=1..{MAX_HISTORY}][,amax=max|most_recent]"
        )
        scaling, *parts = [part.strip() for part in spec.strip().lower().split(",")]
        if scaling == "none" and not parts:
            return None
        fields: dict[str, Any] = {"scaling": scaling}
        written: dict[str, str] = {}
        for part in parts:
            name, sep, value = part.partition("=")
            if not sep or name not in _SETTINGS:
                raise ValueError(f"unknown FP8 setting {part!r} in {spec!r}; expected {expected}")
            if name in fields:
                raise ValueError(
                    f"repeated FP8 setting {part!r} in {spec!r}: {name}= is given twice; expected {expected}"
                )
            try:
                fields[name] = _SETTINGS[name](value)
            except ValueError:
                raise ValueError(f"FP8 setting {part!r} is not a number; expected {expected}") from None
            written[name] = part
        for name in _HISTORY_SETTINGS:
            if scaling == "current" and name in written:
                raise ValueError(
                    f"{written[name]}: {name} applies to delayed scaling only (current scaling scales by each "
                    f"tensor's own amax and keeps no history); drop it, or use delayed; expected {expected}"
                )
        try:
            return cls(**fields)
        except ValueError as error:
            message = str(error)
            for name, part in written.items():  # the setting as written, not the field's name
                if message.startswith(f"Fp8Recipe.{name} "):
                    message = f"{part}: {message.removeprefix('Fp8Recipe.')}"
            raise ValueError(f"{message}; expected {expected}") from None

    def to_string(self) -> str:
        """The form :meth:`from_string` reads (``recipe == from_string(recipe.to_string())``).

        Example:
          >>> Fp8Recipe("current", margin=1).to_string()
          'current,margin=1,forward=e4m3,backward=e5m2'
        """
        margin = int(self.margin) if float(self.margin).is_integer() else self.margin
        history = f",history={self.history},amax={self.amax}" if self.delayed else ""
        return f"{self.scaling}{history},margin={margin},forward={self.forward},backward={self.backward}"

    def history_amax(self, history: jax.Array) -> jax.Array:
        """The amax a history gives (its max, or its newest entry ``history[0]``)."""
        return jnp.max(history, axis=0) if self.amax == "max" else history[0]


def amax_of(x: jax.Array) -> jax.Array:
    """``max |x|`` in float32 (a scalar of shape ``(1,)``, the shape of a scale)."""
    return jnp.max(jnp.abs(x.astype(jnp.float32))).reshape(1)


def new_scale(amax: jax.Array, scale: jax.Array, fmt: str, *, margin: float = 0) -> jax.Array:
    """The dequantization scale for ``amax`` (the module doc's formula); ``scale`` where ``amax``
    is 0 or not finite.

    Example:
      >>> import jax.numpy as jnp
      >>> new_scale(jnp.array([0.0, 448.0, jnp.inf]), jnp.float32(0.5), "e4m3", margin=1)
      Array([0.5, 2. , 0.5], dtype=float32)
    """
    amax = jnp.asarray(amax, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    # Times the float32 constant 2**-margin, not divided by 2**margin: XLA turns a division by a
    # constant into that product anyway, and this way the rounding is the one written here.
    factor = (jnp.float32(fp8_max(fmt)) / amax) * jnp.float32(2.0**-margin)
    # A denormal amax would make the factor inf and the scale 0 (Flax's formula does): kept.
    usable = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(factor)
    return jnp.where(usable, jnp.float32(1.0) / jnp.where(usable, factor, 1.0), scale)


def quantize(x: jax.Array, fmt: str, scale: jax.Array) -> jax.Array:
    """``x`` quantized to ``fmt`` with the dequantization ``scale``: an FP8 array (the quotient
    and the clip in float32).

    Example:
      >>> import jax.numpy as jnp
      >>> quantize(jnp.array([1.0, 17.0, 1e6]), "e4m3", jnp.float32(1.0))  # 17 rounds to 16; 1e6 saturates
      Array([1, 16, 448], dtype=float8_e4m3fn)
    """
    limit = jnp.float32(fp8_max(fmt))
    s = jnp.asarray(scale, jnp.float32).reshape(())
    inverse = jnp.float32(1.0) / s  # once per tensor; x * inverse per element (the module doc)
    return jnp.clip(x.astype(jnp.float32) * inverse, -limit, limit).astype(fp8_dtype(fmt))


def qdq(x: jax.Array, fmt: str, scale: jax.Array, dtype: DTypeLike | None = None) -> jax.Array:
    """``x`` quantized to ``fmt`` with the dequantization ``scale`` and dequantized, in ``dtype``
    (default: ``x``'s); the quotient, clip and product in float32. The reference an FP8 matmul's
    operands are measured against (:func:`leanstep.blocks.fp8_dot_general` hands the FP8 arrays of
    :func:`quantize` to the matmul itself).

    Example:
      >>> import jax.numpy as jnp
      >>> qdq(jnp.array([1.0, 17.0, 1e6]), "e4m3", jnp.float32(1.0))  # 17 rounds to 16; 1e6 saturates
      Array([  1.,  16., 448.], dtype=float32)
    """
    dtype = x.dtype if dtype is None else dtype
    s = jnp.asarray(scale, jnp.float32).reshape(())
    # The barrier keeps XLA from folding the FP8 round trip away: XLA:TPU removed convert(convert(
    # x, fp8), f32) as excess precision and returned x itself (a v5e: 17 stayed 17, not 16).
    q = jax.lax.optimization_barrier(quantize(x, fmt, s))
    return (q.astype(jnp.float32) * s).astype(dtype)


def record_amax(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history with ``amax`` as its newest entry: rolled by one, ``amax`` at index 0 (as
    Flax's ``compute_amax_history``; the oldest entry drops out).

    Example:
      >>> import jax.numpy as jnp
      >>> record_amax(jnp.array([3.0, 2.0, 1.0]), jnp.array([9.0]))
      Array([9., 1., 3.], dtype=float32)
    """
    return jnp.roll(history, shift=-1, axis=0).at[0].set(jnp.asarray(amax, history.dtype).reshape(()))
