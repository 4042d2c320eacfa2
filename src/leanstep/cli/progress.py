"""The live progress bar of ``leanstep train`` (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """Step, loss, loss scale, grad norm, skipped steps and tokens/s, refreshed after each step."""

    def __init__(self, total: int, start: int, *, enabled: bool = True, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._enabled = enabled
        self._skipped = 0
        self._heldout = ""
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self._console,
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, info="compiling…")

    def __enter__(self) -> "TrainProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def print(self, message: str) -> None:
        self._progress.console.print(message)

    def update(self, step: int, record: dict[str, Any], eval_record: dict[str, Any] | None) -> None:
        self._skipped += record["skipped"]
        if eval_record is not None:
            self._heldout = f" heldout {eval_record['heldout_bits_per_byte']:.3f} bits/B"
        info = (f"loss {record['loss']:.3f}{self._heldout}  scale {record['loss_scale']:.0f}  "
                f"|g| {record['grad_norm']:.2f}  skipped {self._skipped}  {record['tokens_per_sec']:,.0f} tok/s")
        self._progress.update(self._task, completed=step, info=info)
