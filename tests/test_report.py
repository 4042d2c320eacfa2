"""Tests for leanstep.report: reading metrics.jsonl, the summary, the curves PNG."""

from __future__ import annotations

import io
import json
import os
import math
import pathlib
import struct
import subprocess
import sys
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from leanstep.report import (
    EvalRecord,
    RunMetrics,
    TrainRecord,
    plot_curves,
    read_metrics,
    render_summary,
    report,
    summarize,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_line(step: int, loss: float = 2.0, **overrides: object) -> dict:
    line = dict(kind="train", step=step, loss=loss, grad_norm=0.5, loss_scale=2.0**15,
                skipped=False, clipped=False, consecutive_skips=0, tokens_per_sec=1000.0,
                elapsed_s=float(step), lr=1e-3)
    line.update(overrides)
    return line


def eval_line(step: int, loss: float) -> dict:
    bits = loss / math.log(2)
    return dict(kind="eval", step=step, heldout_loss=loss, heldout_bits_per_byte=bits)


def write(path: pathlib.Path, lines: list[dict | str], tail: str = "\n") -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    path.write_text(text + tail, encoding="utf-8")
    return path


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


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
    assert [r.loss for r in m.train] == [10.0 + s for s in range(1, 9)] + [
        20.0 + s for s in range(9, 16)]
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
    lines = ['{"kind": "train", "step": 1, "loss": NaN, "grad_norm": Infinity, '
             '"loss_scale": 32768.0, "skipped": true, "clipped": false, "consecutive_skips": 1, '
             '"tokens_per_sec": -Infinity, "elapsed_s": null, "lr": 0}']
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
    with pytest.raises(FileNotFoundError, match="run directory not found: .*nope"):
        report(tmp_path / "nope")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"kind": "train", "step": 1} garbage}', r"metrics.jsonl:2 is not JSON"),
        ("[1, 2]", r"metrics.jsonl:2 is \[1, 2\]; expected a JSON object"),
        ('{"step": 1}', r"metrics.jsonl:2 has no 'kind' field"),
        (json.dumps({k: v for k, v in train_line(2).items() if k != "lr"}),
         r"metrics.jsonl:2 \('train' record\) lacks the field 'lr'"),
        (json.dumps({**train_line(2), "step": 2.5}), r"field 'step' is 2.5; expected int"),
        (json.dumps(train_line(2, loss="low")), r"field 'loss' is 'low'; expected float"),
        (json.dumps(train_line(2, skipped="yes")), r"field 'skipped' is 'yes'; expected bool"),
    ],
)
def test_malformed_lines_raise_naming_file_and_line(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        read_metrics(write(tmp_path / "metrics.jsonl", [train_line(1), bad, train_line(3)]))


# --- summarize / render_summary ----------------------------------------------------------


def hand_run(tmp_path: pathlib.Path) -> RunMetrics:
    nan, inf = float("nan"), float("inf")
    rows = [  # step, loss, skipped, clipped, consecutive_skips, tokens/sec, elapsed, scale
        (1, 5.0, False, True, 0, 10.0, 30.0, 65536.0),
        (2, inf, True, False, 1, 100.0, 31.0, 32768.0),
        (3, nan, True, False, 2, 110.0, 32.0, 16384.0),
        (4, 3.0, False, True, 0, 120.0, 33.0, 16384.0),
        (5, 2.0, False, False, 0, 130.0, 34.0, 16384.0),
        (6, 1.5, False, True, 0, nan, 35.0, 16384.0),
    ]
    lines = [train_line(s, loss=lo, skipped=sk, clipped=c, consecutive_skips=k,
                         tokens_per_sec=t, elapsed_s=e, loss_scale=ls)
             for s, lo, sk, c, k, t, e, ls in rows]
    lines += [eval_line(2, 4.0), eval_line(4, 2.5), eval_line(6, 2.75)]
    # Resumed from step 4: step 5 recompiles (20 tok/s) and logs a new loss.
    lines += [train_line(5, loss=2.5, tokens_per_sec=20.0, elapsed_s=40.0, clipped=True),
              train_line(6, loss=1.0, tokens_per_sec=140.0, elapsed_s=41.0, lr=5e-4),
              eval_line(6, 2.25), '{"kind": "eval", "st']
    return read_metrics(write(tmp_path / "hand" / "metrics.jsonl", lines, tail=""))


def test_summary_matches_hand_computation(tmp_path):
    m = hand_run(tmp_path)
    s = summarize(m, {"max_grad_norm": 1.0, "other": 3}, final_window=3)
    ln2 = math.log(2)
    expected = {
        "run": "hand", "steps": 6,
        "final_train_loss": (3.0 + 2.5 + 1.0) / 3, "final_train_loss_window": 3,
        "final_heldout_loss": 2.25, "final_heldout_bits_per_byte": 2.25 / ln2,
        "final_heldout_step": 6,
        "best_heldout_loss": 2.25, "best_heldout_bits_per_byte": 2.25 / ln2,
        "best_heldout_step": 6,
        "skipped_steps": 2, "max_consecutive_skips": 2, "clipped_steps": 3,  # 1, 4, new 5
        "final_loss_scale": 32768.0, "final_lr": 5e-4,
        # step 1 (compile) and step 5 (first after the resume) are left out
        "mean_tokens_per_sec": (100.0 + 110.0 + 120.0 + 140.0) / 4,
        "total_time_s": 41.0, "resumes": 1, "dropped_lines": 1, "max_grad_norm": 1.0,
    }
    assert s.keys() == expected.keys()
    for key, value in expected.items():
        want = pytest.approx(value, rel=1e-12) if isinstance(value, float) else value
        assert s[key] == want and type(s[key]) is type(value), key
    json.dumps(s, allow_nan=False)  # None, never NaN, for unavailable numbers


def test_summary_window_larger_than_run_and_best_before_final(tmp_path):
    lines = [train_line(1, loss=4.0), train_line(2, loss=float("nan")), train_line(3, loss=1.0),
             eval_line(1, 3.0), eval_line(2, float("nan")), eval_line(3, 3.5)]
    s = summarize(read_metrics(write(tmp_path / "metrics.jsonl", lines)))
    assert s["final_train_loss"] == 2.5 and s["final_train_loss_window"] == 2
    assert (s["best_heldout_loss"], s["best_heldout_step"]) == (3.0, 1)
    assert (s["final_heldout_loss"], s["final_heldout_step"]) == (3.5, 3)
    assert "max_grad_norm" not in s


def test_summary_of_degenerate_runs_has_none_not_nan():
    one = summarize(RunMetrics(train=(TrainRecord(1, math.nan, math.inf, 1.0, True, False, 1,
                                                  5.0, 2.0, 1e-3),)))
    assert one["steps"] == 1 and one["skipped_steps"] == 1
    assert one["final_train_loss"] is None and one["mean_tokens_per_sec"] is None
    assert one["final_heldout_loss"] is None and one["best_heldout_step"] is None
    empty = summarize(RunMetrics())
    assert empty["steps"] == 0 and empty["total_time_s"] is None
    json.dumps(one, allow_nan=False), json.dumps(empty, allow_nan=False)


def test_summarize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="config is list; expected a dict or None"):
        summarize(RunMetrics(), [1])  # type: ignore[arg-type]
    for window in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"final_window={window!r}; expected an int >= 1"):
            summarize(RunMetrics(), final_window=window)  # type: ignore[arg-type]


