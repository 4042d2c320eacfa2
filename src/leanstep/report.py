"""Read a run's ``metrics.jsonl``, summarize it, and draw ``curves.png``.

``leanstep train`` appends one JSON object per line: ``"train"`` records after every step and
``"eval"`` records after every held-out evaluation. A resumed run appends the steps after its
last checkpoint again, so the log is a sequence of timelines; the latest one wins. Plots use
:class:`matplotlib.figure.Figure` with the Agg canvas, never pyplot, so no global state changes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import typing
from typing import Any, NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.table import Table

__all__ = [
    "TrainRecord",
    "EvalRecord",
    "RunMetrics",
    "read_metrics",
    "plot_curves",
    "summarize",
    "render_summary",
    "report",
]


class TrainRecord(NamedTuple):
    """One ``"train"`` line: the state after optimizer step ``step`` (1-based)."""

    step: int
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    clipped: bool
    consecutive_skips: int
    tokens_per_sec: float
    elapsed_s: float
    lr: float


class EvalRecord(NamedTuple):
    """One ``"eval"`` line: held-out loss of the parameters after step ``step``."""

    step: int
    heldout_loss: float
    heldout_bits_per_byte: float


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    """A run's records, one per step (latest timeline), sorted by step.

    Attributes:
      train: the ``"train"`` records.
      eval: the ``"eval"`` records.
      name: the run's name (its directory's name).
      resumed_at: first step of each resumed timeline (a step not above one logged before it).
      dropped_lines: 1-based numbers of lines cut off by a crash mid-write and skipped.
    """

    train: tuple[TrainRecord, ...] = ()
    eval: tuple[EvalRecord, ...] = ()
    name: str = "run"
    resumed_at: tuple[int, ...] = ()
    dropped_lines: tuple[int, ...] = ()

    def train_column(self, field: str) -> np.ndarray:
        """``field`` of every train record as a float64 array (``step`` too)."""
        return np.array([getattr(r, field) for r in self.train], dtype=np.float64)

    def eval_column(self, field: str) -> np.ndarray:
        """``field`` of every eval record as a float64 array."""
        return np.array([getattr(r, field) for r in self.eval], dtype=np.float64)


_FIELDS = {
    kind: typing.get_type_hints(record_type).items()
    for kind, record_type in (("train", TrainRecord), ("eval", EvalRecord))
}
_RECORD_TYPES = {"train": TrainRecord, "eval": EvalRecord}


def _coerce(value: object, kind: type, where: str) -> Any:
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
    elif value is None:  # a writer that maps non-finite floats to null
        return math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{where} is {value!r}; expected {kind.__name__}")


def _parse_record(obj: object, where: str) -> TrainRecord | EvalRecord | None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is {obj!r}; expected a JSON object")
    if "kind" not in obj:
        raise ValueError(f"{where} has no 'kind' field; expected 'train' or 'eval'")
    record_type = _RECORD_TYPES.get(obj["kind"])
    if record_type is None:  # other kinds are for other readers
        return None
    values = []
    for field, kind in _FIELDS[obj["kind"]]:
        if field not in obj:
            raise ValueError(f"{where} ({obj['kind']!r} record) lacks the field {field!r}")
        values.append(_coerce(obj[field], kind, f"{where} field {field!r}"))
    return record_type(*values)


def _decode_line(line: str) -> tuple[object | None, bool]:
    """(object, whether a crash fragment was dropped) for one stripped line."""
    decoder = json.JSONDecoder()
    try:
        return decoder.decode(line), False
    except json.JSONDecodeError:
        pass
    if not line.startswith("{"):  # every record, and so every cut-off record, starts with "{"
        raise json.JSONDecodeError("not a JSON record", line, 0)
    # A run killed mid-write leaves a fragment without newline; the resumed run then
    # appends its first record to it. Recover that record from the line's tail.
    for start in (i for i, c in enumerate(line) if c == "{" and i > 0):
        try:
            obj, end = decoder.raw_decode(line, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and not line[end:].strip():
            return obj, True
    if not line.endswith("}"):
        return None, True
    raise json.JSONDecodeError("not a JSON record", line, 0)


def read_metrics(path: str | os.PathLike[str]) -> RunMetrics:
    """Read ``metrics.jsonl`` (or a run directory holding it) into :class:`RunMetrics`.

    Resumes are resolved like this: a train record for step ``s`` discards every earlier
    train record with step ``>= s`` and eval record with step ``> s`` (they belong to the
    abandoned timeline), so the last occurrence of a step wins. ``NaN``/``Infinity`` tokens
    and ``null`` floats read as non-finite floats.

    Args:
      path: the metrics file, or a directory containing ``metrics.jsonl``.

    Returns:
      The records sorted by step, named after the run directory.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: a line is neither a record nor a cut-off record, or a record lacks a field.

    Example:
      >>> import pathlib, tempfile
      >>> run = pathlib.Path(tempfile.mkdtemp()) / "demo"; run.mkdir()
      >>> rec = lambda s, loss: json.dumps(dict(kind="train", step=s, loss=loss, grad_norm=1.0,
      ...     loss_scale=2.0**15, skipped=False, clipped=False, consecutive_skips=0,
      ...     tokens_per_sec=1e4, elapsed_s=s, lr=1e-3))
      >>> lines = [rec(1, 5.0), rec(2, 4.0), rec(2, 3.5), rec(3, float("nan")), rec(4, 1)[:20]]
      >>> _ = (run / "metrics.jsonl").write_text("\\n".join(lines))
      >>> m = read_metrics(run)
      >>> [(r.step, r.loss) for r in m.train], m.resumed_at, m.dropped_lines
      ([(1, 5.0), (2, 3.5), (3, nan)], (2,), (5,))
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    train: dict[int, TrainRecord] = {}
    evals: dict[int, EvalRecord] = {}
    resumed_at: list[int] = []
    dropped: list[int] = []
    last_step = 0
    with path.open(encoding="utf-8") as file:
        for number, raw in enumerate(file, start=1):
            line = raw.strip()
            if not line:
                continue
            where = f"{path}:{number}"
            try:
                obj, fragment = _decode_line(line)
            except json.JSONDecodeError:
                raise ValueError(f"{where} is not JSON: {line[:80]!r}") from None
            if fragment:
                dropped.append(number)
            if obj is None:
                continue
            record = _parse_record(obj, where)
            if isinstance(record, TrainRecord):
                if train and record.step <= last_step:
                    resumed_at.append(record.step)
                    train = {s: r for s, r in train.items() if s < record.step}
                    evals = {s: r for s, r in evals.items() if s <= record.step}
                train[record.step] = record
                last_step = record.step  # steps only increase within one timeline
            elif isinstance(record, EvalRecord):
                evals[record.step] = record
    return RunMetrics(
        train=tuple(train[s] for s in sorted(train)),
        eval=tuple(evals[s] for s in sorted(evals)),
        name=path.resolve().parent.name or "run",
        resumed_at=tuple(resumed_at),
        dropped_lines=tuple(dropped),
    )


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def summarize(
    metrics: RunMetrics, config: dict | None = None, *, final_window: int = 10
) -> dict[str, Any]:
    """Headline numbers of a run; ``None`` where a number is unavailable.

    .. math::

       \\text{final\\_train\\_loss} = \\operatorname{mean}(\\text{last } k
       \\text{ finite train losses}),\\quad k = \\text{final\\_window}

    ``mean_tokens_per_sec`` leaves out the first step and the first step after each resume
    (they include compilation). ``total_time_s`` is the last record's ``elapsed_s``.

    Args:
      metrics: from :func:`read_metrics`.
      config: the run's ``config.json``; its ``max_grad_norm`` is reported when present.
      final_window: how many of the last finite train losses to average (>= 1).

    Returns:
      A JSON-serializable dict (keys in display order).

    Raises:
      TypeError: ``config`` is not a dict or None.
      ValueError: ``final_window`` is not a positive int.

    Example:
      >>> rec = lambda s, loss, skip: TrainRecord(s, loss, 1.0, 1.0, skip, False, int(skip),
      ...     100.0 * s, 2.0 * s, 1e-3)
      >>> m = RunMetrics(train=(rec(1, 4.0, False), rec(2, math.inf, True), rec(3, 2.0, False)),
      ...     eval=(EvalRecord(3, 1.5, 1.5 / math.log(2)),))
      >>> s = summarize(m, final_window=2)
      >>> s["steps"], s["final_train_loss"], s["skipped_steps"], s["mean_tokens_per_sec"]
      (3, 3.0, 1, 250.0)
    """
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config is {type(config).__name__}; expected a dict or None")
    if isinstance(final_window, bool) or not isinstance(final_window, int) or final_window < 1:
        raise ValueError(f"final_window={final_window!r}; expected an int >= 1")
    train, evals = metrics.train, metrics.eval
    losses = [r.loss for r in train if math.isfinite(r.loss)][-final_window:]
    compile_steps = set(metrics.resumed_at) | ({train[0].step} if train else set())
    speeds = [r.tokens_per_sec for r in train
              if r.step not in compile_steps and math.isfinite(r.tokens_per_sec)]
    finite_evals = [e for e in evals if math.isfinite(e.heldout_loss)]
    best = min(finite_evals, key=lambda e: e.heldout_loss, default=None)
    last = train[-1] if train else None
    summary: dict[str, Any] = {
        "run": metrics.name,
        "steps": last.step if last else 0,
        "final_train_loss": sum(losses) / len(losses) if losses else None,
        "final_train_loss_window": len(losses),
        "final_heldout_loss": _finite_or_none(evals[-1].heldout_loss) if evals else None,
        "final_heldout_bits_per_byte":
            _finite_or_none(evals[-1].heldout_bits_per_byte) if evals else None,
        "final_heldout_step": evals[-1].step if evals else None,
        "best_heldout_loss": best.heldout_loss if best else None,
        "best_heldout_bits_per_byte":
            _finite_or_none(best.heldout_bits_per_byte) if best else None,
        "best_heldout_step": best.step if best else None,
        "skipped_steps": sum(r.skipped for r in train),
        "max_consecutive_skips": max((r.consecutive_skips for r in train), default=0),
        "clipped_steps": sum(r.clipped for r in train),
        "final_loss_scale": _finite_or_none(last.loss_scale) if last else None,
        "final_lr": _finite_or_none(last.lr) if last else None,
        "mean_tokens_per_sec": sum(speeds) / len(speeds) if speeds else None,
        "total_time_s": _finite_or_none(last.elapsed_s) if last else None,
        "resumes": len(metrics.resumed_at),
        "dropped_lines": len(metrics.dropped_lines),
    }
    if config is not None and config.get("max_grad_norm") is not None:
        summary["max_grad_norm"] = config["max_grad_norm"]
    return summary


