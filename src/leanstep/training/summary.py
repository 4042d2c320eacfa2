"""Headline numbers of a run: :func:`summarize`.

:func:`summarize` turns a run's records into a JSON-serializable dict, ``None`` where a
number is unavailable (never NaN). Rendering the dict as a table is the CLI's business
(:mod:`leanstep.cli.render`); :func:`leanstep.training.curves.report` redraws a run
directory's chart and returns the dict.
"""

from __future__ import annotations

import math
from typing import Any

from leanstep.common.checks import is_int
from leanstep.training.metrics_log import RunMetrics

__all__ = ["summarize"]


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def summarize(metrics: RunMetrics, config: dict | None = None, *, final_window: int = 10) -> dict[str, Any]:
    """Headline numbers of a run; ``None`` where a number is unavailable.

    .. math::

       \\text{final\\_train\\_loss} = \\operatorname{mean}(\\text{last } k
       \\text{ finite train losses}),\\quad k = \\text{final\\_window}

    ``mean_tokens_per_sec`` leaves out the first step and the first step after each resume
    (they include compilation). ``total_time_s`` is the last record's ``elapsed_s``.

    Args:
      metrics: from :func:`~leanstep.training.metrics_log.read_metrics`.
      config: the run's ``config.json``; its ``max_grad_norm`` is reported when present.
      final_window: how many of the last finite train losses to average (>= 1).

    Returns:
      A JSON-serializable dict (keys in display order).

    Raises:
      TypeError: ``config`` is not a dict or None.
      ValueError: ``final_window`` is not a positive int.

    Example:
      >>> from leanstep.training.records import EvalRecord, TrainRecord
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
    if not is_int(final_window) or final_window < 1:
        raise ValueError(f"final_window={final_window!r}; expected an int >= 1")
    train, evals = metrics.train, metrics.eval
    losses = [r.loss for r in train if math.isfinite(r.loss)][-final_window:]
    compile_steps = set(metrics.resumed_at) | ({train[0].step} if train else set())
    speeds = [r.tokens_per_sec for r in train if r.step not in compile_steps and math.isfinite(r.tokens_per_sec)]
    finite_evals = [e for e in evals if math.isfinite(e.heldout_loss)]
    best = min(finite_evals, key=lambda e: e.heldout_loss, default=None)
    last = train[-1] if train else None
    summary: dict[str, Any] = {
        "run": metrics.name,
        "steps": last.step if last else 0,
        "final_train_loss": sum(losses) / len(losses) if losses else None,
        "final_train_loss_window": len(losses),
        "final_heldout_loss": _finite_or_none(evals[-1].heldout_loss) if evals else None,
        "final_heldout_bits_per_byte": _finite_or_none(evals[-1].heldout_bits_per_byte) if evals else None,
        "final_heldout_step": evals[-1].step if evals else None,
        "best_heldout_loss": best.heldout_loss if best else None,
        "best_heldout_bits_per_byte": _finite_or_none(best.heldout_bits_per_byte) if best else None,
        "best_heldout_step": best.step if best else None,
        "skipped_steps": sum(r.skipped for r in train),
        "spike_skipped_steps": sum(r.spiked for r in train),
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
