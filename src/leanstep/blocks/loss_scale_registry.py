"""Loss scales by name: ``"dynamic"``, ``"static"`` or ``"none"`` to a :class:`leanstep.LossScale`.

.. code-block:: text

    "dynamic"  ->  DynamicLossScale.create(initial_scale, **settings)  (default scale 2**15)
    "static"   ->  StaticLossScale.create(initial_scale)      (initial_scale required)
    "none"     ->  NoOpLossScale()                            (initial_scale None or 1)
    a LossScale instance  ->  itself

Names are matched case-insensitively, surrounding whitespace ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.typing import ArrayLike

from leanstep.blocks.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)

__all__ = ["LOSS_SCALES", "get_loss_scale"]

#: Loss-scale names accepted by :func:`get_loss_scale`.
LOSS_SCALES: tuple[str, ...] = ("dynamic", "static", "none")


def get_loss_scale(spec: str | LossScale, initial_scale: ArrayLike | None = None, **settings: Any) -> LossScale:
    """Builds a loss scale from a name, or passes an existing one through.

    Args:
      spec: ``"dynamic"``, ``"static"`` or ``"none"`` (case-insensitive), or a
        :class:`LossScale` instance, returned as is.
      initial_scale: the scale; optional for ``"dynamic"`` (default ``2**15``), required
        for ``"static"``, and for ``"none"`` only ``None`` or 1.
      **settings: keyword settings of :meth:`DynamicLossScale.create`; ``"dynamic"`` only.

    Returns:
      A :class:`DynamicLossScale`, :class:`StaticLossScale` or :class:`NoOpLossScale`.

    Raises:
      ValueError: for an unknown name (the message lists the valid ones), a missing or
        stray ``initial_scale``, or settings given for a non-dynamic spec.
      TypeError: if ``spec`` is neither a string nor a :class:`LossScale`.

    Example:
      >>> get_loss_scale("dynamic", 256.0, growth_interval=100).growth_interval
      100
      >>> get_loss_scale("bf16")
      Traceback (most recent call last):
      ...
      ValueError: unknown loss scale spec 'bf16'; expected one of 'dynamic', 'static', 'none'
    """
    if isinstance(spec, LossScale):
        if initial_scale is not None or settings:
            raise ValueError(
                f"initial_scale and settings apply only to a spec name, not to the instance {type(spec).__name__}"
            )
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str or a LossScale, got {type(spec).__name__} {spec!r}")
    name = spec.strip().lower()
    if name not in LOSS_SCALES:
        valid = ", ".join(repr(s) for s in LOSS_SCALES)
        raise ValueError(f"unknown loss scale spec {spec!r}; expected one of {valid}")
    if name == "dynamic":
        return DynamicLossScale.create(2.0**15 if initial_scale is None else initial_scale, **settings)
    if settings:
        raise ValueError(f"settings {sorted(settings)} apply only to spec 'dynamic', got {spec!r}")
    if name == "static":
        if initial_scale is None:
            raise ValueError("initial_scale is required for spec 'static', got None")
        return StaticLossScale.create(initial_scale)
    if initial_scale is not None and float(np.asarray(initial_scale)) != 1.0:
        raise ValueError(f"initial_scale must be None or 1 for spec 'none', got {initial_scale!r}")
    return NoOpLossScale()
