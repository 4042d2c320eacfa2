"""What ``leanstep bench`` runs on: the host (:func:`machine_info`) and the accelerator with its peak.

On an accelerator the step is limited by the chip, not by the host CPU: the benchmark states the
chip's dense bf16 peak from :data:`CHIP_PEAKS` (the vendors' figures, keyed by JAX's
``device_kind``) and measures a large matmul beside it. The platform is a value
(:class:`Platform`), so the accelerator path can be run and tested anywhere by passing one.
"""

from __future__ import annotations

import dataclasses
import os
import platform as host
from typing import Any

import jax
import numpy as np

__all__ = ["ACCELERATOR_MATMUL_SIZES", "CHIP_PEAKS", "Platform", "detect_platform", "machine_info", "platform_for"]

#: ``(device_kind, dense bf16 FLOP/s per chip)``, ``device_kind`` exactly as
#: ``jax.devices()[0].device_kind`` spells it. Vendor figures:
#: Google Cloud TPU docs (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e): v4 275 TFLOP/s, v5e
#: 197, v5p 459, v6e (Trillium) 918 bf16 per chip. JAX names a v5e "TPU v5 lite", a v5p "TPU v5"
#: and a v6e "TPU v6 lite". NVIDIA datasheets, dense (without the 2:4 sparsity their headline
#: doubles): A100 312 TFLOP/s bf16 (SXM and PCIe), H100 SXM 989, H100 PCIe 756, H200 989.
CHIP_PEAKS: tuple[tuple[str, float], ...] = (
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
)

#: The sizes an accelerator's matmul peak is measured at: smaller ones do not fill a TPU's or a
#: GPU's matrix units (an 8192^2 bf16 product is about 5.6 ms on a v5e).
ACCELERATOR_MATMUL_SIZES = (4096, 8192, 16384)


@dataclasses.dataclass(frozen=True)
class Platform:
    """The facts of the device the benchmark runs on.

    Attributes:
      backend: ``jax.default_backend()``: ``"cpu"``, ``"tpu"``, ``"gpu"``.
      device_kind: ``jax.devices()[0].device_kind`` (``"TPU v5 lite"``; ``"cpu"`` on a CPU).
      peak_gflops: the chip's dense bf16 peak in GFLOP/s from :data:`CHIP_PEAKS`, or None (a CPU,
        or a chip not in the table).
      device_count: ``jax.device_count()``; the benchmark runs on the first device.
    """

    backend: str
    device_kind: str
    peak_gflops: float | None = None
    device_count: int = 1

    @property
    def accelerator(self) -> bool:
        """Whether the backend is anything but the CPU."""
        return self.backend != "cpu"


def platform_for(backend: str, device_kind: str, *, device_count: int = 1) -> Platform:
    """The :class:`Platform` of a backend and device kind, its peak looked up in :data:`CHIP_PEAKS`.

    Raises:
      ValueError: ``backend`` or ``device_kind`` is not a non-empty string.

    Example:
      >>> platform_for("tpu", "TPU v5 lite")
      Platform(backend='tpu', device_kind='TPU v5 lite', peak_gflops=197000.0, device_count=1)
      >>> platform_for("cpu", "cpu").peak_gflops is None, platform_for("tpu", "TPU v99").peak_gflops is None
      (True, True)
    """
    for name, value in (("backend", backend), ("device_kind", device_kind)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    peaks = dict(CHIP_PEAKS)
    peak = peaks.get(device_kind) if backend != "cpu" else None
    return Platform(backend, device_kind, None if peak is None else peak / 1e9, device_count)


def detect_platform() -> Platform:
    """This process's :class:`Platform`, from ``jax.default_backend()`` and the first device."""
    return platform_for(jax.default_backend(), jax.devices()[0].device_kind, device_count=jax.device_count())


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, instruction-set flags that matter for bf16, library versions."""
    model = "unknown"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        model = host.processor() or "unknown"
    info = {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma"}),
        "platform": host.platform(),
        "python": host.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "numpy": np.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    info["jax_threads"] = info["cores_available"]  # XLA:CPU's pool has one thread per available core
    return info
