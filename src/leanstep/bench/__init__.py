"""``leanstep bench``: leanstep's train step measured against what a user would write instead.

In one run, interleaved so that drift hits every contender alike:

1. leanstep's step against the same step written by hand in JAX and optax
   (:func:`make_handwritten_step`): time ratio, XLA compiled-memory ratio, and a check that
   both take the same first step;
2. the same step in PyTorch (:mod:`leanstep.bench.torch_step`; optional, CPU build), in
   float32 and bf16 autocast, eager and ``torch.compile``'d;
3. XLA's compiled memory (temp, argument, output bytes) and the step time of leanstep's step
   for each microbatch count and each remat policy;
4. the machine's limit: the best-of-N matmul throughput through XLA and PyTorch and, where
   ``/proc/cpuinfo`` tells, the CPU's theoretical float32 peak; each row's model FLOPs
   utilization against the peak of its backend and dtype (never above 100%: none, and why,
   where the row outruns that probe). On an accelerator: the chip's dense bf16 peak
   (:data:`CHIP_PEAKS`) beside a large measured matmul, every row's MFU against the chip's peak.

``leanstep bench --speedrun`` (:func:`run_speedrun`) asks another question: held-out bits per byte
after equal wall-clock, leanstep's run against the same run written in PyTorch
(:func:`train_torch_peer`), with ``gzip -9`` and ``xz -9e`` (:func:`compression_references`).

PyTorch is a benchmark-only extra; without it the torch rows are skipped.
"""

from leanstep.bench.chart import plot_benchmark
from leanstep.bench.config import BenchConfig
from leanstep.bench.cpu_peak import (
    FMA_UNITS_ASSUMPTION,
    CpuPeak,
    parse_cgroup_cpu_limit,
    parse_cpuinfo,
    read_cpu_peak,
    theoretical_cpu_peak,
)
from leanstep.bench.handwritten import (
    HandwrittenState,
    init_handwritten_state,
    make_handwritten_step,
)
from leanstep.bench.machine import (
    ACCELERATOR_MATMUL_SIZES,
    CHIP_PEAKS,
    Platform,
    detect_platform,
    machine_info,
    platform_for,
)
from leanstep.bench.matmul import (
    MATMUL_SIZES,
    measure_matmul_gflops,
    torch_matmul,
    xla_float32_peak,
    xla_matmul,
)
from leanstep.bench.runner import run_benchmark
from leanstep.bench.speedrun import compression_references, run_speedrun
from leanstep.bench.speedrun_torch import (
    TorchPeerRun,
    choose_torch_precision,
    torch_heldout_bits_per_byte,
    train_torch_peer,
)
from leanstep.bench.timing import (
    compiled_stats,
    hlo_op_counts,
    summarize_times,
    time_interleaved,
)
from leanstep.bench.torch_step import (
    build_torch_model,
    load_jax_params,
    make_torch_step,
    torch_available,
)
from leanstep.bench.utilization import describe_probe, model_flops_utilization

__all__ = [
    "ACCELERATOR_MATMUL_SIZES",
    "CHIP_PEAKS",
    "FMA_UNITS_ASSUMPTION",
    "MATMUL_SIZES",
    "BenchConfig",
    "CpuPeak",
    "HandwrittenState",
    "Platform",
    "TorchPeerRun",
    "build_torch_model",
    "choose_torch_precision",
    "compiled_stats",
    "compression_references",
    "describe_probe",
    "detect_platform",
    "hlo_op_counts",
    "init_handwritten_state",
    "load_jax_params",
    "machine_info",
    "make_handwritten_step",
    "make_torch_step",
    "measure_matmul_gflops",
    "model_flops_utilization",
    "parse_cgroup_cpu_limit",
    "parse_cpuinfo",
    "platform_for",
    "plot_benchmark",
    "read_cpu_peak",
    "run_benchmark",
    "run_speedrun",
    "summarize_times",
    "theoretical_cpu_peak",
    "time_interleaved",
    "torch_available",
    "torch_heldout_bits_per_byte",
    "torch_matmul",
    "train_torch_peer",
    "xla_float32_peak",
    "xla_matmul",
]
