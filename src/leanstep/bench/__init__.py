"""``leanstep bench``: leanstep's train step measured against what a user would write instead.

In one run, interleaved so that drift hits every contender alike:

1. leanstep's step against the same step written by hand in JAX and optax
   (:func:`make_handwritten_step`): time ratio, XLA compiled-memory ratio, and a check that
   both take the same first step;
2. the same step in PyTorch (:mod:`leanstep.bench.torch_step`; optional, CPU build), in
   float32 and bf16 autocast, eager and ``torch.compile``'d;
3. XLA's compiled memory (temp, argument, output bytes) and the step time of leanstep's step
   for each microbatch count and each remat policy;
4. the machine's measured matmul throughput through XLA and PyTorch, and leanstep's model
   FLOPs utilization against it.

PyTorch is a benchmark-only extra; without it the torch rows are skipped.
"""

from leanstep.bench.chart import plot_benchmark
from leanstep.bench.handwritten import (
    HandwrittenState,
    init_handwritten_state,
    make_handwritten_step,
)
from leanstep.bench.matmul import measure_matmul_gflops, torch_matmul, xla_matmul
from leanstep.bench.runner import BenchConfig, machine_info, run_benchmark
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

__all__ = [
    "BenchConfig",
    "HandwrittenState",
    "build_torch_model",
    "compiled_stats",
    "hlo_op_counts",
    "init_handwritten_state",
    "load_jax_params",
    "machine_info",
    "make_handwritten_step",
    "make_torch_step",
    "measure_matmul_gflops",
    "plot_benchmark",
    "run_benchmark",
    "summarize_times",
    "time_interleaved",
    "torch_available",
    "torch_matmul",
    "xla_matmul",
]
