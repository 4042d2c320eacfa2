"""The benchmark's PNG chart: time and memory against microbatches and remat policies."""

from __future__ import annotations

import io
import os
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from leanstep.common.outputs import write_bytes_atomic

__all__ = ["plot_benchmark"]

_MIB = 2.0**20
_COLORS = {"temp": "#d62728", "argument": "#1f77b4", "output": "#7f7f7f"}
_IMPL_COLORS = {"leanstep": "#2ca02c", "handwritten_jax": "#9467bd", "torch": "#ff7f0e"}


def _select(result: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if all(r[k] == v for k, v in match.items())]


def _wrap_policy(policy: str) -> str:
    """Breaks long policy names over lines so neighbouring tick labels do not overlap."""
    return policy.replace("save:", "save:\n").replace(",", ",\n").replace("_no_batch", "_no\n_batch")


def _time_panel(ax: Any, labels: list[str], rows: list[dict[str, Any]], title: str, xlabel: str) -> None:
    medians = [r["step_ms_median"] for r in rows]
    low = [r["step_ms_median"] - r["step_ms_min"] for r in rows]
    high = [r["step_ms_max"] - r["step_ms_median"] for r in rows]
    bars = ax.bar(labels, medians, yerr=[low, high], capsize=4, color=_IMPL_COLORS["leanstep"], alpha=0.85)
    ax.bar_label(bars, labels=[f"{m:.4g}" for m in medians], padding=2, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("step time, ms (median; bars: min-max)")
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def _memory_panel(ax: Any, labels: list[str], rows: list[dict[str, Any]], title: str, xlabel: str) -> None:
    width = 0.27
    positions = range(len(labels))
    for offset, (kind, key) in zip(
        (-width, 0.0, width), (("temp", "temp_bytes"), ("argument", "argument_bytes"), ("output", "output_bytes"))
    ):
        values = [(r[key] or 0) / _MIB for r in rows]
        bars = ax.bar([p + offset for p in positions], values, width, label=f"{kind}", color=_COLORS[kind])
        if kind == "temp":
            ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], padding=2, fontsize=8)
    ax.set_xticks(list(positions), labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("XLA compiled memory, MiB")
    ax.legend(fontsize=8, title="buffers", title_fontsize=8)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def _impl_panel(ax: Any, result: dict[str, Any]) -> None:
    config = result["config"]
    main = {"num_microbatches": config["num_microbatches"]}
    rows = _select(result, impl="leanstep", precision="bfloat16", remat=config["remat"], **main)
    rows += _select(result, impl="handwritten_jax", **main)
    for precision in ("float32", "bfloat16"):
        rows += _select(result, impl="leanstep", precision=precision, remat="full", **main)
        rows += _select(result, impl="torch", precision=precision, **main)
    seen, unique = set(), []
    for r in rows:
        key = (r["impl"], r["precision"], r["remat"], r["variant"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    short = {"leanstep": "leanstep", "handwritten_jax": "hand JAX", "torch": "torch"}
    labels = [
        "\n".join(
            filter(
                None,
                (short[r["impl"]], r["variant"], f"{'bf16' if r['precision'] == 'bfloat16' else 'f32'} {r['remat']}"),
            )
        )
        for r in unique
    ]
    medians = [r["step_ms_median"] for r in unique]
    bars = ax.bar(range(len(unique)), medians, color=[_IMPL_COLORS[r["impl"]] for r in unique])
    ax.bar_label(bars, labels=[f"{m:.4g}" for m in medians], padding=2, fontsize=7)
    ax.set_xticks(range(len(unique)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("step time, ms (median, log scale)")
    ax.set_title(f"implementations, {config['num_microbatches']} microbatches", fontsize=10)
    ax.margins(y=0.2)
    ax.grid(axis="y", alpha=0.3)


def _peak_panel(ax: Any, result: dict[str, Any]) -> None:
    peaks, matmul = result["peak_gflops"], result["matmul"]
    names = [k for k, v in peaks.items() if v]
    # A probe some row outran is no limit of that row (its MFU is left out): hatched and said so.
    outran = {r["mfu_against"] for r in result["rows"] if r.get("mfu_note") and r.get("mfu_against")}
    labels = [n.replace("_", "\n") + ("\n(not a limit)" if n in outran else "") for n in names]
    values = [peaks[k] for k in names]
    bars = ax.bar(labels, values, color="#8c8c8c", label="matmul peak (best of N)")
    for bar, name in zip(bars, names):
        if name in outran:
            bar.set_hatch("//")
    ax.bar_label(
        bars,
        labels=[f"{v:.3g}\n{(matmul.get(n) or {}).get('size', '')}²" for n, v in zip(names, values)],
        padding=2,
        fontsize=7,
    )
    cpu = (result.get("cpu_peak") or {}).get("gflops")
    if cpu:
        ax.axhline(cpu, color="#d62728", linestyle=":", label=f"CPU float32 theoretical: {cpu:.3g} GFLOP/s")
    platform = result.get("platform") or {}
    if platform.get("accelerator") and platform.get("peak_gflops"):
        peak = platform["peak_gflops"]
        ax.axhline(
            peak, color="#d62728", linestyle=":", label=f"{platform['device_kind']} bf16 peak: {peak:.4g} GFLOP/s"
        )
    achieved = result["mfu"]["leanstep_achieved_gflops"]
    ax.axhline(
        achieved, color=_IMPL_COLORS["leanstep"], linestyle="--", label=f"leanstep bf16 step: {achieved:.3g} GFLOP/s"
    )
    ax.set_yscale("log")
    ax.set_ylabel("GFLOP/s (log scale)")
    ax.set_title("the limit: best-of-N square matmul vs leanstep's model FLOPs/s", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.margins(y=0.2)
    ax.grid(axis="y", alpha=0.3)


def plot_benchmark(result: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Writes the chart of a :func:`run_benchmark` result as a PNG at ``path``; returns the path.

    Six panels: leanstep's step time and compiled memory (temp, argument and output bytes)
    against the number of microbatches and against the remat policy, every implementation's
    step time, and the measured best-of-N matmul peaks (hatched where a row outran one, so it
    is no limit of that row) and the CPU's theoretical float32 peak (on an accelerator: the chip's
    dense bf16 peak) against leanstep's achieved model FLOPs/s.

    Raises:
      OSError: the PNG could not be written (see :func:`leanstep.common.outputs.write_bytes_atomic`:
        nothing half-written is left at ``path``).
    """
    config, machine = result["config"], result["machine"]
    figure = Figure(figsize=(17, 9.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 3)
    sweep = sorted(
        _select(result, impl="leanstep", precision="bfloat16", remat=config["remat"]),
        key=lambda r: r["num_microbatches"],
    )
    labels = [str(r["num_microbatches"]) for r in sweep]
    title = f"leanstep bf16, remat '{config['remat']}', batch {config['batch_size']}"
    _time_panel(axes[0, 0], labels, sweep, title, "num_microbatches")
    _memory_panel(axes[1, 0], labels, sweep, title, "num_microbatches")
    policies = [
        _select(result, impl="leanstep", precision="bfloat16", remat=p, num_microbatches=config["num_microbatches"])
        for p in config["remat_sweep"]
    ]
    policy_rows = [found[0] for found in policies if found]
    policy_labels = [_wrap_policy(r["remat"]) for r in policy_rows]
    title = f"leanstep bf16, {config['num_microbatches']} microbatches"
    _time_panel(axes[0, 1], policy_labels, policy_rows, title, "remat policy")
    _memory_panel(axes[1, 1], policy_labels, policy_rows, title, "remat policy")
    _impl_panel(axes[0, 2], result)
    _peak_panel(axes[1, 2], result)
    model = config["model"]
    platform = result.get("platform") or {}
    device = f"{platform['device_kind']} | host " if platform.get("accelerator") else ""
    figure.suptitle(
        f"leanstep bench: transformer d_model={model['d_model']} layers={model['n_layers']} "
        f"heads={model['n_heads']} d_ff={model['d_ff']} seq={config['seq_len']} | "
        f"{device}{machine['cpu_model']}, {machine['cores_available']} cores | jax {machine['jax']}"
        + (f", torch {machine['torch']}" if machine.get("torch") else ""),
        fontsize=11,
    )
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    png = io.BytesIO()
    figure.savefig(png, format="png")
    return os.fspath(write_bytes_atomic(path, png.getvalue()))
