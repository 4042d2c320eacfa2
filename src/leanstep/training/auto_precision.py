r"""``--precision auto``: bfloat16 compute only where the device multiplies it faster than float32.

bfloat16 halves activation memory and, on hardware that multiplies it natively, doubles matmul
throughput or better: NVIDIA GPUs from compute capability 8.0 (Ampere), AMD Instinct GPUs and
TPUs, where ``auto`` picks it. Elsewhere it is emulated: XLA:CPU on an AVX2 core runs a
bfloat16 step 1.3-1.4x slower than float32, so ``auto`` computes in float32 there.

A CPU with AMX or AVX512-BF16 has the units, but whether XLA:CPU uses them is the compiler's
business: on a 2-core Xeon with ``amx_bf16`` and ``avx512_bf16``, jaxlib 0.10.2 multiplied a
2048² bfloat16 matrix at 248 GFLOP/s against float32's 321 (PyTorch's oneDNN: 2,427 against
364), and the default step ran 69 ms in bfloat16 against 49 ms in float32. So on such a CPU
``auto`` times one jitted :data:`PROBE_SIZE`² matmul in each dtype (:func:`xla_matmul_rates`,
about 0.3 s) and computes in bfloat16 only if it ran at least :data:`MIN_BF16_SPEEDUP` times
float32's rate:

.. math::

    \text{bfloat16} \iff \text{bf16 units} \wedge r_{\text{bf16}} \ge 1.25\, r_{\text{f32}}

Either way the masters are float32 and every other technique stays on; the choice and its
reason (with the two rates, where they were measured) are recorded in the run's
``config.json``, and a resumed run keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["BFLOAT16", "FLOAT32", "MIN_BF16_SPEEDUP", "PROBE_SIZE", "choose_precision", "cpu_flags",
           "device_precision", "resolve_precision", "xla_matmul_rates"]

#: The two policies ``auto`` chooses between.
BFLOAT16 = "params=float32,compute=bfloat16,output=float32"
FLOAT32 = "params=float32,compute=float32,output=float32"
#: CPU flags (``/proc/cpuinfo``) of native bfloat16 matrix arithmetic.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: On a CPU with bfloat16 units, ``auto`` needs bfloat16 matmuls this many times faster than float32's.
MIN_BF16_SPEEDUP = 1.25
#: The side of the square matmul :func:`xla_matmul_rates` times.
PROBE_SIZE = 1024


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


def xla_matmul_rates(size: int = PROBE_SIZE, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of one jitted ``size × size`` matmul on JAX's default device, per dtype.

    Each dtype's rate is the best of ``repeats`` timings of three back-to-back calls, after a
    call that compiles it.

    Returns:
      ``{"bfloat16": GFLOP/s, "float32": GFLOP/s}``.
    """
    import time  # noqa: PLC0415 (only the probe times anything)

    rates = {}
    for dtype in ("bfloat16", "float32"):
        a = jnp.ones((size, size), dtype)
        matmul = jax.jit(lambda x: x @ x)
        matmul(a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            for _ in range(3):
                out = matmul(a)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - began) / 3)
        rates[dtype] = 2 * size**3 / best / 1e9
    return rates


def choose_precision(platform: str, *, compute_capability: str | None = None,
                     flags: frozenset[str] | None = None, matmul_rates: dict[str, float] | None = None,
                     ) -> tuple[str, str]:
    """``(policy, reason)`` for a device of ``platform`` (``jax.Device.platform``).

    Args:
      platform: ``"gpu"``/``"cuda"``, ``"rocm"``, ``"tpu"`` or ``"cpu"``.
      compute_capability: a CUDA device's, like ``"9.0"``.
      flags: a CPU's flags (:func:`cpu_flags`); None when they cannot be read.
      matmul_rates: on a CPU with bfloat16 units, :func:`xla_matmul_rates`; bfloat16 only if
        its rate is at least :data:`MIN_BF16_SPEEDUP` times float32's. None: the units
        decide alone.

    Example:
      >>> choose_precision("cpu", flags=frozenset({"avx2", "fma"}))[0] == FLOAT32
      True
      >>> choose_precision("cpu", flags=frozenset({"avx512f", "amx_bf16"}))[0] == BFLOAT16
      True
      >>> choose_precision("cpu", flags=frozenset({"amx_bf16"}), matmul_rates={"bfloat16": 248, "float32": 321})[1]
      "a CPU with amx_bf16, but XLA:CPU multiplies bfloat16 at 248 GFLOP/s against float32's 321 (a 1024² matmul; bfloat16 needs 1.25x): float32"
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
        return FLOAT32, (f"a CUDA GPU of compute capability {compute_capability} has no bfloat16 tensor cores "
                         "(8.0 and later do)")
    if platform == "rocm":
        return BFLOAT16, "an AMD GPU: bfloat16 matrix cores"
    if platform == "tpu":
        return BFLOAT16, "a TPU: its matrix units multiply bfloat16"
    if platform == "cpu":
        if flags is None:
            return FLOAT32, "a CPU whose flags cannot be read (no /proc/cpuinfo): float32, bfloat16 may be emulated"
        native = sorted(set(CPU_BF16_FLAGS) & flags)
        if native and matmul_rates is None:
            return BFLOAT16, f"a CPU with {' and '.join(native)}: native bfloat16 matrix arithmetic"
        if native:
            bf16, f32 = matmul_rates["bfloat16"], matmul_rates["float32"]
            rates = (f"XLA:CPU multiplies bfloat16 at {bf16:.0f} GFLOP/s against float32's {f32:.0f} "
                     f"(a {PROBE_SIZE}² matmul; bfloat16 needs {MIN_BF16_SPEEDUP:g}x)")
            if bf16 >= MIN_BF16_SPEEDUP * f32:
                return BFLOAT16, f"a CPU with {' and '.join(native)}, and {rates}: bfloat16"
            return FLOAT32, f"a CPU with {' and '.join(native)}, but {rates}: float32"
        return FLOAT32, ("a CPU without AMX or AVX512-BF16: XLA:CPU emulates bfloat16 matmuls, so float32 "
                         "compute is faster")
    return FLOAT32, f"an unknown platform {platform!r}: float32"


def cpuinfo_text() -> str | None:
    """``/proc/cpuinfo``, or None where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def device_precision(device: Any = None) -> tuple[str, str]:
    """:func:`choose_precision` for ``device`` (default: JAX's first device).

    On a CPU with bfloat16 units it times :func:`xla_matmul_rates` first (on JAX's default
    device, which is the CPU wherever the first device is).
    """
    device = jax.devices()[0] if device is None else device
    text = cpuinfo_text() if device.platform == "cpu" else None
    flags = None if text is None else cpu_flags(text)
    rates = xla_matmul_rates() if flags is not None and set(CPU_BF16_FLAGS) & flags else None
    return choose_precision(device.platform, compute_capability=getattr(device, "compute_capability", None),
                            flags=flags, matmul_rates=rates)


def resolve_precision(spec: str, *, priced_accelerator: bool = False) -> tuple[str, str | None]:
    """``(policy, reason)``: ``spec`` itself (reason None) unless it is ``"auto"``.

    ``auto`` is :func:`device_precision` for the device JAX runs on, or bfloat16 when a cluster
    of accelerators is being priced rather than run (every preset of
    :data:`leanstep.cost_model.ACCELERATORS` is a GPU with bfloat16 tensor cores).

    Example:
      >>> resolve_precision("float32")
      ('float32', None)
    """
    if spec != "auto":
        return spec, None
    if priced_accelerator:
        return BFLOAT16, "the accelerator priced has bfloat16 tensor cores"
    return device_precision()
