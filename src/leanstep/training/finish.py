"""The end of a finished run: ``summary.json`` first, then ``curves.png``.

The run is done and checkpointed by then, so an output that fails here loses no work: a
summary that cannot be written stops the run with a message that says how to write it again,
a chart that cannot be drawn is a warning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leanstep.training.loop_state import RunStopped
from leanstep.training.metrics_log import read_metrics
from leanstep.training.records import Note
from leanstep.training.run_dir import write_json_atomic

__all__ = ["finish_run"]


def finish_run(
    out: Path,
    run_info: dict[str, Any],
    *,
    max_grad_norm: float | None,
    emit: Callable[..., None],
    origin: float | None = None,
    chart: bool = True,
) -> dict[str, Any]:
    """Writes ``summary.json``, then ``curves.png``, of the finished run in ``out``; returns the summary.

    Args:
      out: the run directory; its ``metrics.jsonl`` holds the run.
      run_info: the run's ``config.json``, which the summary repeats.
      max_grad_norm: the clipping threshold the chart draws.
      emit: where a warning goes (a chart that cannot be written loses no numbers).
      origin: ``time.perf_counter()`` when the run began, or None.
      chart: draw ``curves.png`` (False: ``--no-chart``; ``leanstep report`` draws it later).

    Returns:
      The summary, with ``"curves"``: the chart's path, or None when it was not written; and,
      given ``origin`` for a run never resumed, ``"ended_s"``: seconds from ``origin`` to the
      chart drawn, or to the summary without one (the run's end, on the clock
      ``--time-budget`` counts on; ``total_time_s`` is its last step's).

    Raises:
      RunStopped: ``summary.json`` could not be written (the checkpoints are intact).
    """
    from leanstep.training.summary import summarize

    try:
        metrics_record = read_metrics(out / "metrics.jsonl")
        summary = {**summarize(metrics_record, run_info), "curves": None}
        if not chart and origin is not None and not metrics_record.resumed_at:
            summary["ended_s"] = time.perf_counter() - origin  # no chart: the run ends with its summary
        write_json_atomic(out / "summary.json", summary)  # the numbers first: a failed chart cannot lose them
    except OSError as error:
        raise RunStopped(
            f"the run finished and its last checkpoint is intact, but summary.json could not be "
            f"written ({error}); write it with leanstep report {out}",
            1,
        ) from None
    if not chart:
        return summary
    from leanstep.training.curves import plot_curves  # matplotlib: only now

    try:
        summary["curves"] = str(plot_curves(metrics_record, out / "curves.png", max_grad_norm=max_grad_norm))
        if origin is not None and not metrics_record.resumed_at:
            summary["ended_s"] = time.perf_counter() - origin
        write_json_atomic(out / "summary.json", summary)  # now naming the chart
    except OSError as error:  # ENOSPC, EACCES, ...: plot_curves leaves no partial file
        emit(
            Note(
                f"warning: curves.png was not written ({error}); summary.json holds the numbers and "
                f"leanstep report {out} redraws the chart"
            )
        )
    return summary
