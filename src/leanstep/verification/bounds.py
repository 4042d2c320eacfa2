r"""The tolerances of verify's checks, each derived from the arithmetic it allows.

Every check compares a step against a reference and allows only what the reference's
arithmetic cannot pin down. With :math:`u` the unit roundoff of the format the sum is kept in
(:math:`2^{-24}` for float32) and Higham's

.. math:: \gamma_n = \frac{n\,u}{1 - n\,u},

the bounds are (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, §3-4):

.. code-block:: text

    weighted sum of M terms, each one rounding off     |fl(sum w_j g_j) - sum w_j g_j| <= gamma_{M+2} * sum |w_j g_j|
    2-norm of n values, summed in any order             |fl(||x||) - ||x||| <= gamma_{n+2} * ||x||     (deterministic)
                                                         lambda * sqrt(n + 2) * u * ||x||               (probabilistic)

The deterministic bound of a long sum grows with :math:`n`, and for a model's parameter count
it is too loose to tell a float32 norm from a bfloat16 one. Higham and Mary (SIAM J. Sci.
Comput. 41(5), 2019, Thm. 3.1) show that with rounding errors independent and of mean zero the
error is below :math:`\lambda\sqrt{n}\,u` with probability at least
:math:`1 - 2\exp(-\lambda^2/2)`; :data:`LAMBDA` = 6 makes that :math:`1 - 3\cdot10^{-8}`.

Example:
  >>> float(gamma(3, "float32")) == 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
  True
  >>> unit_roundoff("bfloat16") == 2.0**-8
  True
"""

from __future__ import annotations

import math

import numpy as np
from jax.typing import DTypeLike

__all__ = ["INT8_ROUNDOFF", "LAMBDA", "TINY", "gamma", "norm_bound", "unit_roundoff"]

#: Higham and Mary's lambda for the probabilistic bounds (failure probability 2 exp(-18) < 3e-8).
LAMBDA = 6.0

#: The smallest normal float32: below it float32 is subnormal and a CPU may flush to zero, so
#: every elementwise bound adds this absolute floor (per term).
TINY = float(np.finfo(np.float32).tiny)

#: The unit roundoff of an int8 quantization (:func:`leanstep.blocks.int8.quantize_int8`): rounding to the
#: nearest of 127 levels a side errs by half a level at most, 1/254 of the largest magnitude of the slice one
#: scale covers (a token's row, a weight's column); just above bfloat16's 2^-8 = 1/256.
INT8_ROUNDOFF = 1 / 254


def unit_roundoff(dtype: DTypeLike) -> float:
    """:math:`u = 2^{-p}` for a format with ``p`` bits of significand (float32: ``2**-24``).

    Example:
      >>> [unit_roundoff(d) == 2.0**-p for d, p in (("float32", 24), ("bfloat16", 8), ("float8_e4m3fn", 4))]
      [True, True, True]
    """
    import ml_dtypes  # its finfo knows bfloat16 and the FP8 formats (NumPy 2.5's does not)

    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 2


def gamma(n: int, dtype: DTypeLike = "float32") -> float:
    r""":math:`\gamma_n = n u / (1 - n u)`: the relative error bound of ``n`` roundings in ``dtype``."""
    u = unit_roundoff(dtype)
    if n * u >= 1:
        return math.inf
    return n * u / (1 - n * u)


def norm_bound(n: int, dtype: DTypeLike = "float32") -> float:
    r"""Relative error of a 2-norm of ``n`` values computed in ``dtype``: the smaller of
    :math:`\gamma_{n+2}` and :math:`\lambda\sqrt{n+2}\,u` (see the module doc)."""
    return min(gamma(n + 2, dtype), LAMBDA * math.sqrt(n + 2) * unit_roundoff(dtype))