_LABELS = {
    "final_train_loss_window": "final train loss: steps averaged",
    "mean_tokens_per_sec": "mean tokens/sec (after compile)",
    "total_time_s": "total time",
    "dropped_lines": "cut-off lines skipped",
    "max_grad_norm": "max_grad_norm (config)",
}


def _format(key: str, value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if key == "total_time_s":
            return f"{value:.1f} s"
        if key in ("mean_tokens_per_sec", "final_loss_scale"):
            return f"{value:,.0f}"
        return f"{value:.4g}" if key in ("final_lr", "max_grad_norm") else f"{value:.4f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def render_summary(summary: dict[str, Any]) -> Table:
    """A two-column :class:`rich.table.Table` of :func:`summarize`'s dict, for printing.

    Example:
      >>> import io
      >>> from rich.console import Console
      >>> console = Console(width=60, record=True, file=io.StringIO())
      >>> summary = {"run": "demo", "steps": 1200, "final_train_loss": 1.23456}
      >>> console.print(render_summary(summary))
      >>> print(console.export_text().strip())
      run demo
      ┏━━━━━━━━━━━━━━━━━━┳━━━━━━━━┓
      ┃ metric           ┃  value ┃
      ┡━━━━━━━━━━━━━━━━━━╇━━━━━━━━┩
      │ steps            │  1,200 │
      │ final train loss │ 1.2346 │
      └──────────────────┴────────┘
    """
    table = Table(title=f"run {summary.get('run', '?')}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key != "run":
            label = key.replace("_", " ").replace("heldout", "held-out")
            table.add_row(_LABELS.get(key, label), _format(key, value))
    return table


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
    ax.plot(steps, np.full(steps.shape, height), "|", color=color, ms=9, mew=1.2,
            transform=ax.get_xaxis_transform(), label=label)


def _mark_events(ax: Any, metrics: RunMetrics, skipped: np.ndarray) -> None:
    """Red ticks along the bottom at skipped steps; dotted lines at resumes."""
    if skipped.size:
        _ticks(ax, skipped, 0.02, "tab:red", f"skipped ({skipped.size})")
    for i, step in enumerate(metrics.resumed_at):
        ax.axvline(step, color="0.4", ls=":", lw=1, label="resumed" if i == 0 else None)


def _finish(ax: Any, title: str, ylabel: str, has_data: bool) -> None:
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.35)
    if not has_data:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center",
                transform=ax.transAxes, color="0.4", bbox={"fc": "white", "ec": "none"})
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
      metrics: from :func:`read_metrics`.
      path: the PNG to write.
      max_grad_norm: the clipping threshold, drawn dashed on the gradient-norm panel.

    Returns:
      ``path`` as a :class:`pathlib.Path`.

    Raises:
      ValueError: ``max_grad_norm`` is not a positive finite number.

    Example:
      >>> import tempfile
      >>> m = RunMetrics(train=(TrainRecord(1, 5.5, 3.0, 2.0**15, False, True, 0, 0.0, 9.0, 0.0),))
      >>> out = plot_curves(m, pathlib.Path(tempfile.mkdtemp()) / "curves.png", max_grad_norm=1.0)
      >>> out.read_bytes()[:8]
      b'\\x89PNG\\r\\n\\x1a\\n'
    """
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
        or not math.isfinite(max_grad_norm) or max_grad_norm <= 0
    ):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}; expected a positive finite number")
    path = pathlib.Path(path)
    summary = summarize(metrics)
    steps = metrics.train_column("step")
    skipped = steps[metrics.train_column("skipped") > 0]
    fig = Figure(figsize=(10, 7), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_scale), (ax_grad, ax_speed) = fig.subplots(2, 2)
    style = {"marker": "o", "ms": 3} if steps.size <= 30 else {}

    loss = metrics.train_column("loss")
    ok = np.isfinite(loss)
    span = min(100, max(1, round(steps.size / 50)))
    if ok.any():
        # Short runs are drawn as they are; longer ones get a light raw line under an EMA.
        ax_loss.plot(steps[ok], loss[ok], color="tab:blue", alpha=0.3 if span > 1 else 1.0,
                     lw=0.8, label="train", **style)
    if span > 1 and ok.any():
        ax_loss.plot(steps[ok], _ema(loss[ok], span), color="tab:blue", lw=1.8,
                     label=f"train (EMA, span {span})")
    estep, eloss = metrics.eval_column("step"), metrics.eval_column("heldout_loss")
    eok = np.isfinite(eloss)
    if eok.any():
        final_bpb = metrics.eval[np.flatnonzero(eok)[-1]].heldout_bits_per_byte
        ax_loss.plot(estep[eok], eloss[eok], "o-", color="tab:orange", ms=4, lw=1,
                     label=f"held-out (final {final_bpb:.3f} bits/byte)")
    ln2 = math.log(2.0)
    ax_loss.secondary_yaxis("right", functions=(lambda x: x / ln2, lambda x: x * ln2)
                            ).set_ylabel("bits/byte")
    _mark_events(ax_loss, metrics, skipped)
    _finish(ax_loss, "train and held-out loss", "loss (nats/byte)", bool(ok.any() or eok.any()))

    scale = metrics.train_column("loss_scale")
    ok = np.isfinite(scale) & (scale > 0)
    ax_scale.plot(steps[ok], scale[ok], color="tab:purple", drawstyle="steps-post",
                  label="loss scale" if ok.any() else None, **style)
    ax_scale.set_yscale("log", base=2)
    _mark_events(ax_scale, metrics, skipped)
    _finish(ax_scale, "dynamic loss scale", "loss scale (log2)", bool(ok.any()))

    grad = metrics.train_column("grad_norm")
    ok = np.isfinite(grad) & (grad > 0)
    ax_grad.plot(steps[ok], grad[ok], color="tab:green", lw=0.8, alpha=0.35 if span > 1 else 1,
                 label="grad norm" if ok.any() else None, **style)
    if span > 1 and ok.any():  # geometric EMA: the panel is logarithmic
        ax_grad.plot(steps[ok], np.exp(_ema(np.log(grad[ok]), span)), color="tab:green",
                     lw=1.6, label=f"grad norm (EMA, span {span})")
    _ticks(ax_grad, steps[metrics.train_column("clipped") > 0], 0.98, "tab:orange",
           f"clipped ({summary['clipped_steps']})")
    if max_grad_norm is not None:
        ax_grad.axhline(max_grad_norm, color="black", ls="--", lw=1,
                        label=f"max_grad_norm = {max_grad_norm:g}")
    ax_grad.set_yscale("log")
    _mark_events(ax_grad, metrics, skipped)
    _finish(ax_grad, "gradient global norm (before clipping)", "grad norm (log)", bool(ok.any()))

    speed = metrics.train_column("tokens_per_sec")
    compiling = np.isin(steps, np.concatenate([steps[:1], metrics.resumed_at]))
    ok = np.isfinite(speed) & ~compiling
    if ok.any():
        left_out = int(compiling.sum())
        ax_speed.plot(steps[ok], speed[ok], color="tab:cyan", lw=0.9, **style, label=(
            f"tokens/sec ({left_out} compile step{'s' * (left_out != 1)} left out)"))
    mean_speed = summary["mean_tokens_per_sec"]
    if mean_speed is not None:
        ax_speed.axhline(mean_speed, color="0.3", ls="--", lw=1,
                         label=f"mean {mean_speed:,.0f} (after compile)")
    if ok.any() and speed[ok].max() > 0:  # from zero, so a 2% wobble looks like one
        ax_speed.set_ylim(0, 1.1 * speed[ok].max())
    _finish(ax_speed, "throughput", "tokens/sec", bool(ok.any()))

    every_step = np.concatenate([steps, estep])
    lo, hi = (every_step.min(), every_step.max()) if every_step.size else (0.0, 1.0)
    for ax in (ax_loss, ax_scale, ax_grad, ax_speed):
        ax.set_xlim(lo - max(0.5, 0.02 * (hi - lo)), hi + max(0.5, 0.02 * (hi - lo)))
    fig.suptitle(
        f"{metrics.name}: {summary['steps']:,} step{'s' * (summary['steps'] != 1)} · train loss "
        f"{_fmt(summary['final_train_loss'])} · held-out "
        f"{_fmt(summary['final_heldout_bits_per_byte'])} bits/byte (best "
        f"{_fmt(summary['best_heldout_bits_per_byte'])}) · {summary['skipped_steps']} skipped, "
        f"{summary['clipped_steps']} clipped",
        fontsize="large",
    )
    fig.savefig(path, format="png")
    return path


def report(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Re-render ``run_dir/curves.png`` from the run's files and return its summary.

    Args:
      run_dir: a directory with ``metrics.jsonl`` and, optionally, ``config.json``
        (whose ``max_grad_norm`` is drawn as the clip threshold).

    Returns:
      :func:`summarize`'s dict plus ``"curves"``: the path of the PNG written.

    Raises:
      FileNotFoundError: ``run_dir`` or its ``metrics.jsonl`` does not exist.
      ValueError: a file is malformed (the message names it).
    """
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    config = None
    config_path = run_dir / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_path} is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} holds {type(config).__name__}; expected an object")
    max_grad_norm = None if config is None else config.get("max_grad_norm")
    try:
        curves = plot_curves(metrics, run_dir / "curves.png", max_grad_norm=max_grad_norm)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    return {**summarize(metrics, config), "curves": str(curves)}
