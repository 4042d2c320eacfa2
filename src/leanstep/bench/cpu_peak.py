r"""The CPU's theoretical float32 peak, read from ``/proc/cpuinfo``, cpufreq and the cgroup quota.

.. math::

   \text{peak GFLOP/s} = \text{cores} \times \text{GHz} \times \text{lanes} \times 2
   \times \text{FMA units}

``lanes``: float32 values per vector (16 with AVX-512, 8 with AVX2 + FMA); 2: a fused
multiply-add is two FLOPs; ``FMA units``: vector FMA pipes per core, **assumed** to be 2 (it
is not in ``/proc/cpuinfo``). Every reading says where it came from, because each can be
off: ``cpu MHz`` is the clock when read (in a VM, usually the host's nominal clock; the
cores may run faster), cpufreq's ``cpuinfo_max_freq`` is the one-core turbo (all cores under
AVX-512 run slower), and a VM's vCPU may be a hyperthread sharing its FMA units. A measured
matmul above this peak shows which way it is off.

The parsing functions take the files' text, so any machine's reading can be checked on a
copy of its files; :func:`read_cpu_peak` reads this machine's.
"""

from __future__ import annotations

import dataclasses
import os
import platform

__all__ = [
    "FMA_UNITS_ASSUMPTION",
    "CpuPeak",
    "parse_cgroup_cpu_limit",
    "parse_cpuinfo",
    "read_cpu_peak",
    "theoretical_cpu_peak",
]

#: Vector FMA units per core, and why: a fact of the core, not in ``/proc/cpuinfo``.
FMA_UNITS = 2
FMA_UNITS_ASSUMPTION = (
    "assumed: 2 vector FMA units per core (AMD Zen 2/3/4/5, Intel server cores since Haswell); "
    "1 on AMD Zen 1 and on Intel Xeon Bronze/Silver with AVX-512, which this would overstate 2x"
)
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_X86 = ("x86_64", "amd64", "i386", "i686")


@dataclasses.dataclass(frozen=True)
class CpuPeak:
    """A theoretical float32 peak and every number it is made of, each with its source.

    Attributes:
      gflops: ``cores * ghz * float32_lanes * 2 * fma_units``, or None where it cannot be read.
      reason: why ``gflops`` is None, else None.
      model: the ``model name`` line.
      cores: the CPUs this process may use (fractional under a cgroup quota).
      cores_source: where ``cores`` came from.
      ghz: the clock in GHz.
      clock_source: ``"cpufreq cpuinfo_max_freq"`` or ``"/proc/cpuinfo cpu MHz"``.
      float32_lanes: float32 values per FMA (16 AVX-512, 8 AVX2).
      fma_units: vector FMA units per core.
      fma_units_source: :data:`FMA_UNITS_ASSUMPTION`.
      bf16_flags: bf16 matrix instructions present (``avx512_bf16``, ``amx_bf16``): a bf16 peak
        above the float32 one (not computed here).
      notes: caveats of this reading.
    """

    gflops: float | None
    reason: str | None = None
    model: str | None = None
    cores: float | None = None
    cores_source: str | None = None
    ghz: float | None = None
    clock_source: str | None = None
    float32_lanes: int | None = None
    fma_units: int = FMA_UNITS
    fma_units_source: str = FMA_UNITS_ASSUMPTION
    bf16_flags: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of a ``/proc/cpuinfo`` text.

    Example:
      >>> parse_cpuinfo("processor : 0\\nmodel name : AMD EPYC\\n\\nprocessor : 1\\nmodel name : other\\n")
      {'processor': '0', 'model name': 'AMD EPYC'}
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, separator, value = line.partition(":")
        if separator:
            fields.setdefault(key.strip(), value.strip())
    return fields


def parse_cgroup_cpu_limit(
    cpu_max: str | None = None, *, cfs_quota_us: str | None = None, cfs_period_us: str | None = None
) -> float | None:
    """CPUs a cgroup quota allows (``quota / period``), or None for no quota.

    Args:
      cpu_max: the text of cgroup v2's ``cpu.max`` (``"max 100000"`` or ``"150000 100000"``).
      cfs_quota_us: cgroup v1's ``cpu.cfs_quota_us`` (``-1``: none), used without ``cpu_max``.
      cfs_period_us: cgroup v1's ``cpu.cfs_period_us``.

    Example:
      >>> parse_cgroup_cpu_limit("150000 100000"), parse_cgroup_cpu_limit("max 100000")
      (1.5, None)
      >>> print(parse_cgroup_cpu_limit(cfs_quota_us="-1", cfs_period_us="100000"))
      None
    """
    if cpu_max is not None:
        quota, _, period = cpu_max.strip().partition(" ")
    elif cfs_quota_us is not None and cfs_period_us is not None:
        quota, period = cfs_quota_us.strip(), cfs_period_us.strip()
    else:
        return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _vector(fields: dict[str, str], flags: set[str]) -> tuple[int | None, list[str]]:
    """Float32 lanes per FMA and caveats, from the flags (None: no FMA instructions)."""
    if "avx512f" in flags:
        if fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25":
            # Family 25 (0x19) with AVX-512 is Zen 4: 512-bit FMAs run as two 256-bit halves.
            return 8, ["AMD Zen 4 (family 25 with avx512f) executes a 512-bit FMA as two 256-bit halves: 8 lanes"]
        return 16, []
    if "avx2" in flags and "fma" in flags:
        return 8, []
    return None, []


