"""The live progress bar of ``leanstep train`` (rich), fed the run's records."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from leanstep.training.records import EvalRecord, Note, Record, RunStart, TrainRecord

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


class TrainProgress:
    """Step, loss, loss scale, grad norm, skipped steps and tokens/s, refreshed after each step.

    Feed it every record the run emits, in order, with :meth:`handle`: a
    :class:`~leanstep.training.records.TrainRecord` moves the bar to its step, an
    :class:`~leanstep.training.records.EvalRecord` shows its held-out bits per byte from then
    on, a :class:`~leanstep.training.records.Note` is printed above the bar in yellow and a
    :class:`~leanstep.training.records.RunStart` sets the bar's total and start.

    Args:
      total: the run's last step (None: until a ``RunStart`` says).
      start: the step the run starts from (its checkpoint's step when resuming).
      enabled: False draws nothing (notes are still printed).
      console: where to draw; default standard error.

    Example:
      >>> import io
      >>> from leanstep.training.records import EvalRecord, Note, TrainRecord
      >>> console = Console(file=io.StringIO(), width=120, record=True)
      >>> with TrainProgress(10, 0, enabled=False, console=console) as progress:
      ...     progress.handle(TrainRecord(1, 2.5, 0.75, 32768.0, True, False, 1, 1e4, 0.5, 1e-3),
      ...                     EvalRecord.from_loss(1, 2.0), Note("warning: resumed from step 0"))
      >>> progress.info
      'loss 2.500 heldout 2.885 bits/B  scale 32768  |g| 0.75  skipped 1  10,000 tok/s'
      >>> print(console.export_text().strip())
      warning: resumed from step 0
    """

    def __init__(
        self, total: int | None = None, start: int = 0, *, enabled: bool = True, console: Console | None = None
    ) -> None:
        self._console = console or Console(stderr=True)
        self._enabled = enabled
        self._skipped = 0
        self._heldout = ""
        self._last: TrainRecord | None = None
        self._info = "compiling…"
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
        self._task = self._progress.add_task("train", total=total, completed=start, info=self._info)

    def __enter__(self) -> Self:
        self._started = False  # the bar appears with the run's first record: a refused run leaves none
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._started:
            self._progress.__exit__(exc_type, exc, traceback)

    @property
    def info(self) -> str:
        """The text after the bar: the latest step's numbers ("compiling…" before the first)."""
        return self._info

    def print(self, message: str) -> None:
        self._progress.console.print(message)

    def handle(self, *records: Record) -> None:
        """Shows ``records`` (any kinds, in the order the run emitted them), then redraws once.

        Call it after each step with that step's records, e.g.
        ``progress.handle(train_record, *eval_records)`` next to ``log.write(...)``.

        Raises:
          TypeError: a record of another type.
        """
        if not getattr(self, "_started", True):
            self._progress.start()
            self._started = True
        for record in records:
            if isinstance(record, TrainRecord):
                self._skipped += record.skipped
                self._last = record
            elif isinstance(record, EvalRecord):
                self._heldout = f" heldout {record.heldout_bits_per_byte:.3f} bits/B"
            elif isinstance(record, Note):
                self._progress.console.print(Text(record.message, style="yellow"), soft_wrap=True)
            elif isinstance(record, RunStart):
                self._progress.update(self._task, total=record.steps, completed=record.start_step)
            else:
                raise TypeError(
                    f"TrainProgress.handle takes TrainRecord, EvalRecord, Note or RunStart; got {type(record).__name__}"
                )
        last = self._last
        if last is None:  # nothing to show yet: only an eval or a note so far
            return
        self._info = (
            f"loss {last.loss:.3f}{self._heldout}  scale {last.loss_scale:.0f}  "
            f"|g| {last.grad_norm:.2f}  skipped {self._skipped}  {last.tokens_per_sec:,.0f} tok/s"
        )
        self._progress.update(self._task, completed=last.step, info=self._info)
