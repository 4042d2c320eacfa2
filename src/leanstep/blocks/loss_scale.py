"""Loss scaling for mixed-precision training: dynamic, static and no-op.

A loss scale :math:`S` multiplies the loss before differentiation so that small
low-precision gradients do not flush to zero, and divides the gradients after:

.. math::

    g = \\frac{\\nabla_\\theta (S \\cdot L)}{S}

Every loss scale here is an immutable pytree with the same interface
(:class:`LossScale`): ``loss_scale``, ``scale(loss)``, ``unscale(grads)`` and
``adjust(grads_finite)``. Settings that never change during training are static
pytree metadata, so they survive ``jax.jit``, ``lax.scan`` and ``jax.tree.map``.
:func:`leanstep.blocks.loss_scale_registry.get_loss_scale` builds one from its name.

Size: three loss scales (dynamic, static, none) and the finiteness test they share, each with
the doctests that pin its behaviour.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from leanstep.common.checks import (
    INT32_MAX,
    check_bool_scalar,
    check_finite_float32,
    check_positive_float32_scalar,
    check_positive_int32,
)

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale", "all_finite"]

T = TypeVar("T")

_F32_TINY = float(np.finfo(np.float32).tiny)
_INT_SETTINGS = ("growth_interval", "hysteresis")
_FLOAT_SETTINGS = ("growth_factor", "backoff_factor", "min_loss_scale", "max_loss_scale")


def _is_inexact(x: Any) -> bool:
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _saturating_increment(count: jax.Array) -> jax.Array:
    return jnp.where(count < INT32_MAX, count + 1, count)


def all_finite(tree: Any) -> jax.Array:
    """Whether every entry of every floating leaf of ``tree`` is finite.

    .. math::

        \\mathrm{all\\_finite}(t) = \\bigwedge_{x \\in \\mathrm{leaves}(t),\\ x \\text{ inexact}}
            \\ \\bigwedge_i \\mathrm{isfinite}(x_i)

    Args:
      tree: a pytree. Integer, bool and ``float0`` leaves cannot hold NaN or Inf and are ignored.

    Returns:
      A bool scalar; ``True`` for a tree without floating leaves (an empty conjunction).

    Example:
      >>> import jax.numpy as jnp
      >>> all_finite({"w": jnp.ones(3), "step": jnp.int32(7)})
      Array(True, dtype=bool)
      >>> all_finite({"w": jnp.array([1.0, jnp.inf]), "b": jnp.zeros(2, jnp.bfloat16)})
      Array(False, dtype=bool)
    """
    per_leaf = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_inexact(x)]
    if not per_leaf:
        return jnp.array(True)
    return jnp.all(jnp.stack(per_leaf))


class _ScaleByArray:
    """``scale`` and ``unscale`` for loss scales holding a float32 ``loss_scale`` leaf."""

    loss_scale: jax.Array

    def scale(self, loss: ArrayLike) -> jax.Array:
        """Returns ``loss * loss_scale``, computed in at least float32, in the loss's dtype.

        Args:
          loss: a floating array (usually a float32 scalar).

        Raises:
          TypeError: if ``loss`` is not floating.
        """
        loss = jnp.asarray(loss)
        if not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(f"loss must be a floating array, got dtype {loss.dtype}")
        compute = jnp.promote_types(loss.dtype, jnp.float32)
        scale = jnp.asarray(self.loss_scale, jnp.float32).astype(compute)
        return (loss.astype(compute) * scale).astype(loss.dtype)

    def unscale(self, tree: T) -> T:
        """Multiplies every floating leaf of ``tree`` by ``1 / loss_scale``, keeping its dtype.

        With :math:`S` the float32 scale and :math:`\\mathrm{fl}` float32 rounding, each
        leaf is computed in at least float32 and then cast back to its own dtype:

        .. math::

            x \\mapsto \\frac{x}{\\mathrm{fl}(S p)} \\cdot p,
            \\qquad p = \\begin{cases} 2^{-64} & S > 2^{64} \\\\ 1 & \\text{otherwise} \\end{cases}

        so it is exact when :math:`S` is a power of two. The split :math:`p` exists because
        :math:`1/S` is a float32 denormal for :math:`S > 2^{126}`, which XLA flushes to zero
        when it rewrites a division by a broadcast scalar into a multiplication, so plain
        ``x / S`` could turn every such gradient into 0; :math:`1/(S p)` is always normal. A
        division (rather than a multiplication by a precomputed reciprocal) is also what lets
        XLA compute it once: a cheap multiply gets copied into every later fusion and keeps the
        float32 accumulator alive longer (2% more scratch memory on the demo transformer,
        measured with ``leanstep bench``).

        Args:
          tree: a pytree of gradients. Non-floating leaves are returned unchanged.

        Example:
          >>> StaticLossScale.create(1024.0).unscale({"w": jnp.array([2048.0], jnp.bfloat16)})
          {'w': Array([2], dtype=bfloat16)}
        """
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        split = jnp.where(scale > 2.0**64, jnp.float32(2.0**-64), jnp.float32(1.0))
        divisor = scale * split

        def unscale_leaf(x: Any) -> Any:
            if not _is_inexact(x):
                return x
            x = jnp.asarray(x)
            compute = jnp.promote_types(x.dtype, jnp.float32)
            return (x.astype(compute) / divisor.astype(compute) * split.astype(compute)).astype(x.dtype)

        return jax.tree.map(unscale_leaf, tree)


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_ScaleByArray):
    """A loss scale that grows after a run of finite steps and backs off on overflow.

    State: ``loss_scale`` (float32), ``good_steps`` and ``bad_steps`` (int32 scalars,
    saturating). ``adjust(finite)`` computes, with every branch a ``jnp.where``::

        if finite:
            good_steps = good_steps + 1;  bad_steps = 0
            if good_steps >= growth_interval:
                loss_scale = min(loss_scale * growth_factor, max_loss_scale)
                good_steps = 0
        else:
            good_steps = 0;  bad_steps = bad_steps + 1
            if bad_steps >= hysteresis:
                loss_scale = max(loss_scale * backoff_factor, min_loss_scale)
                bad_steps = 0

    The products are float32; ``min`` turns an overflow to ``inf`` into
    ``max_loss_scale``, so the scale never becomes infinite. ``hysteresis=1`` backs
    off at once. An out-of-range scale given to the constructor is not clamped on
    steps that neither grow nor back off.

    Float settings are stored rounded to float32, the precision they are applied in.
    Validation of the settings runs in ``__post_init__`` and never touches the array
    fields, so JAX can rebuild the state from tracers (or any placeholder leaves).
    Use :meth:`create` to also validate the initial scale.

    Example:
      >>> state = DynamicLossScale.create(1024.0, growth_interval=2)
      >>> state = state.adjust(jnp.array(True))
      >>> float(state.loss_scale), int(state.good_steps)
      (1024.0, 1)
      >>> state = state.adjust(jnp.array(True))
      >>> float(state.loss_scale), int(state.good_steps)
      (2048.0, 0)
      >>> state = state.adjust(jnp.array(False))
      >>> float(state.loss_scale), int(state.good_steps)
      (1024.0, 0)
    """

    loss_scale: jax.Array
    good_steps: jax.Array
    bad_steps: jax.Array
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_loss_scale: float = 1.0
    max_loss_scale: float = 2.0**24
    hysteresis: int = 1

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in _INT_SETTINGS + _FLOAT_SETTINGS}
        for name in _INT_SETTINGS:
            object.__setattr__(self, name, check_positive_int32(name, given[name]))
        for name in _FLOAT_SETTINGS:
            object.__setattr__(self, name, check_finite_float32(name, given[name]))
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1 in float32, got {given['growth_factor']!r}")
        # A denormal factor is flushed to zero by XLA: every back-off would drop to min_loss_scale.
        if not _F32_TINY <= self.backoff_factor < 1.0:
            raise ValueError(
                f"backoff_factor must be in (0, 1) in float32, got {given['backoff_factor']!r}; "
                f"expected a normal float32 in [{_F32_TINY:.8g}, 1)"
            )
        # A denormal floor would be flushed to zero by XLA; real scales are far above it.
        if not self.min_loss_scale >= _F32_TINY:
            raise ValueError(
                f"min_loss_scale must be >= {_F32_TINY:.7g} (smallest normal float32), got {given['min_loss_scale']!r}"
            )
        if not self.max_loss_scale >= self.min_loss_scale:
            raise ValueError(
                f"max_loss_scale must be >= min_loss_scale={given['min_loss_scale']!r}, got {given['max_loss_scale']!r}"
            )

    @classmethod
    def create(
        cls,
        initial_scale: ArrayLike = 2.0**15,
        *,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = 2.0**24,
        hysteresis: int = 1,
    ) -> DynamicLossScale:
        """A fresh state with zero counters, after validating every argument.

        Args:
          initial_scale: the starting scale, a normal positive float32 within
            ``[min_loss_scale, max_loss_scale]`` (checked after rounding to float32; it is
            not clamped, so a typo cannot pass silently). A traced value is not checked.
          growth_interval: finite steps in a row before the scale grows; int >= 1.
          growth_factor: multiplier on growth; finite, > 1.
          backoff_factor: multiplier on back-off; in (0, 1), a normal float32 (>= 2**-126).
          min_loss_scale: floor of the scale; a normal positive float32.
          max_loss_scale: ceiling of the scale; finite in float32, >= ``min_loss_scale``.
          hysteresis: non-finite steps in a row before the scale backs off; int >= 1.

        Returns:
          A :class:`DynamicLossScale` with ``good_steps = bad_steps = 0``.

        Raises:
          TypeError: if an argument has the wrong type.
          ValueError: if an argument is out of range; the message names it.

        Example:
          >>> DynamicLossScale.create(0.5)
          Traceback (most recent call last):
          ...
          ValueError: initial_scale must be in [min_loss_scale=1.0, max_loss_scale=16777216.0], got 0.5
        """
        scale = check_positive_float32_scalar("initial_scale", initial_scale)
        state = cls(
            scale,
            jnp.zeros((), jnp.int32),  # two arrays: one buffer twice cannot be donated to a step
            jnp.zeros((), jnp.int32),
            growth_interval,
            growth_factor,
            backoff_factor,
            min_loss_scale,
            max_loss_scale,
            hysteresis,
        )
        if not isinstance(initial_scale, jax.core.Tracer):
            # from the value given, not ``scale``: under jax.eval_shape or jit even a Python
            # float's array is abstract, and the state is built from shapes alone
            value = float(np.float32(np.asarray(initial_scale)))
            if not state.min_loss_scale <= value <= state.max_loss_scale:
                raise ValueError(
                    f"initial_scale must be in [min_loss_scale={state.min_loss_scale!r}, "
                    f"max_loss_scale={state.max_loss_scale!r}], got {value!r}"
                )
        return state

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
        """The next state after a step whose gradients were (not) all finite.

        Args:
          grads_finite: bool scalar, e.g. ``all_finite(grads)``.

        Returns:
          The updated state, same settings (see the class docstring for the rule).

        Raises:
          TypeError: if ``grads_finite`` is not bool.
          ValueError: if ``grads_finite`` is not a scalar.
        """
        finite = check_bool_scalar("grads_finite", grads_finite)
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        good = _saturating_increment(jnp.asarray(self.good_steps, jnp.int32))
        bad = _saturating_increment(jnp.asarray(self.bad_steps, jnp.int32))
        grow = finite & (good >= self.growth_interval)
        back_off = ~finite & (bad >= self.hysteresis)
        grown = jnp.minimum(scale * self.growth_factor, self.max_loss_scale)
        shrunk = jnp.maximum(scale * self.backoff_factor, self.min_loss_scale)
        return dataclasses.replace(
            self,
            loss_scale=jnp.where(grow, grown, jnp.where(back_off, shrunk, scale)),
            good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
            bad_steps=jnp.where(finite | back_off, 0, bad).astype(jnp.int32),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_ScaleByArray):
    """A fixed loss scale; ``adjust`` returns it unchanged.

    Example:
      >>> state = StaticLossScale.create(128.0)
      >>> state.scale(jnp.float32(0.5))
      Array(64., dtype=float32)
      >>> state.adjust(jnp.array(False)) is state
      True
    """

    loss_scale: jax.Array

    @classmethod
    def create(cls, loss_scale: ArrayLike) -> StaticLossScale:
        """Validates ``loss_scale`` and stores it as float32.

        Raises:
          TypeError: if ``loss_scale`` is not a real number.
          ValueError: if it is not a scalar or, when concrete, not a normal positive float32 (in
            ``[2**-126, float32 max]``: a denormal scale is flushed to zero, a larger one is ``inf``).
        """
        return cls(loss_scale=check_positive_float32_scalar("loss_scale", loss_scale))

    def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
        """Returns ``self``; ``grads_finite`` (bool scalar) is only checked."""
        check_bool_scalar("grads_finite", grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
    """No loss scaling: a scale of 1 whose ``scale``/``unscale`` return their input as is.

    Example:
      >>> NoOpLossScale().loss_scale
      Array(1., dtype=float32)
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, loss: T) -> T:
        return loss

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
        """Returns ``self``; ``grads_finite`` (bool scalar) is only checked."""
        check_bool_scalar("grads_finite", grads_finite)
        return self


jax.tree_util.register_dataclass(
    DynamicLossScale,
    data_fields=["loss_scale", "good_steps", "bad_steps"],
    meta_fields=[*_INT_SETTINGS, *_FLOAT_SETTINGS],
)
jax.tree_util.register_dataclass(StaticLossScale, data_fields=["loss_scale"], meta_fields=[])
jax.tree_util.register_dataclass(NoOpLossScale, data_fields=[], meta_fields=[])


@runtime_checkable
class LossScale(Protocol):
    """The interface shared by :class:`DynamicLossScale`, :class:`StaticLossScale` and
    :class:`NoOpLossScale`: a float32 ``loss_scale`` and pure ``scale``/``unscale``/``adjust``."""

    @property
    def loss_scale(self) -> jax.Array: ...

    def scale(self, loss: jax.Array) -> jax.Array: ...

    def unscale(self, tree: T) -> T: ...

    def adjust(self, grads_finite: ArrayLike) -> LossScale: ...
