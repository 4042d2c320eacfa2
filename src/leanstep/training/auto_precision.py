"""``--precision auto``: bfloat16 compute only where XLA multiplies it faster than float32.

bfloat16 halves activation memory and, where the compiler multiplies it on the device's matrix
units, doubles matmul throughput or better: NVIDIA GPUs from compute capability 8.0 (Ampere),
AMD Instinct GPUs and TPUs. ``auto`` computes in float32 on every CPU:

- without AMX or AVX512-BF16, XLA:CPU emulates bfloat16 matmuls: on an AVX2 EPYC a bfloat16
  step ran 1.3-1.4x slower than float32;
- with them, XLA:CPU does not use them (jaxlib 0.10.2, a 2-core Xeon with ``amx_bf16`` and
  ``avx512_bf16``): ``leanstep bench --quick``'s matmul probe gave bfloat16 at most 285
  GFLOP/s (median 157) against float32's 280 (median 267), where PyTorch's oneDNN reached
  1,437 against 385, and ``python -m benchmarks.step_profile`` timed the default step at
  59.8 ms in bfloat16 against 43.5 ms in float32.

The choice is a rule, not a timing taken at start-up, so that two runs of one command on one
machine compute in one dtype however loaded the machine is. Either way the masters are float32
and every other technique stays on; the choice and its reason are recorded in the run's
``config.json``, and a resumed run keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

__all__ = [
    "BFLOAT16",
    "FLOAT32",
    "bfloat16_units",
    "choose_precision",
    "cpu_flags",
    "device_precision",
    "resolve_precision",
]

#: The two policies ``auto`` chooses between.
BFLOAT16 = "params=float32,compute=bfloat16,output=float32"
FLOAT32 = "params=float32,compute=float32,output=float32"
#: CPU flags (``/proc/cpuinfo``) of native bfloat16 matrix arithmetic.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in ``/proc/cpuinfo`` text (``flags`` on x86, ``Features`` on ARM).

    Example:
      >>> sorted(cpu_flags("processor : 0\\nflags : fpu avx2 fma\\n\\nprocessor : 1\\nflags : fpu\\n"))
      ['avx2', 'fma', 'fpu']
    """
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def bfloat16_units(flags: frozenset[str] | None) -> list[str]:
    """The flags among :data:`CPU_BF16_FLAGS` a CPU has (none when its flags are unknown).

    Example:
      >>> bfloat16_units(frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
      ['amx_bf16', 'avx512_bf16']
    """
    return [] if flags is None else sorted(set(CPU_BF16_FLAGS) & flags)


def choose_precision(
    platform: str, *, compute_capability: str | None = None, flags: frozenset[str] | None = None
) -> tuple[str, str]:
    """``(policy, reason)`` for a device of ``platform`` (``jax.Device.platform``).

    Args:
      platform: ``"gpu"``/``"cuda"``, ``"rocm"``, ``"tpu"`` or ``"cpu"``.
      compute_capability: a CUDA device's, like ``"9.0"``.
      flags: a CPU's flags (:func:`cpu_flags`); None when they cannot be read.

    Example:
      >>> choose_precision("cpu", flags=frozenset({"avx2", "fma"}))[0] == FLOAT32
      True
      >>> choose_precision("cpu", flags=frozenset({"avx512f", "amx_bf16"}))[1]
      'a CPU with amx_bf16, which XLA:CPU does not multiply bfloat16 on (jaxlib 0.10.2 on a Xeon with AMX: bfloat16 matmuls no faster than float32, the default step 1.4x slower): float32'
      >>> choose_precision("cuda", compute_capability="7.0")[1]
      'a CUDA GPU of compute capability 7.0 has no bfloat16 tensor cores (8.0 and later do)'
    """
    if platform in ("gpu", "cuda"):
        try:
            major = int(str(compute_capability).split(".")[0])
        except ValueError:
            major = None
        if major is None:
            return BFLOAT16, "a CUDA GPU (compute capability unknown): bfloat16 tensor cores assumed"
        if major >= 8:
            return BFLOAT16, f"a CUDA GPU of compute capability {compute_capability} has bfloat16 tensor cores"
        return FLOAT32, (
            f"a CUDA GPU of compute capability {compute_capability} has no bfloat16 tensor cores (8.0 and later do)"
        )
    if platform == "rocm":
        return BFLOAT16, "an AMD GPU: bfloat16 matrix cores"
    if platform == "tpu":
        return BFLOAT16, "a TPU: its matrix units multiply bfloat16"
    if platform == "cpu":
        if flags is None:
            return FLOAT32, "a CPU whose flags cannot be read (no /proc/cpuinfo): float32, bfloat16 may be emulated"
        native = bfloat16_units(flags)
        if native:
            return FLOAT32, (
                f"a CPU with {' and '.join(native)}, which XLA:CPU does not multiply bfloat16 on "
                "(jaxlib 0.10.2 on a Xeon with AMX: bfloat16 matmuls no faster than float32, the "
                "default step 1.4x slower): float32"
            )
        return FLOAT32, (
            "a CPU without AMX or AVX512-BF16: XLA:CPU emulates bfloat16 matmuls, so float32 compute is faster"
        )
    return FLOAT32, f"an unknown platform {platform!r}: float32"


def cpuinfo_text() -> str | None:
    """``/proc/cpuinfo``, or None where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def device_precision(device: Any = None) -> tuple[str, str]:
    """:func:`choose_precision` for ``device`` (default: JAX's first device)."""
    device = jax.devices()[0] if device is None else device
    text = cpuinfo_text() if device.platform == "cpu" else None
    flags = None if text is None else cpu_flags(text)
    return choose_precision(
        device.platform, compute_capability=getattr(device, "compute_capability", None), flags=flags
    )


def resolve_precision(spec: str, *, priced_accelerator: bool = False) -> tuple[str, str | None]:
    """``(policy, reason)``: ``spec`` itself (reason None) unless it is ``"auto"``.

    ``auto`` is :func:`device_precision` for the device JAX runs on, or bfloat16 when a cluster
    of accelerators is being priced rather than run (every preset of
    :data:`leanstep.planning.cost_model.ACCELERATORS` is a GPU with bfloat16 tensor cores).

    Example:
      >>> resolve_precision("float32")
      ('float32', None)
    """
    if spec != "auto":
        return spec, None
    if priced_accelerator:
        return BFLOAT16, "the accelerator priced has bfloat16 tensor cores"
    return device_precision()
