"""``curves.png``: a run's loss, loss scale, gradient norm and throughput against step.

:func:`plot_curves` draws it; :func:`report` redraws it for a run directory and returns the
run's summary (``leanstep report``).

Plots use :class:`matplotlib.figure.Figure` with the Agg canvas, never pyplot, so drawing
changes no global state (no backend switch, no open figures). The PNG is drawn in memory and
written atomically (:func:`leanstep.common.outputs.write_bytes_atomic`): a full disk or a read-only
folder leaves the old chart (or none), never half a file, and is an ``OSError`` naming the path.

Size: one figure of four panels and the report that redraws it.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import stat
from typing import Any, NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from leanstep.common.checks import is_real
from leanstep.common.files import describe_mode, read_regular_file, stat_path
from leanstep.common.outputs import write_bytes_atomic
from leanstep.training.metrics_log import RunMetrics, read_metrics
from leanstep.training.summary import summarize

__all__ = ["plot_curves", "report"]

#: The largest ``config.json`` :func:`report` reads (a run's is a few KiB).
MAX_CONFIG_BYTES = 64 << 20


def _ema(values: np.ndarray, span: int) -> np.ndarray:
    """Bias-corrected exponential moving average, decay ``1 - 2 / (span + 1)``."""
    decay = 1.0 - 2.0 / (span + 1.0)
    out = np.empty_like(values)
    mean = weight = 0.0
    for i, value in enumerate(values):
        mean = decay * mean + (1.0 - decay) * value
        weight = decay * weight + (1.0 - decay)
        out[i] = mean / weight
    return out


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def _ticks(ax: Any, steps: np.ndarray, height: float, color: str, label: str) -> None:
    """Vertical ticks at ``steps`` along one edge (``height`` in axes units): never hide data."""
    ax.plot(
        steps,
        np.full(steps.shape, height),
        "|",
        color=color,
        ms=9,
        mew=1.2,
        transform=ax.get_xaxis_transform(),
        label=label,
    )


def _mark_events(ax: Any, metrics: RunMetrics, skipped: np.ndarray) -> None:
    """Red ticks along the bottom at skipped steps, purple ones at steps skipped for a loss
    spike (``--spike-guard``); dotted lines at resumes."""
    if skipped.size:
        _ticks(ax, skipped, 0.02, "tab:red", f"skipped ({skipped.size})")
    spiked = metrics.train_column("step")[metrics.train_column("spiked") > 0] if metrics.train else np.zeros(0)
    if spiked.size:
        _ticks(ax, spiked, 0.05, "tab:purple", f"skipped for a spike ({spiked.size})")
    for i, step in enumerate(metrics.resumed_at):
        ax.axvline(step, color="0.4", ls=":", lw=1, label="resumed" if i == 0 else None)


def _finish(ax: Any, title: str, ylabel: str, has_data: bool) -> None:
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.35)
    if not has_data:
        ax.text(
            0.5,
            0.5,
            "no finite values",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="0.4",
            bbox={"fc": "white", "ec": "none"},
        )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small", framealpha=0.8)


def plot_curves(
    metrics: RunMetrics, path: str | os.PathLike[str], *, max_grad_norm: float | None = None
) -> pathlib.Path:
    """Draw a 2x2 PNG: loss, loss scale, gradient norm and throughput against step.

    Non-finite values are left out of the lines; skipped steps are red ticks on the first
    three panels, resumes dotted lines. The right axis of the loss panel reads the same curves
    in bits/byte (``nats / ln 2``).

    Args:
      metrics: from :func:`~leanstep.training.metrics_log.read_metrics`.
      path: the PNG to write.
      max_grad_norm: the clipping threshold, drawn dashed on the gradient-norm panel.

    Returns:
      ``path`` as a :class:`pathlib.Path`.

    Raises:
      ValueError: ``max_grad_norm`` is not a positive finite number (nothing is written).
      OSError: the PNG could not be written (``ENOSPC``, ``EACCES``, ...; same class and errno,
        ``filename`` = ``path``). Nothing is left half-written: an older ``path`` is untouched
        and the temporary file is removed. The caller decides what a missing chart means
        (the trainer and ``leanstep report`` warn; the numbers are elsewhere).

    Example:
      >>> import tempfile
      >>> from leanstep.training.records import TrainRecord
      >>> m = RunMetrics(train=(TrainRecord(1, 5.5, 3.0, 2.0**15, False, True, 0, 0.0, 9.0, 0.0),))
      >>> out = plot_curves(m, pathlib.Path(tempfile.mkdtemp()) / "curves.png", max_grad_norm=1.0)
      >>> out.read_bytes()[:8]
      b'\\x89PNG\\r\\n\\x1a\\n'
    """
    if max_grad_norm is not None and (
        not is_real(max_grad_norm) or not math.isfinite(max_grad_norm) or max_grad_norm <= 0
    ):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}; expected a positive finite number")
    path = pathlib.Path(path)
    summary = summarize(metrics)
    steps = metrics.train_column("step")
    # Fixed margins: a layout engine would measure every label and double the chart's time,
    # which a time-budgeted run spends inside its budget.
    fig = Figure(figsize=(10, 7), dpi=120)
    fig.subplots_adjust(left=0.1, right=0.93, bottom=0.07, top=0.91, wspace=0.34, hspace=0.3)
    FigureCanvasAgg(fig)
    (ax_loss, ax_scale), (ax_grad, ax_speed) = fig.subplots(2, 2)
    steps_drawn = _StepsDrawn(
        steps=steps,
        skipped=steps[metrics.train_column("skipped") > 0],
        style={"marker": "o", "ms": 3} if steps.size <= 30 else {},
        span=min(100, max(1, round(steps.size / 50))),
    )
    _plot_loss(ax_loss, metrics, steps_drawn)
    _plot_loss_scale(ax_scale, metrics, steps_drawn)
    _plot_grad_norm(ax_grad, metrics, steps_drawn, summary["clipped_steps"], max_grad_norm)
    _plot_throughput(ax_speed, metrics, steps_drawn, summary["mean_tokens_per_sec"])
    every_step = np.concatenate([steps, metrics.eval_column("step")])
    lo, hi = (every_step.min(), every_step.max()) if every_step.size else (0.0, 1.0)
    for ax in (ax_loss, ax_scale, ax_grad, ax_speed):
        ax.set_xlim(lo - max(0.5, 0.02 * (hi - lo)), hi + max(0.5, 0.02 * (hi - lo)))
    fig.suptitle(_title(metrics.name, summary), fontsize="large")
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return write_bytes_atomic(path, png.getvalue())


class _StepsDrawn(NamedTuple):
    """What every panel draws against: the steps, the skipped ones, the line style, the EMA span."""

    steps: np.ndarray
    skipped: np.ndarray
    style: dict[str, Any]  # markers for a short run
    span: int  # 1: no EMA (a short run)


def _plot_loss(ax: Any, metrics: RunMetrics, drawn: _StepsDrawn) -> None:
    """Train loss (raw, and an EMA for a long run) and held-out loss, in nats; bits/byte on the right."""
    steps, span = drawn.steps, drawn.span
    loss = metrics.train_column("loss")
    ok = np.isfinite(loss)
    if ok.any():
        # Short runs are drawn as they are; longer ones get a light raw line under an EMA.
        ax.plot(
            steps[ok], loss[ok], color="tab:blue", alpha=0.3 if span > 1 else 1.0, lw=0.8, label="train", **drawn.style
        )
    if span > 1 and ok.any():
        ax.plot(steps[ok], _ema(loss[ok], span), color="tab:blue", lw=1.8, label=f"train (EMA, span {span})")
    estep, eloss = metrics.eval_column("step"), metrics.eval_column("heldout_loss")
    eok = np.isfinite(eloss)
    if eok.any():
        final_bpb = metrics.eval[np.flatnonzero(eok)[-1]].heldout_bits_per_byte
        ax.plot(
            estep[eok],
            eloss[eok],
            "o-",
            color="tab:orange",
            ms=4,
            lw=1,
            label=f"held-out (final {final_bpb:.3f} bits/byte)",
        )
    ln2 = math.log(2.0)
    ax.secondary_yaxis("right", functions=(lambda x: x / ln2, lambda x: x * ln2)).set_ylabel("bits/byte")
    _mark_events(ax, metrics, drawn.skipped)
    _finish(ax, "train and held-out loss", "loss (nats/byte)", bool(ok.any() or eok.any()))


def _plot_loss_scale(ax: Any, metrics: RunMetrics, drawn: _StepsDrawn) -> None:
    """The loss scale as a step function, on a log2 axis."""
    scale = metrics.train_column("loss_scale")
    ok = np.isfinite(scale) & (scale > 0)
    ax.plot(
        drawn.steps[ok],
        scale[ok],
        color="tab:purple",
        drawstyle="steps-post",
        label="loss scale" if ok.any() else None,
        **drawn.style,
    )
    ax.set_yscale("log", base=2)
    _mark_events(ax, metrics, drawn.skipped)
    _finish(ax, "dynamic loss scale", "loss scale (log2)", bool(ok.any()))


def _plot_grad_norm(
    ax: Any, metrics: RunMetrics, drawn: _StepsDrawn, clipped_steps: int, max_grad_norm: float | None
) -> None:
    """The gradient norm before clipping (and a geometric EMA), the clipped steps and the threshold."""
    steps, span = drawn.steps, drawn.span
    grad = metrics.train_column("grad_norm")
    ok = np.isfinite(grad) & (grad > 0)
    ax.plot(
        steps[ok],
        grad[ok],
        color="tab:green",
        lw=0.8,
        alpha=0.35 if span > 1 else 1,
        label="grad norm" if ok.any() else None,
        **drawn.style,
    )
    if span > 1 and ok.any():  # geometric EMA: the panel is logarithmic
        ax.plot(
            steps[ok],
            np.exp(_ema(np.log(grad[ok]), span)),
            color="tab:green",
            lw=1.6,
            label=f"grad norm (EMA, span {span})",
        )
    _ticks(ax, steps[metrics.train_column("clipped") > 0], 0.98, "tab:orange", f"clipped ({clipped_steps})")
    if max_grad_norm is not None:
        ax.axhline(max_grad_norm, color="black", ls="--", lw=1, label=f"max_grad_norm = {max_grad_norm:g}")
    ax.set_yscale("log")
    _mark_events(ax, metrics, drawn.skipped)
    _finish(ax, "gradient global norm (before clipping)", "grad norm (log)", bool(ok.any()))


def _plot_throughput(ax: Any, metrics: RunMetrics, drawn: _StepsDrawn, mean_speed: float | None) -> None:
    """Tokens per second, the compiling steps (the first, and each resume's) left out, and their mean."""
    steps = drawn.steps
    speed = metrics.train_column("tokens_per_sec")
    compiling = np.isin(steps, np.concatenate([steps[:1], metrics.resumed_at]))
    ok = np.isfinite(speed) & ~compiling
    if ok.any():
        left_out = int(compiling.sum())
        ax.plot(
            steps[ok],
            speed[ok],
            color="tab:cyan",
            lw=0.9,
            **drawn.style,
            label=(f"tokens/sec ({left_out} compile step{'s' * (left_out != 1)} left out)"),
        )
    if mean_speed is not None:
        ax.axhline(mean_speed, color="0.3", ls="--", lw=1, label=f"mean {mean_speed:,.0f} (after compile)")
    if ok.any() and speed[ok].max() > 0:  # from zero, so a 2% wobble looks like one
        ax.set_ylim(0, 1.1 * speed[ok].max())
    _finish(ax, "throughput", "tokens/sec", bool(ok.any()))


def _title(name: str, summary: dict[str, Any]) -> str:
    """The chart's title: the run, its steps, its final losses, its skipped and clipped steps."""
    return (
        f"{name}: {summary['steps']:,} step{'s' * (summary['steps'] != 1)} · train loss "
        f"{_fmt(summary['final_train_loss'])} · held-out "
        f"{_fmt(summary['final_heldout_bits_per_byte'])} bits/byte (best "
        f"{_fmt(summary['best_heldout_bits_per_byte'])}) · {summary['skipped_steps']} skipped, "
        f"{summary['clipped_steps']} clipped"
    )


def report(run_dir: str | os.PathLike[str], *, chart: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Re-render a run directory's chart from its files and return its summary.

    A chart that cannot be written (a read-only run directory, a full disk) does not lose the
    summary: ``"curves"`` is then None and ``"curves_error"`` says why, in one line.

    Args:
      run_dir: a directory with ``metrics.jsonl`` and, optionally, ``config.json``
        (whose ``max_grad_norm`` is drawn as the clip threshold). Read as regular files only:
        a FIFO, device or symlink loop in their place is an error, never a hang.
      chart: where to write the PNG; default ``run_dir/curves.png``.

    Returns:
      :func:`summarize`'s dict plus ``"curves"``: the path of the PNG written, or None, and
      ``"curves_error"``: None, or why the PNG could not be written.

    Raises:
      FileNotFoundError: ``run_dir`` is not a directory, or its ``metrics.jsonl`` does not exist.
      ValueError: a file is malformed, not a regular file or a symlink loop (the message names it).

    Example:
      >>> import tempfile
      >>> from leanstep.training.metrics_log import MetricsWriter
      >>> from leanstep.training.records import EvalRecord, TrainRecord
      >>> run = pathlib.Path(tempfile.mkdtemp()) / "demo"; run.mkdir()
      >>> with MetricsWriter(run / "metrics.jsonl") as log:
      ...     for step in (1, 2):
      ...         log.write(TrainRecord(step, 3.0 / step, 1.0, 2.0**15, False, False, 0, 1e4,
      ...                               float(step), 1e-3), EvalRecord.from_loss(step, 2.0))
      >>> summary = report(run)
      >>> summary["steps"], summary["final_train_loss"], summary["curves"].endswith("curves.png")
      (2, 2.25, True)
      >>> summary["curves_error"] is None
      True
    """
    run_dir = pathlib.Path(run_dir)
    if not os.path.lexists(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    # A symlink loop or a denied stat says so (ValueError), rather than "not found".
    if not stat.S_ISDIR(stat_path(run_dir, what=f"run directory {str(run_dir)!r}").st_mode):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    metrics_path = run_dir / "metrics.jsonl"
    if os.path.lexists(metrics_path):  # a FIFO in its place would block read_metrics' open
        mode = stat_path(metrics_path, what=str(metrics_path)).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{metrics_path} is {describe_mode(mode)}, not a regular file")
    metrics = read_metrics(metrics_path)
    config = None
    config_path = run_dir / "config.json"
    if os.path.lexists(config_path):
        text = read_regular_file(config_path, what=str(config_path), limit=MAX_CONFIG_BYTES)
        try:
            config = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{config_path} is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} holds {type(config).__name__}; expected an object")
    max_grad_norm = None if config is None else config.get("max_grad_norm")
    chart = run_dir / "curves.png" if chart is None else pathlib.Path(chart)
    curves = error_line = None
    try:
        curves = str(plot_curves(metrics, chart, max_grad_norm=max_grad_norm))
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    except OSError as error:
        error_line = f"cannot write the chart {str(chart)!r}: {error.strerror or error}"
    return {**summarize(metrics, config), "curves": curves, "curves_error": error_line}
