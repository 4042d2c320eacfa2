"""Tests for leanstep.training.summary: a run's headline numbers."""

from __future__ import annotations

import json
import math

import pytest

from helpers.metrics_lines import eval_line, hand_run, train_line, write
from leanstep.training.metrics_log import RunMetrics, read_metrics
from leanstep.training.records import TrainRecord
from leanstep.training.summary import summarize

# --- summarize ---------------------------------------------------------------------------


def test_summary_matches_hand_computation(tmp_path):
    m = hand_run(tmp_path)
    s = summarize(m, {"max_grad_norm": 1.0, "other": 3}, final_window=3)
    ln2 = math.log(2)
    expected = {
        "run": "hand",
        "steps": 6,
        "final_train_loss": (3.0 + 2.5 + 1.0) / 3,
        "final_train_loss_window": 3,
        "final_heldout_loss": 2.25,
        "final_heldout_bits_per_byte": 2.25 / ln2,
        "final_heldout_step": 6,
        "best_heldout_loss": 2.25,
        "best_heldout_bits_per_byte": 2.25 / ln2,
        "best_heldout_step": 6,
        "skipped_steps": 2,
        "spike_skipped_steps": 0,  # lines of runs before 0.9 have no "spiked": none
        "max_consecutive_skips": 2,
        "clipped_steps": 3,  # 1, 4, new 5
        "final_loss_scale": 32768.0,
        "final_lr": 5e-4,
        # step 1 (compile) and step 5 (first after the resume) are left out
        "mean_tokens_per_sec": (100.0 + 110.0 + 120.0 + 140.0) / 4,
        "total_time_s": 41.0,
        "resumes": 1,
        "dropped_lines": 1,
        "max_grad_norm": 1.0,
    }
    assert s.keys() == expected.keys()
    for key, value in expected.items():
        want = pytest.approx(value, rel=1e-12) if isinstance(value, float) else value
        assert s[key] == want and type(s[key]) is type(value), key
    json.dumps(s, allow_nan=False)  # None, never NaN, for unavailable numbers


def test_summary_window_larger_than_run_and_best_before_final(tmp_path):
    lines = [
        train_line(1, loss=4.0),
        train_line(2, loss=float("nan")),
        train_line(3, loss=1.0),
        eval_line(1, 3.0),
        eval_line(2, float("nan")),
        eval_line(3, 3.5),
    ]
    s = summarize(read_metrics(write(tmp_path / "metrics.jsonl", lines)))
    assert s["final_train_loss"] == 2.5 and s["final_train_loss_window"] == 2
    assert (s["best_heldout_loss"], s["best_heldout_step"]) == (3.0, 1)
    assert (s["final_heldout_loss"], s["final_heldout_step"]) == (3.5, 3)
    assert "max_grad_norm" not in s


def test_summary_of_degenerate_runs_has_none_not_nan():
    one = summarize(RunMetrics(train=(TrainRecord(1, math.nan, math.inf, 1.0, True, False, 1, 5.0, 2.0, 1e-3),)))
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
