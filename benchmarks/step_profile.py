r"""Where a train step's time goes: its matmuls at their standalone speed, and everything else.

:func:`profile_step` compiles a run's step, times it, lists every dot and convolution of the
compiled program (:func:`benchmarks.hlo_matmuls.list_matmuls`, trips of the layer and
microbatch loops included), times each distinct one alone, and splits the step:

.. code-block:: text

    matmul_s     = sum over ops of  standalone seconds * trips        (each alone, in a compiled loop)
    rest_s       = step_s - matmul_s     elementwise, softmax, norms, embedding gather/scatter,
                                         optimizer, loop and per-op overhead
    mfu          = model_flops / step_s / peak        peak: a large float32 matmul, same process
    mfu_ceiling  = model_flops / matmul_s / peak      the MFU if only the matmuls ran

Run it as ``python -m benchmarks.step_profile --d-model 256 --d-ff 1024``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.hlo_matmuls import (
    MatmulOp,
    count_executed_ops,
    list_loops,
    list_matmuls,
    repeated_matmul,
)
from benchmarks.step_trace import format_trace, trace_kernels
from leanstep.bench.timing import time_interleaved
from leanstep.inspection.hlo_text import compiled_text
from leanstep.step.gradients import Gradients, gradient_stage
from leanstep.step.state import TrainState
from leanstep.step.update import guarded_update
from leanstep.training.build import Run, build_run
from leanstep.training.config import RunConfig

__all__ = ["format_profile", "profile_step"]


def _square_matmul(size: int) -> Callable[[], Any]:
    """A call of one jitted float32 ``(size, size) @ (size, size)``, to completion."""
    rng = np.random.default_rng(1)
    a, b = (jnp.asarray(rng.standard_normal((size, size), np.float32)) for _ in range(2))
    matmul = jax.jit(jnp.matmul).lower(a, b).compile()
    return lambda: matmul(a, b).block_until_ready()


def _phase_calls(run: Run, batch: dict[str, jax.Array]) -> dict[str, Callable[[], Any]]:
    """Calls of the step's parts, each jitted alone on its own state: ``forward`` (the loss of
    every microbatch, under ``lax.map``), ``gradients`` (the step's gradient stage, microbatch
    scan and accumulation included) and ``update`` (the guarded optimizer update)."""
    config, state = run.config, run.init_state()
    gradients = gradient_stage(run.loss_fn(), precision=run.precision, accumulation=config.microbatches)
    loss_fn, tokens = run.loss_fn(), batch["tokens"]
    microbatches = tokens.reshape(config.microbatches, -1, tokens.shape[1])

    def forward(params: Any, microbatches: jax.Array) -> jax.Array:
        params = run.precision.cast_to_compute(params)
        return jax.lax.map(lambda rows: loss_fn(params, {"tokens": rows}), microbatches)

    def update(state: TrainState, grads: Gradients) -> Any:
        return guarded_update(state, grads.grads, loss=grads.loss, max_grad_norm=config.max_grad_norm)

    grads_of = (
        jax.jit(lambda state, batch: gradients(state.params, batch, state.loss_scale)).lower(state, batch).compile()
    )
    grads = grads_of(state, batch)
    forward_of = jax.jit(forward).lower(state.params, microbatches).compile()
    update_of = jax.jit(update).lower(state, grads).compile()
    return {
        "forward": lambda: jax.block_until_ready(forward_of(state.params, microbatches)),
        "gradients": lambda: jax.block_until_ready(grads_of(state, batch)),
        "update": lambda: jax.block_until_ready(update_of(state, grads)),
    }


def _matmul_rows(
    groups: dict[tuple, list[MatmulOp]],
    times: dict[str, list[float]],
    prepared: dict[tuple, tuple[Callable[[], Any], int, tuple[str, ...]]],
) -> list[dict[str, Any]]:
    """One row per distinct op: its executions per step, FLOPs and standalone best seconds, slowest first."""
    rows = []
    for index, (key, same) in enumerate(groups.items()):
        op, (_, n, standalone_kinds) = same[0], prepared[key]
        seconds, count = min(times[f"matmul {index}"]) / n, sum(m.trips for m in same)
        rows.append(
            {
                "op": op.op,
                "lhs": op.lhs,
                "rhs": op.rhs,
                "result": op.result,
                "dimension_numbers": op.dimension_numbers,
                "names": [m.name for m in same],
                "fusion_kinds": sorted({m.fusion_kind or "unfused" for m in same}),
                "standalone_kinds": list(standalone_kinds),
                "count": count,
                "flops_each": op.flops,
                "flops_total": op.flops * count,
                "seconds_each": seconds,
                "seconds_total": seconds * count,
                "gflops": op.flops / seconds / 1e9,
            }
        )
    return sorted(rows, key=lambda row: -row["seconds_total"])


def _run_settings(config: RunConfig, run: Run) -> dict[str, Any]:
    """The profile's ``config``: ``run``'s model sizes and ``config``'s batch, microbatches, precision and remat."""
    sizes = run.model.config
    # An instance of the model's config dataclass (is_dataclass is True of the class too).
    model_config = dataclasses.asdict(sizes) if dataclasses.is_dataclass(sizes) and not isinstance(sizes, type) else {}
    return {
        **model_config,
        "model": config.model,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "microbatches": config.microbatches,
        "precision": config.precision,
        "remat": config.remat,
    }


