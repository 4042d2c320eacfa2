"""``run_benchmark``: every measurement of ``leanstep bench`` in one interleaved run.

Size: one interleaved run: every contender's rows, ratios, limits and notes come from the same
measurements and are put together here; the machine, the timing, the matmul and each contender
are modules of their own.
"""

from __future__ import annotations

import dataclasses
import os
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
from leanstep.bench.machine import ACCELERATOR_MATMUL_SIZES, Platform, detect_platform, machine_info
from leanstep.bench.matmul import MATMUL_SIZES, measure_matmul_gflops, torch_matmul, xla_matmul
from leanstep.bench.timing import summarize_times, time_interleaved
from leanstep.bench.torch_step import torch_available
from leanstep.bench.utilization import describe_probe, model_flops_utilization
from leanstep.training import build_run

__all__ = ["BenchConfig", "machine_info", "run_benchmark"]  # machine_info: speedrun.py imports it here

FLOPS_SOURCE = (
    "analytic: model.flops_per_token * batch_size * seq_len (6N + 12 L T d, forward + backward; "
    "remat recomputation not counted). XLA's cost analysis (xla_gflop) counts each lax.scan body once, "
    "not per iteration, so it is reported but not used."
)


Limit = tuple[float | None, str]  # (GFLOP/s or None, what it is)


def _row(
    contender: Contender, times: list[float], gflop: float, probes: dict[str, Limit], cpu: Limit, tokens: int
) -> dict[str, Any]:
    spec = contender.spec
    summary = summarize_times(times)
    probe = f"{'torch' if spec.impl == 'torch' else 'xla'}_{spec.precision}"
    if spec.impl != "torch" and "chip" in probes:  # on an accelerator every XLA row runs on the chip
        probe = "chip"
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


def _chip_limit(platform: Platform, matmul: dict[str, Any], notes: list[str]) -> dict[str, Limit]:
    """The limit of every XLA row on an accelerator, as ``{"chip": limit}``: the chip's table peak, else the
    measured bf16 matmul (a note says so); ``{}`` on a CPU."""
    if not platform.accelerator:
        return {}
    if platform.peak_gflops is not None:
        return {"chip": (platform.peak_gflops, f"{platform.device_kind} dense bf16 peak (vendor figure)")}
    notes.append(
        f"device kind {platform.device_kind!r} is not in leanstep.bench.CHIP_PEAKS: "
        "MFU is against the measured xla bfloat16 matmul instead of the chip's peak"
    )
    measured = matmul.get("xla_bfloat16")
    return {"chip": (measured["gflops"], describe_probe("xla_bfloat16", measured))} if measured else {}


def _platform_summary(platform: Platform, peaks: dict[str, float | None]) -> dict[str, Any]:
    """The platform, the measured bf16 matmul as a fraction of the chip's peak, the device's memory use."""
    summary: dict[str, Any] = {**dataclasses.asdict(platform), "accelerator": platform.accelerator}
    summary["xla_bfloat16_matmul_fraction_of_peak"] = _ratio(peaks.get("xla_bfloat16"), platform.peak_gflops)
    stats = jax.devices()[0].memory_stats() if platform.accelerator else None
    summary["device_memory"] = (
        None if not stats else {k: stats.get(k) for k in ("bytes_limit", "peak_bytes_in_use", "bytes_in_use")}
    )
    return summary