def theoretical_cpu_peak(
    cpuinfo: str, *, cores: int, max_freq_khz: str | None = None, cgroup_cpus: float | None = None
) -> CpuPeak:
    r"""The float32 peak of an x86 CPU from its files' text: :math:`c \cdot f \cdot l \cdot 2 \cdot u`.

    Args:
      cpuinfo: the text of ``/proc/cpuinfo``.
      cores: the CPUs this process may run on (``len(os.sched_getaffinity(0))``).
      max_freq_khz: the text of ``/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq``
        (kHz), or None where there is none; then ``cpu MHz`` is used.
      cgroup_cpus: :func:`parse_cgroup_cpu_limit`; counted where below ``cores``.

    Returns:
      A :class:`CpuPeak`; its ``gflops`` is None, with the reason, when the text has no x86
      ``flags`` line, no FMA instructions or no clock.

    Raises:
      ValueError: ``cores`` is not >= 1.

    Example:
      >>> text = "model name : AMD EPYC\ncpu MHz : 2450.000\nflags : fpu avx avx2 fma\n"
      >>> peak = theoretical_cpu_peak(text, cores=2)
      >>> round(peak.gflops, 3), peak.float32_lanes, peak.clock_source
      (156.8, 8, '/proc/cpuinfo cpu MHz')
      >>> theoretical_cpu_peak("Features : fp asimd\n", cores=4).reason
      "no x86 'flags' line in /proc/cpuinfo (not x86? ARM lists 'Features')"
    """
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an integer >= 1, got {cores!r}")
    fields = parse_cpuinfo(cpuinfo)
    model = fields.get("model name")
    if "flags" not in fields:
        return CpuPeak(None, "no x86 'flags' line in /proc/cpuinfo (not x86? ARM lists 'Features')", model)
    flags = set(fields["flags"].split())
    bf16 = tuple(flag for flag in _BF16_FLAGS if flag in flags)
    lanes, notes = _vector(fields, flags)
    if lanes is None:
        return CpuPeak(None, "no AVX-512 nor AVX2+FMA in the cpuinfo flags", model, bf16_flags=bf16)
    used: float = cores
    cores_source = "os.sched_getaffinity"
    if cgroup_cpus is not None and cgroup_cpus < cores:
        used, cores_source = cgroup_cpus, f"cgroup CPU quota ({cgroup_cpus:g} CPUs; {cores} in the affinity mask)"
    ghz, clock_source = None, None
    if max_freq_khz is not None and max_freq_khz.strip().isdigit() and int(max_freq_khz) > 0:
        ghz, clock_source = int(max_freq_khz) / 1e6, "cpufreq cpuinfo_max_freq"
        notes.append(
            "cpuinfo_max_freq is the one-core turbo clock: all cores busy (or AVX-512 licence clocks) may run slower"
        )
    elif fields.get("cpu MHz"):
        try:
            ghz, clock_source = float(fields["cpu MHz"]) / 1e3, "/proc/cpuinfo cpu MHz"
            notes.append(
                "cpu MHz is the clock when read (in a VM usually the host's nominal clock): "
                "the cores may run faster, and a measured matmul can then exceed this peak"
            )
        except ValueError:
            pass
    if not ghz:
        return CpuPeak(
            None,
            "no clock: neither cpufreq cpuinfo_max_freq nor 'cpu MHz'",
            model,
            used,
            cores_source,
            float32_lanes=lanes,
            bf16_flags=bf16,
            notes=tuple(notes),
        )
    if "hypervisor" in flags:
        notes.append("a VM: a vCPU may be a hyperthread sharing its core's FMA units with another")
    gflops = used * ghz * lanes * 2 * FMA_UNITS
    return CpuPeak(
        gflops, None, model, used, cores_source, ghz, clock_source, lanes, bf16_flags=bf16, notes=tuple(notes)
    )


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def read_cpu_peak() -> CpuPeak:
    """This machine's :func:`theoretical_cpu_peak` (Linux on x86 only; otherwise None and why).

    Example:
      >>> peak = read_cpu_peak()
      >>> peak.gflops is None or peak.gflops > 0
      True
    """
    system, machine = platform.system(), platform.machine()
    if system != "Linux":
        return CpuPeak(None, f"not Linux ({system}): no /proc/cpuinfo")
    if machine.lower() not in _X86:
        return CpuPeak(None, f"not x86 ({machine}): the vector widths read here are x86's")
    cpuinfo = _read("/proc/cpuinfo")
    if cpuinfo is None:
        return CpuPeak(None, "/proc/cpuinfo cannot be read")
    cores = len(os.sched_getaffinity(0))
    cgroup = parse_cgroup_cpu_limit(
        _read("/sys/fs/cgroup/cpu.max"),
        cfs_quota_us=_read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        cfs_period_us=_read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    )
    return theoretical_cpu_peak(
        cpuinfo,
        cores=cores,
        cgroup_cpus=cgroup,
        max_freq_khz=_read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"),
    )