def profile_step(
    config: RunConfig,
    *,
    repeats: int = 10,
    peak_size: int = 2048,
    phases: bool = True,
    trace_calls: int = 5,
    min_call_s: float = 0.02,
) -> dict[str, Any]:
    r"""Times ``config``'s train step and splits it into its matmuls (timed standalone) and the rest.

    .. math::
        \mathrm{MFU} = \frac{C_{tok} \cdot B T}{t_{step} \cdot P}, \qquad
        \mathrm{ceiling} = \frac{C_{tok} \cdot B T}{t_{mm} \cdot P}, \qquad
        t_{mm} = \sum_{ops} n_{op}\, t_{op}

    with :math:`C_{tok}` the model's analytic FLOPs per token, :math:`P` the best GFLOP/s of a
    ``peak_size``-square float32 matmul, :math:`n_{op}` the executions per step of a dot or
    convolution of the compiled step (trip counts of its while loops multiplied in) and
    :math:`t_{op}` the best time of one execution of the same op jitted alone, in a loop
    (:func:`repeated_matmul`). The step, the peak matmul, every standalone matmul and the
    phases are timed round-robin (:func:`leanstep.bench.time_interleaved`), so the load of
    other processes hits all alike; each keeps its best time. Everything is taken from
    ``config`` (model size, batch, microbatches, precision, remat).

    Args:
      config: the run; its step is built by :func:`leanstep.training.build_run`.
      repeats: timed rounds (after two warm-up rounds).
      peak_size: the size of the square matmul of the peak.
      phases: also time the step's parts, each jitted alone: the forward pass of every
        microbatch, the gradient stage and the guarded update, to split forward, backward and
        update.
      trace_calls: steps run under the profiler, to measure each kernel inside the step
        (:func:`benchmarks.step_trace.trace_kernels`); 0: none.
      min_call_s: the least time of one timed call of a standalone matmul's loop.

    Returns:
      A dict: ``step_s`` (best) and ``step_s_median``; ``matmuls`` (one row per distinct op,
      slowest first, with ``count``, ``flops_each``, ``seconds_each``, ``gflops``, the fusion
      kinds in the step and standalone); ``loops`` (``{"name", "trip_count", "runs"}``);
      ``executed_ops`` (kernels per step, :func:`count_executed_ops`) and ``other_ops`` (those
      that are not matmuls); ``matmul_s``, ``rest_s``, ``model_flops``, ``hlo_matmul_flops``;
      ``peak_gflops``, ``model_gflops``, ``matmul_gflops`` (HLO matmul FLOPs over
      ``matmul_s``), ``mfu``, ``mfu_ceiling``; with ``phases`` also ``forward_s``,
      ``gradients_s``, ``backward_s`` (``gradients_s - forward_s``), ``update_s`` and
      ``unaccounted_s`` (``step_s - gradients_s - update_s``); and ``config``, the model's
      sizes and the run's settings; with ``trace_calls`` also ``trace``, the kernels measured
      inside the step.

    Example:
      >>> config = RunConfig(model="mlp", size="tiny", n_layers=3, batch_size=4, seq_len=8, microbatches=2,
      ...                    steps=10, precision="params=float32,compute=float32,output=float32")
      >>> profile = profile_step(config, repeats=2, peak_size=128, phases=False, min_call_s=1e-3)
      >>> sorted(loop["trip_count"] for loop in profile["loops"])  # 2 microbatches; 3 layers forward, backward
      [2, 3, 3]
      >>> abs(profile["matmul_s"] + profile["rest_s"] - profile["step_s"]) < 1e-12
      True
    """
    run = build_run(config)
    config = run.config  # --size and --precision auto resolved
    rows, time_steps = config.batch_size, config.seq_len
    vocab = getattr(run.model.config, "vocab_size", 256)
    batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, vocab, (rows, time_steps + 1), np.int32))}
    state = run.init_state()
    compiled = run.make_step().lower(state, batch).compile()
    hlo = compiled_text(compiled)

    def one_step() -> None:
        nonlocal state
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))

    contenders: dict[str, Callable[[], Any]] = {"step": one_step, "peak": _square_matmul(peak_size)}
    if phases:
        contenders.update(_phase_calls(run, batch))
    ops = list_matmuls(hlo)
    groups: dict[tuple, list[MatmulOp]] = {}
    for op in ops:
        groups.setdefault(op.key, []).append(op)
    prepared = {key: repeated_matmul(same[0], min_call_s=min_call_s) for key, same in groups.items()}
    contenders.update({f"matmul {index}": prepared[key][0] for index, key in enumerate(groups)})
    # The peak's calls are long, so a burst of load elsewhere spoils more of them: three times the samples.
    times = time_interleaved(
        contenders, repeats={name: repeats * (3 if name == "peak" else 1) for name in contenders}, warmup=2
    )

    step_s = min(times["step"])
    profile: dict[str, Any] = {"step_s": step_s, "step_s_median": statistics.median(times["step"])}
    if phases:
        profile.update({f"{name}_s": min(times[name]) for name in ("forward", "gradients", "update")})
        profile["backward_s"] = profile["gradients_s"] - profile["forward_s"]
        profile["unaccounted_s"] = step_s - profile["gradients_s"] - profile["update_s"]
    if trace_calls:
        profile["trace"] = trace_kernels(one_step, hlo, calls=trace_calls)
    matmuls = _matmul_rows(groups, times, prepared)
    peak = 2.0 * peak_size**3 / min(times["peak"]) / 1e9
    matmul_s = sum(row["seconds_total"] for row in matmuls)
    matmul_flops = sum(op.total_flops for op in ops)
    model_flops = float(run.model.flops_per_token) * rows * time_steps
    executed = count_executed_ops(hlo)
    profile.update(
        {
            "config": _run_settings(config, run),
            "matmuls": matmuls,
            "loops": [
                {"name": loop.name, "trip_count": loop.trip_count, "runs": loop.runs}
                for loop in list_loops(hlo)
                if not loop.source.startswith("scatter")  # the compiler's, not the program's
            ],
            "executed_ops": executed,
            "other_ops": executed - sum(row["count"] for row in matmuls),
            "matmul_s": matmul_s,
            "rest_s": step_s - matmul_s,
            "model_flops": model_flops,
            "hlo_matmul_flops": matmul_flops,
            "peak_gflops": peak,
            "peak_size": peak_size,
            "model_gflops": model_flops / step_s / 1e9,
            "matmul_gflops": matmul_flops / matmul_s / 1e9 if matmul_s else float("inf"),
            "mfu": model_flops / step_s / 1e9 / peak,
            "mfu_ceiling": model_flops / matmul_s / 1e9 / peak if matmul_s else float("inf"),
        }
    )
    return profile


