"""Is the plan right? Run the planned step and measure it (benchmarks, not tests).

:func:`validate_plan` runs the chosen setting once in a child process and compares its
measured memory with the prediction; :func:`time_candidates` times every candidate's real
step. Both build their runs with :func:`leanstep.training.build_run`, as ``leanstep train`` does.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from benchmarks import child_env
from leanstep.step.train_step import JittedTrainStep
from leanstep.training.analysis import plan_run
from leanstep.training.build import build_run
from leanstep.training.config import RunConfig

__all__ = ["time_candidates", "validate_plan"]


def _run_inputs(config: RunConfig) -> tuple[JittedTrainStep, Any, Any]:
    """The jitted step, a materialized state and a device batch for ``config`` (as a run builds them;
    with ``config.mesh``, sharded over it, as ``leanstep train --mesh`` shards them)."""
    run = build_run(config)
    config = run.config  # --size and --precision auto resolved
    tokens = np.random.default_rng(config.seed).integers(0, 256, (config.batch_size, config.seq_len + 1))
    batch = {"tokens": tokens.astype(np.int32)}
    if config.mesh is None:
        return run.make_step(), run.init_state(), {"tokens": jax.device_put(batch["tokens"])}
    from leanstep.sharding.distributed import device_mesh, parse_mesh
    from leanstep.sharding.meshes import shard_batch
    from leanstep.step.state_sharding import shard_train_state

    mesh = device_mesh(shape=parse_mesh(config.mesh))
    state = shard_train_state(run.init_state(), mesh, rules=run.model.rules)
    return run.make_step(mesh=mesh), state, shard_batch(batch, mesh)


def _peak_rss_bytes() -> int:
    """The process's peak RSS: VmHWM on Linux, else ``ru_maxrss``.

    Not ``ru_maxrss`` on Linux: it also holds the peak of the process image that exec'd
    this one, and Python's subprocess execs from a vfork of the parent, so a child
    started from a big parent reports the parent's peak, whatever it does itself.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Sets the process's RSS high-water mark (ru_maxrss) to its current RSS (Linux >= 4.0)."""
    import ctypes
    import gc

    gc.collect()
    try:  # hand freed heap pages back, so that reusing them later shows up as growth
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_in_child(spec_path: str) -> None:
    """Runs one step of a planned setting and prints its memory as JSON (see :func:`validate_plan`)."""
    import json

    with open(spec_path) as f:
        spec = json.load(f)
    config = RunConfig(**spec["config"])
    if config.mesh is not None:
        import math

        from leanstep.sharding.distributed import configure_devices, parse_mesh

        configure_devices(math.prod(parse_mesh(config.mesh).values()))
    step, state, batch = _run_inputs(config)
    options = spec["compiler_options"]
    executable = step.lower(state, batch).compile(options) if options else step.lower(state, batch).compile()
    memory = executable.memory_analysis()
    if memory is None:  # JAX allows it; the measurement compares with it
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis of the compiled step")
    state, metrics = executable(state, batch)  # warm-up: thread pools and other one-time allocations
    jax.block_until_ready((state, metrics))
    reset = _reset_peak_rss()
    before = _peak_rss_bytes()
    state, metrics = executable(state, batch)
    jax.block_until_ready((state, metrics))
    rise = _peak_rss_bytes() - before
    devices = 1 if config.mesh is None else len(jax.devices())  # simulated devices share this process's memory
    print(
        json.dumps(
            {
                "compiled_peak_bytes": memory.argument_size_in_bytes
                + memory.output_size_in_bytes
                - memory.alias_size_in_bytes
                + memory.temp_size_in_bytes,
                "xla_peak_bytes": getattr(memory, "peak_memory_in_bytes", None),
                "argument_bytes": memory.argument_size_in_bytes,
                "rss_rise_bytes": rise,
                "devices": devices,
                "measured_peak_bytes": (rise + devices * memory.argument_size_in_bytes) / devices,
                "peak_reset": reset,
                "loss": float(metrics.loss),
            }
        )
    )


def validate_plan(
    config: RunConfig,
    budget_bytes: int | str,
    *,
    compiler_options: dict[str, Any] | None = None,
    timeout: float = 600.0,
    **plan_options: Any,
) -> dict[str, Any]:
    """Plans ``config`` for the budget, runs the chosen setting once in a subprocess, compares memory.

    .. code-block:: text

        predicted = plan's peak (abstract inputs)
        compiled  = the same formula on the executable a run compiles (real arrays, ``compiler_options``)
        measured  = rise of the child's peak RSS (VmHWM) over one step (high-water mark reset
                    just before it, after a warm-up step) + the argument bytes, resident before it;
                    on a mesh of D simulated devices, which share the child's memory, both are
                    summed over the devices and divided by D (per device, as predicted)

    A benchmark, not a test. ``compiler_options`` apply to the child's compile (default:
    XLA's, as a run compiles); ``plan_options`` go to :func:`leanstep.training.analysis.plan_run`.

    Returns:
      A dict: the setting, the three peaks, ``predicted_over_measured``,
      ``predicted_over_compiled``, ``ran`` (the step returned a finite loss),
      ``within_budget`` (measured <= budget) and the planning time.
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile

    result = plan_run(config, budget_bytes, **plan_options)
    chosen = result.chosen.setting
    layout: dict[str, Any] = {"mesh": chosen.mesh, "reduce": chosen.reduce, "devices": None} if chosen.mesh else {}
    run = dataclasses.replace(
        config,
        microbatches=chosen.num_microbatches,
        remat=chosen.remat,
        precision=chosen.precision,  # the plan's ("auto" resolved as it priced it)
        **layout,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"config": run.to_json(), "compiler_options": compiler_options}, f)
    code = f"from benchmarks.plan_check import measure_in_child; measure_in_child({f.name!r})"
    # A fixed mmap threshold makes every buffer over 64 KiB a fresh mapping whose pages count in the
    # RSS, instead of heap pages the warm-up step left resident (glibc raises the threshold on free).
    env = child_env({**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})  # the child imports benchmarks
    # check=False: a failure is raised below, with the child's stderr.
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if child.returncode:
        raise RuntimeError(f"the measuring subprocess failed ({child.returncode}):\n{child.stderr[-3000:]}")
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    predicted = result.chosen.peak_bytes
    return {
        "mesh": chosen.mesh,
        "reduce": chosen.reduce,
        "num_devices": result.num_devices,
        "model": config.model,
        "size": config.size,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "budget_bytes": result.budget_bytes,
        "setting": chosen._asdict(),
        "predicted_peak_bytes": predicted,
        **measured,
        "predicted_over_measured": predicted / max(measured["measured_peak_bytes"], 1),
        "predicted_over_compiled": predicted / measured["compiled_peak_bytes"],
        "ran": bool(np.isfinite(measured["loss"])),
        "within_budget": measured["measured_peak_bytes"] <= result.budget_bytes,
        "planning_seconds": result.seconds,
    }


