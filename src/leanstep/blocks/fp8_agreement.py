"""How far one step's FP8 state may differ between two device layouts, and the comparison.

An FP8 state holds amax histories, each entry :math:`\\max_i |x_i|` of a tensor ``x`` the step
computed (an activation, a weight, a gradient), and the scales made from them. A mesh layout
computes the same tensors but may round them otherwise (a sharded program tiles its contractions
and fuses its casts its own way; with XLA's excess precision on, its default, a bf16 value kept in
float32 by one program's fusion is rounded in another's: the built-in transformer's state on
``data=2,fsdp=2`` was 1.2% off the one-device state; without it, bit for bit). Since

.. math:: \\big|\\max_i |a_i| - \\max_i |b_i|\\big| \\le \\max_i |a_i - b_i|,

an amax moves no more than the elements it is the maximum of: where every element of ``x``
agrees with one device's to a relative ``tolerance``, so does each amax entry, and each scale
(one float32 division of a float32 constant by the amax, and one reciprocal: two more roundings,
far below any layout tolerance). The bound, then: **each entry of each FP8 leaf within the
layout's relative tolerance of the one-device entry, elementwise**, non-finite entries equal.
A layout that records its own devices' maximum instead of the whole batch's (no ``pmax``)
misses the rows of the others: far outside it.

:func:`fp8_state_agreement` makes the comparison; ``tolerance`` is the caller's layout tolerance
(verify's meshes check holds gradients to :math:`\\max(2^{-14}, \\lambda\\sqrt{N+1}\\,u)`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from leanstep.common.checks import same_structure

__all__ = ["Fp8Agreement", "fp8_state_agreement"]


class Fp8Agreement(NamedTuple):
    """Two FP8 states compared entry by entry.

    Attributes:
      largest: the largest relative difference of an entry (inf where non-finite entries or a
        zero differ; 0.0 for equal states).
      leaf: the path of the leaf it is in (None when the states are equal).
      within: ``largest <= tolerance``.
    """

    largest: float
    leaf: str | None
    within: bool


def _relative(have: np.ndarray, want: np.ndarray) -> float:
    finite = np.isfinite(want) & np.isfinite(have)
    same_nonfinite = np.array_equal(have[~finite], want[~finite], equal_nan=True)
    if not same_nonfinite or not np.array_equal(np.isfinite(want), np.isfinite(have)):
        return float("inf")
    diff = np.abs(have[finite] - want[finite])
    scale = np.abs(want[finite])
    if np.any((scale == 0) & (diff > 0)):
        return float("inf")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), 0.0)
    return float(ratios.max(initial=0.0))


def fp8_state_agreement(want: Any, have: Any, tolerance: float) -> Fp8Agreement:
    """``have``'s FP8 state against ``want``'s (one device's), each entry relative to its own value.

    Args:
      want: the reference FP8 state, a pytree of arrays (e.g. one device's
        ``split_fp8(state.params)[1]``).
      have: the same state from another layout, of the same structure and shapes.
      tolerance: the relative difference allowed an entry (see the module doc).

    Returns:
      An :class:`Fp8Agreement`.

    Raises:
      ValueError: naming ``have``, when its structure or a leaf's shape differs from ``want``'s;
        naming ``tolerance``, when it is negative or not finite.

    Example:
      >>> import jax.numpy as jnp
      >>> one = {"amax_history": jnp.array([3.0, 2.0]), "scale": jnp.array(0.5)}
      >>> mesh = {"amax_history": jnp.array([3.0, 2.0000002]), "scale": jnp.array(0.5)}
      >>> fp8_state_agreement(one, mesh, 2.0**-14)
      Fp8Agreement(largest=1.19...e-07, leaf="['amax_history']", within=True)
    """
    if not (np.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite relative difference >= 0, got {tolerance!r}")
    if not same_structure(want, have):
        raise ValueError(
            f"have: an FP8 state of another structure than want's: {jax.tree.structure(have)} vs "
            f"{jax.tree.structure(want)}"
        )
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    have_leaves = jax.tree_util.tree_flatten_with_path(have)[0]
    largest, where = 0.0, None
    for (path, w), (_, h) in zip(want_leaves, have_leaves, strict=True):
        w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
        name = jax.tree_util.keystr(path)
        if w.shape != h.shape:
            raise ValueError(f"have: FP8 leaf {name} has shape {h.shape}, want's has {w.shape}")
        error = _relative(h, w)
        if error > largest or (where is None and error > 0):
            largest, where = error, name
    return Fp8Agreement(largest, where, largest <= tolerance)
