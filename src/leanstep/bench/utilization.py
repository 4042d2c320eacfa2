"""Model FLOPs utilization against a limit the row can reach: never above 100%, or none and why."""

from __future__ import annotations

from typing import Any

from leanstep.common.checks import is_real

__all__ = ["describe_probe", "model_flops_utilization"]

_SHORT_DTYPES = {"float32": "float32", "bfloat16": "bf16"}


def describe_probe(key: str, measurement: dict[str, Any]) -> str:
    """Names a matmul probe of :func:`leanstep.bench.run_benchmark` for a message.

    Example:
      >>> describe_probe("torch_bfloat16", {"size": 512, "repeats": 5})
      'torch bf16 matmul probe (best of 5 at 512x512)'
    """
    backend, _, dtype = key.partition("_")
    size, repeats = measurement["size"], measurement["repeats"]
    return f"{backend} {_SHORT_DTYPES.get(dtype, dtype)} matmul probe (best of {repeats} at {size}x{size})"


def model_flops_utilization(
    achieved_gflops: float, peak_gflops: float | None, *, limit: str
) -> tuple[float | None, str | None]:
    r"""``achieved / peak`` when the peak limits the achieved throughput; otherwise None and why.

    .. math::

       u = \begin{cases} a / p & a \le p \\ \text{undefined} & a > p \end{cases}

    A throughput above the "peak" shows the peak is not the row's limit (a bf16 matmul probe
    on a CPU whose bf16 matmul takes a slow path, while the row runs much of its work in
    float32), so no fraction of it means anything; a utilization is never above 1.

    Args:
      achieved_gflops: the row's model GFLOP/s.
      peak_gflops: the limit, or None where none was measured (then ``(None, None)``).
      limit: what the peak is, for the message (:func:`describe_probe`).

    Returns:
      ``(u, None)`` with ``0 <= u <= 1``, or ``(None, reason)``, or ``(None, None)``.

    Raises:
      ValueError: ``achieved_gflops`` is negative or not finite, or ``peak_gflops`` is not > 0.

    Example:
      >>> model_flops_utilization(50.0, 100.0, limit="xla float32 matmul probe")
      (0.5, None)
      >>> model_flops_utilization(4.5, 1.35, limit="torch bf16 matmul probe")
      (None, 'peak meaningless: the row reaches 4.5 GFLOP/s, above the 1.35 GFLOP/s torch bf16 matmul probe')
    """
    if not is_real(achieved_gflops) or not 0 <= achieved_gflops < float("inf"):
        raise ValueError(f"achieved_gflops must be a finite number >= 0, got {achieved_gflops!r}")
    if peak_gflops is None:
        return None, None
    if not is_real(peak_gflops) or not peak_gflops > 0:
        raise ValueError(f"peak_gflops must be a number > 0 or None, got {peak_gflops!r}")
    if achieved_gflops > peak_gflops:
        return None, (
            f"peak meaningless: the row reaches {achieved_gflops:.3g} GFLOP/s, above the "
            f"{peak_gflops:.3g} GFLOP/s {limit}"
        )
    return achieved_gflops / peak_gflops, None