def _find(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [row for row in rows if all(row[k] == v for k, v in match.items())]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _set_up_torch(config: BenchConfig, machine: dict[str, Any], notes: list[str], accelerator: bool) -> bool:
    """Whether the torch rows run; if they do, torch's thread count is set and recorded in ``machine``."""
    if config.torch and accelerator:
        notes.append("torch rows skipped on an accelerator: PyTorch's CPU build would time the host, not the chip.")
        return False
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


def _measure_matmuls(
    config: BenchConfig, with_torch: bool, log: Callable[[str], None], accelerator: bool
) -> dict[str, Any]:
    """The matmul peaks, ``{backend}_{dtype}``: XLA, then torch (None without it), each float32 then bfloat16.

    On an accelerator at :data:`ACCELERATOR_MATMUL_SIZES`, probed from the smallest (a chip runs
    small matmuls in their dispatch time, and each probe size is one more compilation).
    """
    sizes = ACCELERATOR_MATMUL_SIZES if accelerator else MATMUL_SIZES
    probe_size = ACCELERATOR_MATMUL_SIZES[0] if accelerator else 256  # 256: measure_matmul_gflops's default
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
                sizes=sizes,
                repeats=config.matmul_repeats,
                max_seconds=config.matmul_max_seconds,
                probe_size=probe_size,
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
    config: BenchConfig,
    rows: list[dict[str, Any]],
    paired: list[float],
    ours: Contender,
    theirs: Contender,
    notes: list[str],
) -> dict[str, float | None]:
    """leanstep's time and temporary memory over the hand-written step's, and its time over torch's per precision.

    The temp-bytes ratio is None (n/a) where XLA reports no temporaries for either step (a TPU
    does for a small program): 0 bytes over a few is no comparison of the two steps.
    """

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
    temps = (ours.stats["temp_bytes"], theirs.stats["temp_bytes"])
    if 0 in temps:
        ratios["leanstep_over_handwritten_temp_bytes"] = None
        notes.append(
            f"XLA reports {temps[0]} temp bytes for leanstep's step and {temps[1]} for the hand-written one: no ratio"
        )
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


def run_benchmark(
    config: BenchConfig,
    *,
    log: Callable[[str], None] = lambda message: None,
    platform: Platform | None = None,
) -> dict[str, Any]:
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

    On an accelerator (``platform.accelerator``) every XLA row's ``mfu`` is against the chip's
    dense bf16 peak (``mfu_against`` ``"chip"``; :data:`leanstep.bench.CHIP_PEAKS`, else the
    measured bf16 matmul), the matmuls are measured at
    :data:`leanstep.bench.ACCELERATOR_MATMUL_SIZES`, and neither the CPU's peak
    (``cpu_peak`` None) nor torch rows are measured.

    Args:
      config: what to measure.
      log: called with each progress line.
      platform: the device's facts; None: :func:`leanstep.bench.detect_platform`.

    Returns:
      ``{"config", "machine", "platform", "peak_gflops", "matmul", "cpu_peak", "rows", "ratios",
      "mfu", "checks", "diagnostics", "notes"}``: ``peak_gflops`` the best-of-N GFLOP/s per
      ``{backend}_{dtype}``, ``matmul`` each measurement in full (median, every size),
      ``cpu_peak`` the :class:`leanstep.bench.CpuPeak` as a dict (None on an accelerator),
      ``platform`` the :class:`leanstep.bench.Platform` as a dict with the bf16 matmul's
      fraction of its peak and the device's memory use.
    """
    config.validate()
    platform = detect_platform() if platform is None else platform
    notes: list[str] = []
    machine = machine_info()
    with_torch = _set_up_torch(config, machine, notes, platform.accelerator)
    matmul = _measure_matmuls(config, with_torch, log, platform.accelerator)
    peaks = {key: None if value is None else value["gflops"] for key, value in matmul.items()}
    probes = {key: (peaks[key], describe_probe(key, value)) for key, value in matmul.items() if value}
    probes.update(_chip_limit(platform, matmul, notes))
    cpu_peak = None if platform.accelerator else read_cpu_peak()
    cpu = (None, "theoretical float32 CPU peak") if cpu_peak is None else _cpu_limit(cpu_peak, peaks, notes)

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
    ratios = _ratios(config, rows, paired, ours, theirs, notes)
    mfu = _mfu_summary(config, rows, gflop, cpu)
    diagnostics = _diagnostics(ours, theirs)
    _closing_notes(machine, notes)
    return {
        "config": {**dataclasses.asdict(config), "model": dataclasses.asdict(model.config),
                   "seq_len": model.seq_len, "tokens_per_step": tokens_per_step},
        "machine": machine, "platform": _platform_summary(platform, peaks), "peak_gflops": peaks, "matmul": matmul,
        "cpu_peak": None if cpu_peak is None else dataclasses.asdict(cpu_peak),
        "rows": rows, "ratios": ratios,
        "mfu": mfu, "checks": checks, "diagnostics": diagnostics, "notes": notes,
    }  # fmt: skip
