"""The dynamic quantization map of leanstep's 8-bit moments (:mod:`leanstep.blocks.moments`).

256 values in [-1, 1] (signed: a first moment) or [0, 1] (unsigned: a second), dense near zero
over six decades, 0 and 1 exact (and -1, signed), decoded by integer arithmetic and one float32
product an entry, with no lookup: an accelerator's gathers are slow.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["decode_with", "dynamic_map", "map_tables"]


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 values of the dynamic quantization map (see the module doc).

    Exponent ``e`` of six decades carries ``n = 2**e`` (signed; ``2**(e+1)`` unsigned) values,
    the midpoints of an even split of ``[0.1, 1]`` scaled by ``10**(e - 6)``; then 0 and 1. The
    ``i``-th is ``(2n + 18i + 9) / (2n * 10**(7 - e))``, kept as the float32 product of the
    integer and the float32 reciprocal of the divisor: within 1.2 units in the last place of the
    exact ratio (72 signed and 67 unsigned values are one unit off its float32 rounding), and
    :func:`decode`'s arithmetic gives it bit for bit on any platform whose float32 product is IEEE's (a
    TPU's division is not correctly rounded; its product is: checked on a v5e).

    Example:
      >>> signed, unsigned = dynamic_map(True), dynamic_map(False)
      >>> signed.shape, float(signed[0]), float(signed[-1]), float(unsigned[0]), float(unsigned[-1])
      ((256,), -1.0, 1.0, 0.0, 1.0)
    """
    values = decode_with(np, np.arange(256, dtype=np.int32), signed)
    assert np.all(np.diff(values) > 0), "the map is sorted"
    return values


def decode_with(xp: Any, c: Any, signed: bool) -> Any:
    """``dynamic_map(signed)[c]`` for int32 codes ``c``, in ``xp`` (NumPy or jax.numpy): integer
    math, then one float32 product per entry (no lookup, no division).

    Example:
      >>> float(decode_with(np, np.array([0, 127, 255], np.int32), True)[1])
      0.0
    """
    if signed:  # codes 0..126 negative (0 is -1), 127 zero, 128..255 positive (255 is 1)
        position = xp.where(c >= 128, c - 128, 127 - c)
        j = position + 1
    else:  # code 0 is zero, 255 is 1
        j = c + 1
    group = sum(((j >= 2**t).astype(np.int32) for t in range(1, 8)), xp.zeros_like(j))  # floor(log2(j))
    n = xp.left_shift(xp.ones_like(j), group)
    numerator = (2 * n + 18 * (j - n) + 9).astype(np.float32)
    decades = 7 if signed else 8  # 10**(7 - e), e = group (signed) or group - 1
    reciprocal = xp.zeros(j.shape, np.float32)
    for g in range(8):  # a chain of selects: an accelerator's gathers are slow
        reciprocal = xp.where(group == g, np.float32(1.0 / (2.0 ** (g + 1) * 10.0 ** (decades - g))), reciprocal)
    magnitude = numerator * reciprocal
    one, zero = np.float32(1.0), np.float32(0.0)
    if signed:
        magnitude = xp.where(position == 127, one, magnitude)
        return xp.where(c == 127, zero, xp.where(c < 127, -magnitude, magnitude)).astype(np.float32)
    return xp.where(c == 0, zero, xp.where(c == 255, one, magnitude)).astype(np.float32)


@functools.lru_cache(maxsize=2)
def map_tables(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The map's 256 values and the 255 float32 midpoints between them, for ``signed`` or not."""
    values = dynamic_map(signed)
    midpoints = ((values[:-1].astype(np.float64) + values[1:].astype(np.float64)) / 2.0).astype(np.float32)
    return values, midpoints
