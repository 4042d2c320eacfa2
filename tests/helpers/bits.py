"""Bit-level comparison of pytrees, for the precision and rounding tests."""

import jax
import numpy as np


def leaves_bit_equal(a, b):
    """Asserts two pytrees have identical structure, dtypes and bits.

    float32 scalars (losses) are the exception: XLA may reassociate their
    float32 reductions or turn ``/ n`` into ``* (1 / n)``, which is not
    low-precision rounding. rtol=1e-6 is still far below a bf16 ulp (2**-8).
    """
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        if x.shape == () and x.dtype == np.float32:
            np.testing.assert_allclose(x, y, rtol=1e-6)
        else:
            np.testing.assert_array_equal(x, y)


def count_differences(a, b):
    return sum(int(np.sum(np.asarray(x) != np.asarray(y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