def _shape(shape: tuple[str, tuple[int, ...]]) -> str:
    return f"{shape[0]}[{','.join(map(str, shape[1]))}]"


def format_profile(profile: dict[str, Any]) -> str:
    """The profile as a text table: the matmuls, then the split of the step.

    Example:
      >>> row = {"op": "dot", "lhs": ("f32", (8, 4)), "rhs": ("f32", (4, 2)), "result": ("f32", (8, 2)),
      ...        "dimension_numbers": ((1,), (0,), (), ()), "count": 3, "flops_each": 128.0,
      ...        "seconds_each": 1e-6, "seconds_total": 3e-6, "gflops": 0.128, "fusion_kinds": ["unfused"]}
      >>> profile = {"matmuls": [row], "step_s": 1e-5, "matmul_s": 3e-6, "rest_s": 7e-6, "model_flops": 384.0,
      ...            "hlo_matmul_flops": 384.0, "peak_gflops": 100.0, "model_gflops": 0.0384, "mfu": 0.000384,
      ...            "mfu_ceiling": 0.00128, "matmul_gflops": 0.128, "executed_ops": 9,
      ...            "other_ops": 6}
      >>> print(format_profile(profile).splitlines()[2])
        3 dot  f32[8,4] x f32[4,2] -> f32[8,2]  c(1)x(0) b()x()  unfused  0.000128  0.001  0.003  0.128 100.0%
    """
    header = (
        f"{'count':>5} {'op':<4} {'lhs x rhs -> result':<44} {'contract/batch dims':<22} {'fusion':<8} "
        f"{'MFLOP':>8} {'ms/op':>8} {'ms/step':>8} {'GFLOP/s':>8} {'share':>6}"
    )
    lines = [header, "-" * len(header)]
    matmul_s = profile["matmul_s"] or float("inf")
    for row in profile["matmuls"]:
        numbers = row["dimension_numbers"]
        dims = (
            f"c{numbers[0]}x{numbers[1]} b{numbers[2]}x{numbers[3]}"
            if row["op"] == "dot"
            else f"{numbers[1]} {numbers[0]}"
        ).replace(",)", ")")
        kinds = "/".join(kind.replace("kCustom:__", "").replace("_fusion", "") for kind in row["fusion_kinds"])
        shapes = f"{_shape(row['lhs'])} x {_shape(row['rhs'])} -> {_shape(row['result'])}"
        lines.append(
            f"{row['count']:>5} {row['op'][:4]:<4} {shapes:<44} {dims:<22} {kinds:<8} "
            f"{row['flops_each'] / 1e6:>8.3g} {row['seconds_each'] * 1e3:>8.3g} "
            f"{row['seconds_total'] * 1e3:>8.3g} {row['gflops']:>8.3g} "
            f"{row['seconds_total'] / matmul_s:>6.1%}"
        )
    p = profile
    lines += [
        "",
        f"step            {p['step_s'] * 1e3:9.1f} ms   ({p['executed_ops']} kernels per step)",
        (
            f"  matmuls       {p['matmul_s'] * 1e3:9.1f} ms   {p['matmul_s'] / p['step_s']:.0%} of the step, "
            f"{p['matmul_gflops']:.1f} GFLOP/s, each op alone at its standalone speed"
        ),
        (
            f"  rest          {p['rest_s'] * 1e3:9.1f} ms   {p['rest_s'] / p['step_s']:.0%} of the step, "
            f"{p['other_ops']} other kernels, {p['rest_s'] / max(p['other_ops'], 1) * 1e6:.0f} us each"
        ),
    ]
    if "forward_s" in p:
        lines += [
            f"forward         {p['forward_s'] * 1e3:9.1f} ms   (jitted alone, every microbatch)",
            (
                f"backward        {p['backward_s'] * 1e3:9.1f} ms   (the gradient stage alone "
                f"{p['gradients_s'] * 1e3:.1f} ms - forward)"
            ),
            (
                f"update          {p['update_s'] * 1e3:9.1f} ms   (guarded optimizer update alone; "
                f"{p['unaccounted_s'] * 1e3:.1f} ms of the step in neither)"
            ),
        ]
    lines += [
        (
            f"model FLOPs     {p['model_flops'] / 1e9:9.3f} G    HLO matmul FLOPs "
            f"{p['hlo_matmul_flops'] / 1e9:.3f} G ({p['hlo_matmul_flops'] / p['model_flops']:.2f}x)"
        ),
        f"peak            {p['peak_gflops']:9.1f} GFLOP/s (large float32 matmul)",
        f"model           {p['model_gflops']:9.1f} GFLOP/s   MFU {p['mfu']:.1%}",
        f"ceiling         MFU {p['mfu_ceiling']:.1%} if only the matmuls ran, at their standalone speed",
    ]
    if "trace" in p:
        lines += format_trace(p["trace"], p["hlo_matmul_flops"])
    return "\n".join(lines)


def config_from_args(argv: Sequence[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    """The :class:`RunConfig` (float32 by default) and options of the command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__.split("\n")[0])
    for flag in ("--d-model", "--layers", "--heads", "--d-ff", "--batch-size", "--seq-len", "--microbatches"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--size", default="small")
    parser.add_argument("--precision", default="params=float32,compute=float32,output=float32")
    parser.add_argument("--remat")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-phases", action="store_true", help="skip timing forward, gradients and update alone")
    parser.add_argument("--trace-calls", type=int, default=5, help="steps to run under the profiler (0: none)")
    parser.add_argument("--json", help="also write the profile here")
    args = parser.parse_args(argv)
    fields = {
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "d_ff": args.d_ff,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "microbatches": args.microbatches,
        "remat": args.remat,
    }
    config = RunConfig(
        model=args.model,
        size=args.size,
        precision=args.precision,
        steps=300,
        **{key: value for key, value in fields.items() if value is not None},
    )
    return config, args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.step_profile [--d-model N ...]``: prints the profile's table."""
    config, args = config_from_args(argv)
    profile = profile_step(
        config.validate(), repeats=args.repeats, phases=not args.no_phases, trace_calls=args.trace_calls
    )
    print(format_profile(profile))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(profile, file, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
