"""``run_benchmark``: every measurement of ``leanstep bench`` in one interleaved run."""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from leanstep.bench.config import BenchConfig
from leanstep.bench.contenders import (
    Contender,
    Spec,
    build_jax_contender,
    build_torch_contender,
)
from leanstep.bench.cpu_peak import CpuPeak, read_cpu_peak
from leanstep.bench.matmul import measure_matmul_gflops, torch_matmul, xla_matmul
from leanstep.bench.timing import summarize_times, time_interleaved
from leanstep.bench.torch_step import torch_available
from leanstep.bench.utilization import describe_probe, model_flops_utilization
from leanstep.training import build_run

__all__ = ["BenchConfig", "machine_info", "run_benchmark"]

FLOPS_SOURCE = (
    "analytic: model.flops_per_token * batch_size * seq_len (6N + 12 L T d, forward + backward; "
    "remat recomputation not counted). XLA's cost analysis (xla_gflop) counts each lax.scan body once, "
    "not per iteration, so it is reported but not used."
)


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
        model = platform.processor() or "unknown"
    info = {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma"}),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "numpy": np.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    info["jax_threads"] = info["cores_available"]  # XLA:CPU's pool has one thread per available core
    return info


Limit = tuple[float | None, str]  # (GFLOP/s or None, what it is)


def _row(
    contender: Contender, times: list[float], gflop: float, probes: dict[str, Limit], cpu: Limit, tokens: int
) -> dict[str, Any]:
    spec = contender.spec
    summary = summarize_times(times)
    probe = f"{'torch' if spec.impl == 'torch' else 'xla'}_{spec.precision}"
    peak, what = probes.get(probe, (None, probe))
    achieved = gflop / (summary["step_ms_median"] / 1e3)
    mfu, mfu_note = model_flops_utilization(achieved, peak, limit=what)
    cpu_fraction, cpu_note = model_flops_utilization(achieved, cpu[0], limit=cpu[1])
    return {
        "impl": spec.impl, "precision": spec.precision, "num_microbatches": spec.num_microbatches,
        "remat": spec.remat, "variant": spec.variant, **summary, "repeats": len(times),
        "temp_bytes": contender.stats["temp_bytes"], "argument_bytes": contender.stats["argument_bytes"],
        "output_bytes": contender.stats["output_bytes"], "alias_bytes": contender.stats["alias_bytes"],
        "xla_gflop": contender.stats["xla_gflop"], "model_gflop_per_step": gflop, "tokens_per_step": tokens,
        "achieved_gflops": achieved, "mfu": mfu, "mfu_against": None if peak is None else probe,
        "mfu_peak_gflops": peak, "mfu_note": mfu_note, "cpu_peak_fraction": cpu_fraction, "cpu_peak_note": cpu_note,
        "first_loss": contender.first_loss,
        **({"torch": contender.info} if contender.info else {}),
    }  # fmt: skip


def _cpu_limit(cpu_peak: CpuPeak, peaks: dict[str, float | None], notes: list[str]) -> Limit:
    """The theoretical float32 peak as a limit, unless a measured float32 matmul beat it (then it is no limit)."""
    what = "theoretical float32 CPU peak"
    if cpu_peak.gflops is None:
        notes.append(f"no theoretical CPU peak: {cpu_peak.reason}")
        return None, what
    beaten = {
        key: value for key, value in peaks.items() if key.endswith("float32") and value and value > cpu_peak.gflops
    }
    if beaten:
        key, value = max(beaten.items(), key=lambda item: item[1])
        notes.append(
            f"the theoretical float32 CPU peak ({cpu_peak.gflops:.4g} GFLOP/s at {cpu_peak.ghz:.3g} GHz "
            f"from {cpu_peak.clock_source}) is below the measured {key} matmul ({value:.4g} GFLOP/s): "
            "the cores ran faster than that clock, so it is no limit and no row is reported against it"
        )
        return None, what
    return cpu_peak.gflops, what


def _find(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [row for row in rows if all(row[k] == v for k, v in match.items())]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _set_up_torch(config: BenchConfig, machine: dict[str, Any], notes: list[str]) -> bool:
    """Whether the torch rows run; if they do, torch's thread count is set and recorded in ``machine``."""
    with_torch = config.torch and torch_available()
    if config.torch and not with_torch:
        notes.append(
            "torch is not installed: torch rows skipped, torch ratios and peaks are null (pip install -e '.[bench]')."
        )
    if with_torch:
        import torch

        torch.set_num_threads(config.torch_threads or machine["jax_threads"])
        machine.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return with_torch


def _measure_matmuls(config: BenchConfig, with_torch: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """The matmul peaks, ``{backend}_{dtype}``: XLA, then torch (None without it), each float32 then bfloat16."""
    matmul: dict[str, Any] = {}
    for backend, make in (("xla", xla_matmul), ("torch", torch_matmul)):
        for dtype in ("float32", "bfloat16"):
            if backend == "torch" and not with_torch:
                matmul[f"{backend}_{dtype}"] = None
                continue
            log(f"matmul peak: {backend} {dtype}")
            matmul[f"{backend}_{dtype}"] = measure_matmul_gflops(
                make,
                dtype,
                max_size=config.matmul_size,
                repeats=config.matmul_repeats,
                max_seconds=config.matmul_max_seconds,
            )
    return matmul


def _build_contenders(
    config: BenchConfig,
    specs: list[Spec],
    model: Any,
    params: Any,
    optimizer: Any,
    tokens: np.ndarray,
    log: Callable[[str], None],
) -> dict[str, Contender]:
    """Every contender of ``specs``, compiled and past its first step, by :attr:`Spec.key`."""
    batch = {"tokens": jnp.asarray(tokens)}
    contenders: dict[str, Contender] = {}
    for spec in specs:
        log(f"compile + first step: {spec.key}")
        if spec.impl == "torch":
            contenders[spec.key] = build_torch_contender(
                spec,
                model.config,
                tokens,
                max_grad_norm=config.max_grad_norm,
                initial_loss_scale=config.initial_loss_scale,
                lr=config.lr,
                weight_decay=config.weight_decay,
                seed=config.seed,
            )
        else:
            contenders[spec.key] = build_jax_contender(
                spec,
                model,
                params,
                batch,
                optimizer,
                max_grad_norm=config.max_grad_norm,
                initial_loss_scale=config.initial_loss_scale,
            )
    return contenders


def _first_step_checks(ours: Contender, theirs: Contender) -> dict[str, Any]:
    """leanstep's first step against the hand-written one's, from the same parameters: losses, largest difference."""
    diffs = jax.tree.leaves(
        jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ours.first_params, theirs.first_params)
    )
    return {
        "first_step_loss_leanstep": ours.first_loss,
        "first_step_loss_handwritten": theirs.first_loss,
        "first_step_max_abs_param_diff": max(diffs),
    }


def _ratios(
    config: BenchConfig, rows: list[dict[str, Any]], paired: list[float], ours: Contender, theirs: Contender
) -> dict[str, float | None]:
    """leanstep's time and temporary memory over the hand-written step's, and its time over torch's per precision."""

    def median_ms(**match: Any) -> float | None:
        found = _find(rows, num_microbatches=config.num_microbatches, **match)
        return min((row["step_ms_median"] for row in found), default=None)

    ratios = {
        "leanstep_over_handwritten_time": _ratio(
            median_ms(impl="leanstep", precision="bfloat16", remat=config.remat), median_ms(impl="handwritten_jax")
        ),
        "leanstep_over_handwritten_time_paired_median": float(np.median(paired)),
        "leanstep_over_handwritten_temp_bytes": _ratio(ours.stats["temp_bytes"], theirs.stats["temp_bytes"]),
    }
    for precision in ("float32", "bfloat16"):
        ratios[f"leanstep_over_torch_time_{precision}"] = _ratio(
            median_ms(impl="leanstep", precision=precision, remat="full"), median_ms(impl="torch", precision=precision)
        )
    return ratios


def _mfu_summary(config: BenchConfig, rows: list[dict[str, Any]], gflop: float, cpu: Limit) -> dict[str, Any]:
    """The model FLOPs utilization of leanstep's main row (bf16, ``num_microbatches``, ``remat``)."""
    main_row = _find(
        rows, impl="leanstep", precision="bfloat16", num_microbatches=config.num_microbatches, remat=config.remat
    )[0]
    return {
        "flops_source": FLOPS_SOURCE,
        "model_gflop_per_step": gflop,
        "leanstep_achieved_gflops": main_row["achieved_gflops"],
        **{
            f"leanstep_{key}": main_row[key]
            for key in ("mfu", "mfu_against", "mfu_note", "cpu_peak_fraction", "cpu_peak_note")
        },
        "cpu_float32_peak_gflops": cpu[0],
    }


def _diagnostics(ours: Contender, theirs: Contender) -> dict[str, Any]:
    """HLO op counts of leanstep's step and the hand-written one, and each op whose count differs."""
    ours_ops, theirs_ops = ours.hlo_ops or {}, theirs.hlo_ops or {}
    return {
        "hlo_op_count_leanstep": sum(ours_ops.values()),
        "hlo_op_count_handwritten": sum(theirs_ops.values()),
        "hlo_ops_that_differ": {
            op: [ours_ops.get(op, 0), theirs_ops.get(op, 0)]
            for op in sorted(set(ours_ops) | set(theirs_ops))
            if ours_ops.get(op, 0) != theirs_ops.get(op, 0)
        },
    }


def _closing_notes(machine: dict[str, Any], notes: list[str]) -> None:
    """Records the end's load average in ``machine``; notes a busy machine, then how the timings were taken."""
    if hasattr(os, "getloadavg"):
        machine["load_average_1min_end"] = os.getloadavg()[0]
        # The start value is other processes' load (this one has not started working yet).
        if machine["load_average_1min"] > machine["cores_available"] / 2:
            notes.append(
                f"the machine was busy (1-minute load average {machine['load_average_1min']:.1f} at the "
                f"start, {machine['load_average_1min_end']:.1f} at the end, on {machine['cores_available']} "
                "cores): times are noisy, and PyTorch's OpenMP threads suffer most from a busy machine."
            )
    notes.append(
        "Timings are wall-clock medians of interleaved (round-robin) steps on random tokens; "
        "leanstep-vs-torch rows use remat 'full' on both sides (torch.utils.checkpoint per block)."
    )


def run_benchmark(config: BenchConfig, *, log: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Runs every measurement of ``config`` and returns the JSON-ready result.

    Order: matmul peaks (XLA, then torch; each the best of ``matmul_repeats`` calls at the
    best of several large sizes, :func:`leanstep.bench.measure_matmul_gflops`), the
    equivalence check of leanstep against the hand-written step (first step from the same
    parameters), then every step contender timed round-robin.

    A row's ``mfu`` is its model GFLOP/s over the peak of its own backend and compute dtype
    (``mfu_against``, ``mfu_peak_gflops``); where the row is faster than that probe the probe
    is no limit of it, and ``mfu`` is None with ``mfu_note`` saying so
    (:func:`leanstep.bench.model_flops_utilization`): never above 1. ``cpu_peak_fraction`` is the same
    against the theoretical float32 peak (:func:`leanstep.bench.read_cpu_peak`), None where
    that cannot be read or a measured float32 matmul beats it (a note says which).

    Returns:
      ``{"config", "machine", "peak_gflops", "matmul", "cpu_peak", "rows", "ratios", "mfu",
      "checks", "diagnostics", "notes"}``: ``peak_gflops`` the best-of-N GFLOP/s per
      ``{backend}_{dtype}``, ``matmul`` each measurement in full (median, every size),
      ``cpu_peak`` the :class:`leanstep.bench.CpuPeak` as a dict.
    """
    config.validate()
    notes: list[str] = []
    machine = machine_info()
    with_torch = _set_up_torch(config, machine, notes)
    matmul = _measure_matmuls(config, with_torch, log)
    peaks = {key: None if value is None else value["gflops"] for key, value in matmul.items()}
    probes = {key: (peaks[key], describe_probe(key, value)) for key, value in matmul.items() if value}
    cpu_peak = read_cpu_peak()
    cpu = _cpu_limit(cpu_peak, peaks, notes)

    run = build_run(config.run_config())
    model, optimizer, params = run.model, run.optimizer, run.init_params()
    tokens = np.random.default_rng(config.seed).integers(
        0, model.config.vocab_size, (config.batch_size, model.seq_len + 1), np.int32
    )
    tokens_per_step = config.batch_size * model.seq_len
    gflop = model.flops_per_token * tokens_per_step / 1e9
    contenders = _build_contenders(config, config.specs(with_torch), model, params, optimizer, tokens, log)

    main = Spec("leanstep", "bfloat16", config.num_microbatches, config.remat)
    hand = dataclasses.replace(main, impl="handwritten_jax")
    ours, theirs = contenders[main.key], contenders[hand.key]
    checks = _first_step_checks(ours, theirs)
    for contender in contenders.values():  # the first steps are done: free the copies
        contender.first_params = None

    repeats = {key: config.torch_repeats if c.spec.impl == "torch" else config.repeats for key, c in contenders.items()}
    log(f"timing {len(contenders)} contenders round-robin, {config.repeats} rounds")
    times = time_interleaved(
        {key: c.run for key, c in contenders.items()},
        repeats=repeats,
        warmup=config.warmup,
        on_round=lambda i, n: log(f"round {i + 1}/{n} done"),
    )
    rows = [_row(c, times[key], gflop, probes, cpu, tokens_per_step) for key, c in contenders.items()]
    paired = [a / b for a, b in zip(times[main.key], times[hand.key])]
    ratios = _ratios(config, rows, paired, ours, theirs)
    mfu = _mfu_summary(config, rows, gflop, cpu)
    diagnostics = _diagnostics(ours, theirs)
    _closing_notes(machine, notes)
    return {
        "config": {**dataclasses.asdict(config), "model": dataclasses.asdict(model.config),
                   "seq_len": model.seq_len, "tokens_per_step": tokens_per_step},
        "machine": machine, "peak_gflops": peaks, "matmul": matmul, "cpu_peak": dataclasses.asdict(cpu_peak),
        "rows": rows, "ratios": ratios,
        "mfu": mfu, "checks": checks, "diagnostics": diagnostics, "notes": notes,
    }  # fmt: skip
