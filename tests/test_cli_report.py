"""Tests for ``leanstep report`` and the summary table it prints (leanstep.cli.render)."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console

from helpers.metrics_lines import hand_run, png_size, train_line, write
from leanstep.cli.main import main
from leanstep.cli.render import render_summary
from leanstep.training.metrics_log import RunMetrics
from leanstep.training.summary import summarize


def test_render_summary_shows_every_value(tmp_path):
    summary = summarize(hand_run(tmp_path), {"max_grad_norm": 0.5})
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(render_summary(summary))
    text = console.export_text()
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3
    }
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


def test_report_command_prints_the_table_and_the_chart_path(tmp_path, capsys):
    run = tmp_path / "demo"
    write(run / "metrics.jsonl", [train_line(s, loss=4.0 - s) for s in range(1, 4)])
    (run / "config.json").write_text(json.dumps({"max_grad_norm": 1.0}))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "run demo" in out and "max_grad_norm (config)" in out
    assert out.splitlines()[-1] == f"chart: {run / 'curves.png'}"
    assert png_size(run / "curves.png") == (1200, 840)


def test_report_command_input_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err == f"leanstep report: error: run directory not found: {tmp_path / 'nope'}\n"
    write(tmp_path / "metrics.jsonl", ["[1]"])
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl:1 is [1]; expected a JSON object" in err