def test_render_summary_shows_every_value(tmp_path):
    summary = summarize(hand_run(tmp_path), {"max_grad_norm": 0.5})
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(render_summary(summary))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in text.splitlines() if line.count("│") == 3}
    assert rows["steps"] == "6"
    assert rows["final train loss"] == "2.8750"  # mean of 5, 3, 2.5, 1
    assert rows["best held-out loss"] == "2.2500"
    assert rows["final held-out bits per byte"] == f"{2.25 / math.log(2):.4f}"
    assert rows["mean tokens/sec (after compile)"] == "118"  # 117.5 rounds to even
    assert rows["total time"] == "41.0 s" and rows["final lr"] == "0.0005"
    assert rows["max_grad_norm (config)"] == "0.5" and rows["final loss scale"] == "32,768"
    assert len(rows) == len(summary) - 1 and "run hand" in text
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(render_summary(summarize(RunMetrics())))
    text = console.export_text()
    assert "final train loss" in text and "—" in text


# --- plot_curves / report ----------------------------------------------------------------


def realistic_lines(steps: int = 300) -> list[dict]:
    lines = []
    for s in range(1, steps + 1):
        skipped = s <= 2 or s % 97 == 0
        loss = 1.2 + 4.3 * math.exp(-s / 60) + 0.05 * math.sin(s)
        grad = math.inf if skipped else 0.4 + 3 * math.exp(-s / 40) + (5 if s % 31 == 0 else 0)
        lines.append(train_line(s, loss=math.nan if s <= 2 else loss, grad_norm=grad,
                                skipped=skipped, clipped=not skipped and grad > 1.0,
                                loss_scale=2.0 ** (15 - (s <= 2) - (s > 97) - (s > 194)),
                                tokens_per_sec=50.0 if s == 1 else 5e4 + 100 * math.cos(s)))
        if s % 50 == 0:
            lines.append(eval_line(s, 1.25 + 4.2 * math.exp(-s / 60)))
    return lines


