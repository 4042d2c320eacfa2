"""The machine's limit: measured square-matmul throughput through XLA and through PyTorch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["measure_matmul_gflops", "xla_matmul", "torch_matmul"]


def _median_seconds(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def xla_matmul(size: int, dtype: str) -> Callable[[], Any]:
    """A zero-argument callable running one jitted ``(size, size) @ (size, size)`` in ``dtype``.

    The output has the inputs' dtype (as a bf16 model's matmuls do); XLA:CPU may accumulate
    in float32 internally.
    """
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.random.normal(key, (size, size), jnp.float32).astype(dtype) for key in keys)
    matmul = jax.jit(jnp.matmul)
    return lambda: matmul(a, b).block_until_ready()


def torch_matmul(size: int, dtype: str) -> Callable[[], Any]:
    """The same through ``torch.mm`` (CPU; oneDNN/MKL as the build chooses)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(getattr(torch, dtype)) for _ in range(2))
    return lambda: torch.mm(a, b)


def measure_matmul_gflops(
    make: Callable[[int, str], Callable[[], Any]],
    dtype: str,
    *,
    size: int = 2048,
    repeats: int = 5,
    max_call_s: float = 1.0,
    probe_size: int = 256,
) -> dict[str, Any]:
    r"""Median throughput of a square matmul, :math:`2 n^3 / t` in GFLOP/s.

    Sizes double from ``probe_size`` up to ``size`` while the next one is predicted
    (:math:`t \propto n^3`, from the last one measured) to take at most ``max_call_s``, so a
    dtype the library has no fast kernels for on this CPU (bf16 without AVX-512 BF16 or AMX
    can be ~100x slower than float32) still fits in the benchmark's time. The first call at
    each size (compilation, warm-up) is not timed; the size used is reported.

    Args:
      make: :func:`xla_matmul` or :func:`torch_matmul`.
      dtype: ``"float32"`` or ``"bfloat16"``.
      size: the largest matrix size ``n``.
      repeats: timed calls; the median is reported.
      max_call_s: the predicted time of one call the size must stay under.
      probe_size: the size of the probe (never more than ``size``).

    Returns:
      ``{"gflops", "size", "repeats", "seconds_median"}``.

    Raises:
      ValueError: ``dtype`` is not float32 or bfloat16, or ``size``/``repeats`` < 1.

    Example:
      >>> result = measure_matmul_gflops(xla_matmul, "float32", size=64, repeats=2)
      >>> result["size"], result["gflops"] > 0
      (64, True)
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if size < 1 or repeats < 1:
        raise ValueError(f"size and repeats must be >= 1, got size={size}, repeats={repeats}")
    current = min(probe_size, size)
    while True:
        run = make(current, dtype)
        run()
        seconds = _median_seconds(run, 1)
        if current * 2 > size or seconds * 8 > max_call_s:
            break
        current *= 2
    size = current
    seconds = _median_seconds(run, repeats)
    return {
        "gflops": 2.0 * size**3 / seconds / 1e9,
        "size": size,
        "repeats": repeats,
        "seconds_median": seconds,
    }
