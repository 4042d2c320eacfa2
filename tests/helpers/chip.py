"""What a test needs to know of the chip it runs on (issue 41, item 19: the suite on a TPU).

XLA:TPU runs a float32 matmul as bf16 passes by default (about three digits against a float64
reference; ``jax.default_matmul_precision("highest")``: about seven), divides float32 through an
approximate reciprocal (within an ulp or two, not correctly rounded), flushes subnormals to zero,
and has no float64 arithmetic. A test whose reference assumes the CPU's rounding runs its
products at full precision there (the ``float32_matmuls`` marker, :func:`float32_matmuls`),
allows what the chip's division gives (:data:`TPU_DIVISION_ULPS`), or says why it cannot hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

#: ULPs a float32 division on a TPU may be from the correctly rounded quotient (1 seen on a v5e).
TPU_DIVISION_ULPS = 2
#: A tanh MLP's float32 output on a TPU against float64 NumPy, relative and absolute, products at
#: "highest": the chip's tanh/exp/log are less exact than the CPU's (2.2e-5 seen on a v5e); ten times that.
TPU_TRANSCENDENTAL_TOLERANCE = 2e-4
#: Why a reference of six decimals (a published example, a seed contract) cannot hold on a TPU.
SIX_DECIMALS_ON_TPU = (
    "XLA:TPU's float32 tanh/exp/log agree with the CPU's to about five digits (1.7e-5 off a "
    "six-decimal loss on a v5e, products at 'highest'): the six-decimal contract is the CPU's"
)


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


@contextlib.contextmanager
def float32_matmuls() -> Iterator[None]:
    """float32 matmuls at float32 precision on every platform (the CPU's default; "highest" on a TPU)."""
    if not on_tpu():
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
