"""The theoretical CPU peak: parsed from sample /proc/cpuinfo texts, checked against hand-computed values."""

from __future__ import annotations

import os
import platform

import pytest

from leanstep.bench import cpu_peak
from leanstep.bench.cpu_peak import (
    FMA_UNITS_ASSUMPTION,
    parse_cgroup_cpu_limit,
    parse_cpuinfo,
    read_cpu_peak,
    theoretical_cpu_peak,
)

# AMD EPYC 7B13 (Zen 3, family 25 model 1) in a VM: AVX2 + FMA, no AVX-512; two processors, their
# clocks differ (the first one's is read).
EPYC_ZEN3 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
cpu MHz\t\t: 2450.000
siblings\t: 2
cpu cores\t: 2
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ht syscall nx lm pni ssse3 fma cx16 sse4_1 \
sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm bmi1 avx2 bmi2 sha_ni vaes vpclmulqdq

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC 7B13
cpu MHz\t\t: 3100.000
flags\t\t: fpu fma avx avx2 avx512f
"""

# Intel Xeon Platinum 8480+ (Sapphire Rapids): AVX-512, AVX-512 BF16 and AMX.
SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
cpu MHz\t\t: 2000.000
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl \
avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
"""

# AMD EPYC 9654 (Zen 4, family 25 model 17): AVX-512 on 256-bit datapaths.
EPYC_ZEN4 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9654 96-Core Processor
cpu MHz\t\t: 2400.000
flags\t\t: fpu sse sse2 fma avx avx2 avx512f avx512dq avx512_bf16
"""

# An ARM Neoverse N1 (AWS Graviton2): no x86 flags line.
NEOVERSE = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd0c
"""

# Sandy Bridge: AVX but no FMA.
SANDY_BRIDGE = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz
cpu MHz\t\t: 2600.000
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx
"""


def test_parse_cpuinfo_reads_the_first_processor_only():
    fields = parse_cpuinfo(EPYC_ZEN3)
    assert fields["model name"] == "AMD EPYC 7B13" and fields["cpu MHz"] == "2450.000"
    assert "avx512f" not in fields["flags"].split()  # the second processor's (made-up) flag is not read
    assert parse_cpuinfo("") == {}


def test_epyc_zen3_avx2_reads_cores_times_clock_times_8_lanes_times_4():
    peak = theoretical_cpu_peak(EPYC_ZEN3, cores=2)
    # 2 cores x 2.45 GHz x 8 float32 lanes x 2 (multiply + add) x 2 FMA units = 156.8 GFLOP/s.
    assert peak.gflops == pytest.approx(156.8)
    assert (peak.cores, peak.ghz, peak.float32_lanes, peak.fma_units) == (2, 2.45, 8, 2)
    assert peak.clock_source == "/proc/cpuinfo cpu MHz" and peak.cores_source == "os.sched_getaffinity"
    assert peak.model == "AMD EPYC 7B13" and peak.bf16_flags == () and peak.reason is None
    assert peak.fma_units_source == FMA_UNITS_ASSUMPTION and "assumed" in peak.fma_units_source
    assert any("hyperthread" in note for note in peak.notes)  # the 'hypervisor' flag: a VM


def test_sapphire_rapids_avx512_uses_16_lanes_and_the_cpufreq_max_clock():
    peak = theoretical_cpu_peak(SAPPHIRE_RAPIDS, cores=4, max_freq_khz="3800000\n")
    # 4 x 3.8 GHz x 16 x 2 x 2 = 972.8 GFLOP/s.
    assert peak.gflops == pytest.approx(972.8)
    assert (peak.ghz, peak.float32_lanes, peak.clock_source) == (3.8, 16, "cpufreq cpuinfo_max_freq")
    assert peak.bf16_flags == ("avx512_bf16", "amx_bf16")
    # Without cpufreq, the 'cpu MHz' line: 4 x 2.0 x 16 x 2 x 2 = 512.
    assert theoretical_cpu_peak(SAPPHIRE_RAPIDS, cores=4).gflops == pytest.approx(512.0)


def test_a_cgroup_quota_below_the_affinity_mask_limits_the_cores():
    peak = theoretical_cpu_peak(
        SAPPHIRE_RAPIDS, cores=4, max_freq_khz="3800000", cgroup_cpus=parse_cgroup_cpu_limit("150000 100000")
    )
    # 1.5 CPUs x 3.8 x 16 x 2 x 2 = 364.8.
    assert peak.gflops == pytest.approx(364.8) and peak.cores == 1.5
    assert "cgroup CPU quota (1.5 CPUs; 4 in the affinity mask)" == peak.cores_source
    assert theoretical_cpu_peak(SAPPHIRE_RAPIDS, cores=4, cgroup_cpus=8.0).cores == 4  # above the mask: no limit


@pytest.mark.parametrize("text, kwargs, cpus", [
    ("150000 100000\n", {}, 1.5),
    ("max 100000\n", {}, None),
    (None, {"cfs_quota_us": "200000\n", "cfs_period_us": "100000\n"}, 2.0),
    (None, {"cfs_quota_us": "-1\n", "cfs_period_us": "100000\n"}, None),
    (None, {}, None),
])  # fmt: skip
def test_parse_cgroup_cpu_limit(text, kwargs, cpus):
    assert parse_cgroup_cpu_limit(text, **kwargs) == cpus


def test_zen4_avx512_counts_its_256_bit_datapath():
    peak = theoretical_cpu_peak(EPYC_ZEN4, cores=2)
    # 2 x 2.4 x 8 (512-bit FMAs as two 256-bit halves) x 2 x 2 = 153.6.
    assert peak.gflops == pytest.approx(153.6) and peak.float32_lanes == 8
    assert any("Zen 4" in note for note in peak.notes) and peak.bf16_flags == ("avx512_bf16",)


@pytest.mark.parametrize("text, reason", [
    (NEOVERSE, "no x86 'flags' line"),
    (SANDY_BRIDGE, "no AVX-512 nor AVX2+FMA"),
    (EPYC_ZEN3.replace("cpu MHz", "cpu kHz"), "no clock"),
])  # fmt: skip
def test_no_peak_where_it_cannot_be_read(text, reason):
    peak = theoretical_cpu_peak(text, cores=2)
    assert peak.gflops is None and reason in peak.reason


def test_cores_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="cores must be an integer >= 1, got 0"):
        theoretical_cpu_peak(EPYC_ZEN3, cores=0)


def test_read_cpu_peak_reads_this_machine(monkeypatch):
    peak = read_cpu_peak()
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        with open("/proc/cpuinfo") as file:
            assert peak.model == parse_cpuinfo(file.read()).get("model name")
        if peak.gflops is not None:
            assert 0 < peak.cores <= len(os.sched_getaffinity(0))
            assert peak.gflops == pytest.approx(peak.cores * peak.ghz * peak.float32_lanes * 2 * peak.fma_units)
        else:
            assert peak.reason
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert read_cpu_peak() == cpu_peak.CpuPeak(None, "not Linux (Darwin): no /proc/cpuinfo")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert read_cpu_peak().reason.startswith("not x86 (aarch64)") and read_cpu_peak().gflops is None