def time_candidates(config: RunConfig, budget_bytes: int | str, *, steps: int = 5, rounds: int = 3) -> dict[str, Any]:
    """Times every candidate's real step (XLA's default options) and compares with the plan's choice.

    Each candidate is compiled, warmed up, then run ``steps`` times in each of ``rounds``
    interleaved rounds (so a change in machine load hits all alike); its time is the
    fastest step (on a shared machine the noise only ever adds time), the median is
    reported too. A benchmark, not a test.

    Returns:
      ``{"plan": Plan.to_json(), "rows": [...], "chosen_seconds", "fastest_fitting_seconds",
      "chosen_over_fastest"}``; each row has the setting, peak, fits, FLOPs, the median
      step time and the peak of the default-options executable.
    """
    result = plan_run(config, budget_bytes, exhaustive=True)
    runs = []
    for candidate in result.candidates:
        s = candidate.setting
        step, state, batch = _run_inputs(dataclasses.replace(config, microbatches=s.num_microbatches, remat=s.remat))
        executable = step.lower(state, batch).compile()
        memory = executable.memory_analysis()
        state, _ = executable(state, batch)
        jax.block_until_ready(state)
        runs.append([candidate, executable, state, batch, [], memory])
    for _ in range(rounds):
        for run in runs:
            for _ in range(steps):
                t0 = time.perf_counter()
                run[2], metrics = run[1](run[2], run[3])
                jax.block_until_ready((run[2], metrics))
                run[4].append(time.perf_counter() - t0)
    rows = [
        {
            **c.setting._asdict(),
            "peak_bytes": c.peak_bytes,
            "fits": c.fits,
            "flops": c.flops,
            "chosen": c is result.chosen,
            "seconds": float(np.min(times)),
            "median_seconds": float(np.median(times)),
            "default_options_peak_bytes": m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes,
        }
        for c, _, _, _, times, m in runs
    ]
    chosen = next(r["seconds"] for r in rows if r["chosen"])
    fastest = min(r["seconds"] for r in rows if r["fits"])
    return {
        "plan": result.to_json(),
        "rows": rows,
        "chosen_seconds": chosen,
        "fastest_fitting_seconds": fastest,
        "chosen_over_fastest": chosen / fastest,
    }
