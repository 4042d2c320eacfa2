"""Tests for leanstep.training.curves: the curves PNG, drawn without touching pyplot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from helpers.metrics_lines import eval_line, png_size, realistic_lines, train_line, write
from leanstep.training.curves import plot_curves, report
from leanstep.training.metrics_log import RunMetrics, read_metrics


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
        pytest.param(
            [train_line(s, loss=math.nan, grad_norm=math.inf, skipped=True, consecutive_skips=s) for s in range(1, 6)],
            id="all-skipped",
        ),
        pytest.param(
            [train_line(1, loss=math.nan), train_line(2, loss=math.inf), eval_line(2, math.nan)], id="nan-losses"
        ),
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


def test_plotting_leaves_pyplot_and_the_backend_alone(tmp_path):
    code = (
        "import sys, matplotlib; before = matplotlib.get_backend(); "
        "from leanstep.training.curves import plot_curves; "
        "from leanstep.training.metrics_log import RunMetrics; "
        "from leanstep.training.records import TrainRecord; "
        "plot_curves(RunMetrics(train=(TrainRecord(1, 2.0, 1.0, 1.0, False, False, 0, 1.0, 1.0, "
        f"1.0),)), {str(tmp_path / 'c.png')!r}); "
        "print('matplotlib.pyplot' in sys.modules, matplotlib.get_backend() == before)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MPLBACKEND": "svg"},
    )
    assert result.stdout.split() == ["False", "True"]


# --- report ------------------------------------------------------------------------------


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


def test_report_of_a_missing_run_directory_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory not found: .*nope"):
        report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics file not found: .*empty.*metrics.jsonl"):
        report(tmp_path / "empty")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", r"config.json is not valid JSON"),
        ("[1]", r"config.json holds list; expected an object"),
        ('{"max_grad_norm": -1}', r"config.json: max_grad_norm=-1; expected a positive"),
    ],
)
def test_report_rejects_bad_config(tmp_path, config, message):
    write(tmp_path / "metrics.jsonl", [train_line(1)])
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=message):
        report(tmp_path)
