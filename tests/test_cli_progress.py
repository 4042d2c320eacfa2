"""Tests for leanstep.cli.progress: the live bar fed the run's records."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from helpers.metrics_lines import train_line
from leanstep.cli.progress import TrainProgress
from leanstep.training.records import EvalRecord, Note, RunStart, TrainRecord


def record(step: int, *, skipped: bool = False, loss: float = 2.0) -> TrainRecord:
    return TrainRecord(step, loss, 0.5, 2.0**15, skipped, False, int(skipped), 12345.0, 1.0, 1e-3)


def console() -> Console:
    return Console(file=io.StringIO(), width=200, record=True, force_terminal=False)


def test_handle_shows_the_latest_step_the_skip_count_and_the_last_eval():
    with TrainProgress(10, 0, enabled=False, console=console()) as progress:
        assert progress.info == "compiling…"
        progress.handle(EvalRecord.from_loss(0, 1.0))  # no step yet: nothing to show
        assert progress.info == "compiling…"
        progress.handle(record(1, skipped=True, loss=3.0))
        assert progress.info == ("loss 3.000 heldout 1.443 bits/B  scale 32768  |g| 0.50  skipped 1  12,345 tok/s")
        progress.handle(record(2), EvalRecord(2, 1.5, 2.0))
        assert progress.info.startswith("loss 2.000 heldout 2.000 bits/B") and "skipped 1" in progress.info
        progress.handle(record(3, skipped=True))
        assert "heldout 2.000 bits/B" in progress.info and "skipped 2" in progress.info


def test_handle_moves_the_bar_to_the_record_step():
    out = console()
    with TrainProgress(4, 1, enabled=True, console=out) as progress:
        progress.handle(record(2))
        progress.handle(record(3), EvalRecord(3, 1.0, 1.25))
    text = out.export_text()
    assert "3/4" in text and "heldout 1.250 bits/B" in text


def test_notes_are_printed_even_without_a_bar():
    out = console()
    with TrainProgress(4, 0, enabled=False, console=out) as progress:
        progress.handle(Note("warning: skipped damaged checkpoint 8 [bracketed]"))
    assert out.export_text() == "warning: skipped damaged checkpoint 8 [bracketed]\n"
    assert progress.info == "compiling…"


def test_handle_rejects_other_objects():
    with (
        TrainProgress(4, 0, enabled=False, console=console()) as progress,
        pytest.raises(TypeError, match="takes TrainRecord, EvalRecord, Note or RunStart; got dict"),
    ):
        progress.handle(train_line(1))


def test_run_start_sets_the_total_and_the_start():
    out = console()
    with TrainProgress(enabled=True, console=out) as progress:
        progress.handle(RunStart(steps=6, start_step=4))
        progress.handle(record(5))
    assert "5/6" in out.export_text()
