"""The machine's limit: best-of-N square-matmul throughput through XLA and through PyTorch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.common.checks import is_int, is_real

__all__ = ["MATMUL_SIZES", "measure_matmul_gflops", "torch_matmul", "xla_float32_peak", "xla_matmul"]

#: The large sizes a peak is measured at: small matmuls do not fill the vector units.
MATMUL_SIZES = (1024, 2048, 3072, 4096)


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


def _times(run: Callable[[], Any], repeats: int, clock: Callable[[], float]) -> list[float]:
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        times.append(clock() - start)
    return times


def _check(
    dtype: str, max_size: Any, sizes: Sequence[Any], repeats: Any, max_call_s: Any, max_seconds: Any, probe_size: Any
) -> None:
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    for name, value in (("max_size", max_size), ("repeats", repeats), ("probe_size", probe_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not sizes or any(not is_int(size) or size < 1 for size in sizes):
        raise ValueError(f"sizes must be integers >= 1, got {tuple(sizes)!r}")
    for name, value in (("max_call_s", max_call_s), ("max_seconds", max_seconds)):
        if value is not None and (not is_real(value) or not value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


def measure_matmul_gflops(
    make: Callable[[int, str], Callable[[], Any]],
    dtype: str,
    *,
    max_size: int = 4096,
    sizes: Sequence[int] = MATMUL_SIZES,
    repeats: int = 5,
    max_call_s: float = 1.0,
    max_seconds: float | None = None,
    probe_size: int = 256,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    r"""The best throughput of large square matmuls, :math:`\max_n 2 n^3 / \min_i t_{n,i}` in GFLOP/s.

    A matmul's best time is the closest a timing comes to the machine's limit (other work
    only ever adds time), so the peak is the fastest of ``repeats`` calls, at the best of
    several sizes (``sizes`` up to ``max_size``). Each size is warmed up (compiled, caches
    filled) by one untimed call. The median is reported for information.

    Slow dtypes still finish: first a probe, doubling from ``probe_size`` while the next size
    is predicted (:math:`t \propto n^3`, from the last call) to take at most ``max_call_s``;
    then each size in ``sizes`` whose predicted call fits ``max_call_s`` and whose
    ``repeats + 1`` calls fit what is left of ``max_seconds`` (the total, measured from the
    start). Should none of ``sizes`` fit (bf16 without AVX-512 BF16 or AMX can be ~100x
    slower than float32), the largest probe size is measured instead.

    Args:
      make: :func:`xla_matmul` or :func:`torch_matmul`: ``make(n, dtype)`` returns a
        zero-argument callable that runs one ``n x n`` matmul to completion.
      dtype: ``"float32"`` or ``"bfloat16"``.
      max_size: the largest ``n``; if it is below every one of ``sizes``, ``n = max_size``.
      sizes: the large sizes to try.
      repeats: timed calls at each size; the fastest counts.
      max_call_s: the predicted time of one call a size must stay under.
      max_seconds: the time the whole measurement should stay under; None: no limit. At
        least one size is always measured.
      probe_size: the first size of the probe.
      clock: seconds, monotonic (tests pass a scripted one).

    Returns:
      ``{"gflops", "size", "repeats", "seconds_best", "gflops_median", "seconds_median",
      "by_size", "skipped_sizes"}``: the best throughput and the size and time it came from,
      the median throughput at that size, every measured size's
      ``{"size", "gflops", "gflops_median", "seconds_best", "seconds_median"}``, and the
      sizes left out for ``max_call_s`` or ``max_seconds``.

    Raises:
      ValueError: ``dtype`` is not float32 or bfloat16, a size, ``repeats`` or
        ``probe_size`` is not an integer >= 1, or a time limit is not > 0.

    Example:
      >>> result = measure_matmul_gflops(xla_matmul, "float32", max_size=64, repeats=2)
      >>> result["size"], result["gflops"] >= result["gflops_median"] > 0
      (64, True)
    """
    _check(dtype, max_size, sizes, repeats, max_call_s, max_seconds, probe_size)
    candidates = sorted({size for size in sizes if size <= max_size}) or [max_size]
    start = clock()

    def call_once(size: int) -> tuple[Callable[[], Any], float]:
        run = make(size, dtype)
        run()  # compile and warm up: not timed
        return run, _times(run, 1, clock)[0]

    size = min(probe_size, candidates[0])
    run, seconds = call_once(size)
    while size * 2 < candidates[0] and seconds * 8 <= max_call_s:
        size *= 2
        run, seconds = call_once(size)
    probe = (size, run)

    by_size, skipped = [], []

    def measure(size: int, run: Callable[[], Any]) -> float:
        times = _times(run, repeats, clock)
        best, median = min(times), statistics.median(times)
        by_size.append(
            {
                "size": size,
                "gflops": 2.0 * size**3 / best / 1e9,
                "gflops_median": 2.0 * size**3 / median / 1e9,
                "seconds_best": best,
                "seconds_median": median,
            }
        )
        return median

    for candidate in candidates:
        predicted = seconds * (candidate / size) ** 3
        left = None if max_seconds is None else max_seconds - (clock() - start)
        if predicted > max_call_s or (left is not None and by_size and predicted * (repeats + 1) > left):
            skipped = [c for c in candidates if c >= candidate]
            break
        if candidate == probe[0]:
            run = probe[1]
        else:
            run = make(candidate, dtype)
            run()
        size, seconds = candidate, measure(candidate, run)
    if not by_size:
        measure(*probe)
    best = max(by_size, key=lambda entry: entry["gflops"])
    return {
        "gflops": best["gflops"],
        "size": best["size"],
        "repeats": repeats,
        "seconds_best": best["seconds_best"],
        "gflops_median": best["gflops_median"],
        "seconds_median": best["seconds_median"],
        "by_size": by_size,
        "skipped_sizes": skipped,
    }


def xla_float32_peak(max_seconds: float = 10.0, *, max_size: int = 4096, repeats: int = 5) -> float:
    """The in-run XLA float32 matmul peak in GFLOP/s: :func:`measure_matmul_gflops` on :func:`xla_matmul`.

    What a float32 step compiled by XLA on this machine, in this process, with its load,
    can at best reach in its matmuls: the limit an MFU is measured against.

    Args:
      max_seconds: the time the measurement should stay under (at least one size is measured).
      max_size: the largest matrix size.
      repeats: timed calls at each size; the fastest counts.

    Returns:
      GFLOP/s, :math:`2 n^3 / t` of the fastest call at the best size.

    Raises:
      ValueError: as :func:`measure_matmul_gflops`.

    Example:
      >>> xla_float32_peak(5.0, max_size=128, repeats=2) > 0
      True
    """
    return measure_matmul_gflops(xla_matmul, "float32", max_size=max_size, repeats=repeats, max_seconds=max_seconds)[
        "gflops"
    ]