def test_plot_curves_writes_a_full_size_png(tmp_path):
    m = read_metrics(write(tmp_path / "metrics.jsonl", realistic_lines()))
    out = plot_curves(m, tmp_path / "curves.png", max_grad_norm=1.0)
    assert out == tmp_path / "curves.png"
    assert png_size(out) == (1200, 840)  # 10 x 7 inches at 120 dpi
    assert out.stat().st_size > 40_000  # four panels of lines and text, not a blank canvas


@pytest.mark.parametrize(
    "lines",
    [
        pytest.param([train_line(1)], id="one-step"),
        pytest.param([train_line(s) for s in range(1, 6)], id="no-eval"),
        pytest.param([train_line(s, loss=math.nan, grad_norm=math.inf, skipped=True,
                                 consecutive_skips=s) for s in range(1, 6)], id="all-skipped"),
        pytest.param([train_line(1, loss=math.nan), train_line(2, loss=math.inf),
                      eval_line(2, math.nan)], id="nan-losses"),
        pytest.param([eval_line(5, 2.0)], id="eval-only"),
        pytest.param([], id="empty"),
    ],
)
def test_plot_curves_renders_degenerate_runs(tmp_path, lines):
    # Warnings are errors in this suite, so a warning from matplotlib fails here too.
    m = read_metrics(write(tmp_path / "metrics.jsonl", lines))
    assert png_size(plot_curves(m, tmp_path / "c.png")) == (1200, 840)
    assert (tmp_path / "c.png").stat().st_size > 20_000


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", True])
def test_plot_curves_rejects_bad_max_grad_norm(tmp_path, bad):
    with pytest.raises(ValueError, match=r"max_grad_norm=.*expected a positive finite number"):
        plot_curves(RunMetrics(), tmp_path / "c.png", max_grad_norm=bad)
    assert not (tmp_path / "c.png").exists()


def test_report_rerenders_and_summarizes(tmp_path):
    run = tmp_path / "run-7"
    write(run / "metrics.jsonl", realistic_lines(120))
    (run / "config.json").write_text(json.dumps({"max_grad_norm": 1.0, "seed": 0}))
    (run / "curves.png").write_bytes(b"stale")
    summary = report(run)
    assert summary["curves"] == str(run / "curves.png") and summary["max_grad_norm"] == 1.0
    assert png_size(run / "curves.png") == (1200, 840)
    assert summary["steps"] == 120 and summary["skipped_steps"] == 3  # steps 1, 2, 97
    assert summary["run"] == "run-7"
    (run / "config.json").unlink()  # config is optional
    assert "max_grad_norm" not in report(run)


@pytest.mark.parametrize(
    ("config", "message"),
    [("{not json", r"config.json is not valid JSON"),
     ("[1]", r"config.json holds list; expected an object"),
     ('{"max_grad_norm": -1}', r"config.json: max_grad_norm=-1; expected a positive")],
)
def test_report_rejects_bad_config(tmp_path, config, message):
    write(tmp_path / "metrics.jsonl", [train_line(1)])
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=message):
        report(tmp_path)


def test_plotting_leaves_pyplot_and_the_backend_alone(tmp_path):
    code = (
        "import sys, matplotlib; before = matplotlib.get_backend(); "
        "from leanstep.report import RunMetrics, TrainRecord, plot_curves; "
        "plot_curves(RunMetrics(train=(TrainRecord(1, 2.0, 1.0, 1.0, False, False, 0, 1.0, 1.0, "
        f"1.0),)), {str(tmp_path / 'c.png')!r}); "
        "print('matplotlib.pyplot' in sys.modules, matplotlib.get_backend() == before)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={**os.environ, "MPLBACKEND": "svg"})
    assert result.stdout.split() == ["False", "True"]
