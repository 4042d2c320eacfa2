"""Tests for leanstep.training.metrics_log: writing, truncating and reading metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.metrics_lines import eval_line, train_line, write
from leanstep.training.metrics_log import MetricsWriter, read_metrics, truncate_metrics
from leanstep.training.records import EvalRecord, Note, TrainRecord, parse_record


def train_record(step: int, loss: float = 2.0, **overrides: object) -> TrainRecord:
    return parse_record(train_line(step, loss, **overrides))


# --- read_metrics ------------------------------------------------------------------------


def test_resume_duplicates_last_occurrence_wins_and_sorted(tmp_path):
    # Killed after logging step 12 with the last checkpoint at 8: steps 9-12 appear twice.
    first = [train_line(s, loss=10.0 + s) for s in range(1, 13)]
    first.insert(5, eval_line(5, 7.0))
    first.insert(11, eval_line(10, 6.0))
    second = [train_line(s, loss=20.0 + s) for s in range(9, 16)]
    second.insert(2, eval_line(10, 5.0))
    m = read_metrics(write(tmp_path / "r" / "metrics.jsonl", first + second))
    assert [r.step for r in m.train] == list(range(1, 16))
    assert [r.loss for r in m.train] == [10.0 + s for s in range(1, 9)] + [20.0 + s for s in range(9, 16)]
    assert [(e.step, e.heldout_loss) for e in m.eval] == [(5, 7.0), (10, 5.0)]
    assert m.resumed_at == (9,)
    assert m.name == "r"


def test_abandoned_timeline_beyond_the_resume_is_dropped(tmp_path):
    # 1..12 logged, resumed from 6, killed again after 9: 10..12 belong to a dead timeline.
    lines = [train_line(s) for s in range(1, 13)] + [eval_line(11, 3.0), eval_line(6, 4.0)]
    lines += [train_line(s, loss=1.0) for s in range(7, 10)]
    m = read_metrics(write(tmp_path / "metrics.jsonl", lines))
    assert [r.step for r in m.train] == list(range(1, 10))
    assert [e.step for e in m.eval] == [6]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 8)), min_size=1, max_size=5))
def test_timelines_match_a_model_of_crash_and_resume(segments):
    """Each segment resumes ``back`` steps before the last logged one and runs ``length``."""
    lines, history, resumed, tag = [], [], [], 0
    for back, length in segments:
        last = history[-1][0] if history else 0
        start = max(1, last + 1 - back)
        if history and start <= last:
            resumed.append(start)
        history = [h for h in history if h[0] < start]
        for step in range(start, start + length):
            tag += 1
            lines.append(train_line(step, loss=float(tag)))
            history.append((step, float(tag)))
    with tempfile.TemporaryDirectory() as tmp:
        m = read_metrics(write(pathlib.Path(tmp) / "metrics.jsonl", lines))
    assert [(r.step, r.loss) for r in m.train] == history
    assert m.resumed_at == tuple(resumed)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_truncated_last_line_is_skipped(data):
    full = json.dumps(train_line(3, loss=float("nan"), grad_norm=float("inf")))
    cut = data.draw(st.integers(1, len(full) - 1))
    lines = [train_line(1), eval_line(1, 4.0), train_line(2), full[:cut]]
    with tempfile.TemporaryDirectory() as tmp:
        m = read_metrics(write(pathlib.Path(tmp) / "metrics.jsonl", lines, tail=""))
    assert [r.step for r in m.train] == [1, 2]
    assert m.dropped_lines == (4,)


def test_fragment_followed_by_appended_record_is_recovered(tmp_path):
    cut = json.dumps(train_line(5))[:30]
    lines = [train_line(s) for s in range(1, 5)] + [cut + json.dumps(train_line(3, loss=9.0))]
    lines += [train_line(4, loss=8.0), cut]  # and a fragment on a line of its own
    m = read_metrics(write(tmp_path / "metrics.jsonl", lines))
    assert [(r.step, r.loss) for r in m.train] == [(1, 2.0), (2, 2.0), (3, 9.0), (4, 8.0)]
    assert m.dropped_lines == (5, 7)
    assert m.resumed_at == (3,)


def test_non_finite_tokens_and_null_read_as_floats(tmp_path):
    lines = [
        (
            '{"kind": "train", "step": 1, "loss": NaN, "grad_norm": Infinity, '
            '"loss_scale": 32768.0, "skipped": true, "clipped": false, "consecutive_skips": 1, '
            '"tokens_per_sec": -Infinity, "elapsed_s": null, "lr": 0}'
        )
    ]
    (r,) = read_metrics(write(tmp_path / "metrics.jsonl", lines)).train
    assert math.isnan(r.loss) and r.grad_norm == math.inf and r.tokens_per_sec == -math.inf
    assert math.isnan(r.elapsed_s) and r.lr == 0.0 and isinstance(r.lr, float)
    assert r.skipped is True and r.consecutive_skips == 1


def test_blank_lines_and_unknown_kinds_are_ignored(tmp_path):
    lines = [train_line(1), "", {"kind": "note", "text": "hi"}, "   ", train_line(2)]
    m = read_metrics(write(tmp_path / "metrics.jsonl", lines))
    assert [r.step for r in m.train] == [1, 2] and m.dropped_lines == ()


def test_run_directory_is_accepted(tmp_path):
    write(tmp_path / "myrun" / "metrics.jsonl", [train_line(1)])
    assert read_metrics(tmp_path / "myrun").name == "myrun"


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "metrics.jsonl"
    with pytest.raises(FileNotFoundError, match="metrics file not found: .*nope.*metrics.jsonl"):
        read_metrics(missing)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"kind": "train", "step": 1} garbage}', r"metrics.jsonl:2 is not JSON"),
        ("[1, 2]", r"metrics.jsonl:2 is \[1, 2\]; expected a JSON object"),
        ('{"step": 1}', r"metrics.jsonl:2 has no 'kind' field"),
        (
            json.dumps({k: v for k, v in train_line(2).items() if k != "lr"}),
            r"metrics.jsonl:2 \('train' record\) lacks the field 'lr'",
        ),
        (json.dumps({**train_line(2), "step": 2.5}), r"field 'step' is 2.5; expected int"),
        (json.dumps(train_line(2, loss="low")), r"field 'loss' is 'low'; expected float"),
        (json.dumps(train_line(2, skipped="yes")), r"field 'skipped' is 'yes'; expected bool"),
    ],
)
def test_malformed_lines_raise_naming_file_and_line(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        read_metrics(write(tmp_path / "metrics.jsonl", [train_line(1), bad, train_line(3)]))


# --- MetricsWriter -----------------------------------------------------------------------


def test_writer_appends_the_lines_the_reader_reads(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    write(path, [train_line(1, loss=5.0)])  # an earlier run's line stays
    records = [train_record(2, loss=4.0), EvalRecord.from_loss(2, 3.0), train_record(3, math.nan)]
    with MetricsWriter(path) as log:
        log.write(records[0], records[1])
        log.write(records[2])
        log.write()  # no records: nothing written
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines == [json.dumps(train_line(1, loss=5.0))] + [json.dumps(r.to_json()) for r in records]
    m = read_metrics(path)
    assert [(r.step, r.loss) for r in m.train][:2] == [(1, 5.0), (2, 4.0)]
    assert m.train[2].step == 3 and math.isnan(m.train[2].loss)
    assert m.eval == (records[1],) and m.dropped_lines == () and m.resumed_at == ()


def test_writer_makes_one_write_and_flush_per_call(tmp_path, monkeypatch):
    calls = []
    real_open = pathlib.Path.open

    class Recording:
        def __init__(self, file):
            self._file = file

        def write(self, text):
            calls.append(("write", text))
            return self._file.write(text)

        def flush(self):
            calls.append(("flush",))
            self._file.flush()

        def close(self):
            self._file.close()

    monkeypatch.setattr(pathlib.Path, "open", lambda self, *a, **k: Recording(real_open(self, *a, **k)))
    path = tmp_path / "metrics.jsonl"
    step, evaluation = train_record(1), EvalRecord.from_loss(1, 2.0)
    with MetricsWriter(path) as log:
        log.write(step, evaluation)
        assert calls == [
            ("write", json.dumps(step.to_json()) + "\n" + json.dumps(evaluation.to_json()) + "\n"),
            ("flush",),
        ]
        monkeypatch.undo()
        # Flushed: another reader sees both lines while the writer is still open.
        assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_writer_refuses_notes_and_writes_nothing_of_that_call(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as log:
        with pytest.raises(TypeError, match="metrics.jsonl holds TrainRecord and EvalRecord lines; got Note"):
            log.write(train_record(1), Note("warning: hi"))
        with pytest.raises(TypeError, match="got dict"):
            log.write(train_line(1))  # the old dict form is no record
    assert path.read_text(encoding="utf-8") == ""


def test_writer_lets_os_errors_propagate(tmp_path):
    with pytest.raises(FileNotFoundError), MetricsWriter(tmp_path / "missing-dir" / "metrics.jsonl"):
        pass
    with pytest.raises(IsADirectoryError):
        MetricsWriter(tmp_path).__enter__()
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to fail a write")
    with MetricsWriter("/dev/full") as log, pytest.raises(OSError):  # ENOSPC, at the latest on the flush
        log.write(train_record(1))


def test_writer_outside_a_with_block_raises(tmp_path):
    log = MetricsWriter(tmp_path / "metrics.jsonl")
    with pytest.raises(RuntimeError, match="is not open; use it in a with block"):
        log.write(train_record(1))
    with log:
        log.write(train_record(1))
    with pytest.raises(RuntimeError, match="is not open"):
        log.write(train_record(2))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


# --- truncate_metrics --------------------------------------------------------------------


def test_truncate_keeps_lines_up_to_the_checkpoint_and_drops_cut_off_ones(tmp_path):
    cut = json.dumps(train_line(7))[:25]
    lines = [train_line(s) for s in range(1, 7)] + [eval_line(5, 3.0), eval_line(6, 2.0), train_line(5, loss=math.nan)]
    lines += [cut + json.dumps(train_line(4)), '{"kind": "note"}', '"just a string"', cut]
    path = write(tmp_path / "metrics.jsonl", lines, tail="")
    truncate_metrics(path, 5)
    kept = path.read_text(encoding="utf-8")
    assert kept.endswith("\n")
    assert kept.splitlines() == [
        json.dumps(x) for x in [train_line(s) for s in range(1, 6)] + [eval_line(5, 3.0), train_line(5, loss=math.nan)]
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no .tmp left
    truncate_metrics(path, 0)
    assert path.read_text() == ""


def test_truncate_of_a_missing_file_creates_nothing(tmp_path):
    truncate_metrics(tmp_path / "metrics.jsonl", 3)
    assert list(tmp_path.iterdir()) == []


def test_write_kill_truncate_resume_reads_as_one_timeline(tmp_path):
    """What ``leanstep train --resume`` does after a kill: the log matches the checkpoint."""
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    with MetricsWriter(path) as log:
        for step in range(1, 13):
            log.write(
                train_record(step, loss=10.0 + step), *([EvalRecord.from_loss(step, 1.0)] if step % 4 == 0 else [])
            )
    with path.open("a", encoding="utf-8") as file:  # killed while writing step 13
        file.write(json.dumps(train_record(13).to_json())[:40])
    truncate_metrics(path, 8)  # the newest checkpoint is step 8
    with MetricsWriter(path) as log:
        for step in range(9, 16):
            log.write(train_record(step, loss=20.0 + step))
    m = read_metrics(path)
    assert [(r.step, r.loss) for r in m.train] == [(s, 10.0 + s) for s in range(1, 9)] + [
        (s, 20.0 + s) for s in range(9, 16)
    ]
    assert [e.step for e in m.eval] == [4, 8]
    assert m.resumed_at == () and m.dropped_lines == ()
