r"""bf16 against FP8 step time for the built-in transformer, on whatever device JAX runs on.

.. code-block:: text

    for recipe in (none, delayed, current):       one compiled step each, bf16 compute,
        step(state, batch) timed round-robin        the same model, batch and microbatches
    ratio = median(FP8 step) / median(bf16 step)

On an FP8 GPU (H100, H200) each FP8 matmul, forward and both transposes, takes FP8 operands
and compiles to an FP8 GEMM (``benchmarks/fp8_gemm_forms.py``), so a model wide enough for its
matmuls to dominate (``--d-model 2048`` or more) should run faster in FP8; on a CPU, which has
no FP8 units, the amaxes and casts are extra work and the step is slower. On one H200 (JAX
0.11.2) this benchmark did not finish within 170 s with 0.11's FP8 form (docs/fp8.md): give
it a generous limit there.
The device, and the compiled programs' FP8 GEMMs (``__cublas$lt$matmul$f8`` custom calls, on a
GPU) and FP8-typed values, are in the output. Run it as ``python -m benchmarks.fp8_step --d-model 2048 --layers 4``
(``--json F`` writes the result).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from typing import Any

import jax
import numpy as np

from benchmarks import print_result
from leanstep.bench.timing import time_interleaved
from leanstep.training import RunConfig, build_run

__all__ = ["main", "measure"]

RECIPES = ("none", "delayed", "current")


def measure(
    *, d_model: int, layers: int, batch_size: int, seq_len: int, microbatches: int, repeats: int, heads: int = 16
) -> dict[str, Any]:
    """Times one step per recipe; returns milliseconds, ratios and the FP8 GEMMs XLA emitted.

    Example:
      >>> result = measure(d_model=32, layers=1, batch_size=4, seq_len=8, microbatches=1, repeats=2, heads=2)
      >>> sorted(result["step_ms"]), result["hlo"]["none"]["fp8_values"], result["hlo"]["delayed"]["fp8_values"] > 0
      (['current', 'delayed', 'none'], 0, True)
    """
    calls, gemms = {}, {}
    for recipe in RECIPES:
        config = RunConfig(
            size="small", d_model=d_model, n_layers=layers, n_heads=heads, d_ff=4 * d_model, batch_size=batch_size,
            seq_len=seq_len, microbatches=microbatches, steps=10, fp8=recipe, remat="dots",
            precision="params=float32,compute=bfloat16,output=float32",
        )  # fmt: skip
        run = build_run(config)
        tokens = np.random.default_rng(0).integers(0, 256, (batch_size, seq_len + 1), dtype=np.int32)
        batch = {"tokens": jax.device_put(tokens)}
        step = run.make_step()
        holder = {"state": run.init_state()}
        hlo = step.lower(holder["state"], batch).compile().as_text() or ""
        # FP8 GEMMs as XLA's GPU backend emits them, and the FP8-typed values of the program.
        gemms[recipe] = {
            "gemms": hlo.count("__cublas$lt$matmul$f8"),
            "fp8_values": len(re.findall(r"f8e[45]m[23]", hlo)),
        }

        def call(step: Any = step, holder: dict = holder, batch: Any = batch) -> None:
            holder["state"], metrics = step(holder["state"], batch)
            jax.block_until_ready(metrics.loss)

        calls[recipe] = call
    times = time_interleaved(calls, repeats=repeats, warmup=2)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {
        "device": str(jax.devices()[0].device_kind),
        "model": {"d_model": d_model, "layers": layers, "batch_size": batch_size, "seq_len": seq_len},
        "step_ms": ms,
        "ratio_to_bf16": {name: ms[name] / ms["none"] for name in RECIPES},
        "hlo": gemms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_step", description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(
        d_model=args.d_model, layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len,
        microbatches=args.microbatches, repeats=args.repeats, heads=args.heads,
    )  # fmt: skip
    return print_result(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
