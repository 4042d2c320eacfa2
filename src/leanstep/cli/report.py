"""``leanstep report``: re-render a run directory's chart and print its summary table."""

from __future__ import annotations

import argparse
from typing import Any

from leanstep.cli.jsontree import InputError


def add_parser(subparsers: Any) -> None:
    """Registers ``leanstep report DIR`` on the ``leanstep`` command's subparsers."""
    r = subparsers.add_parser("report", help="re-render the chart and summary of a run directory")
    r.add_argument("dir", help="a run directory written by leanstep train")
    r.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Redraws ``DIR/curves.png``, prints the summary table and the chart's path; returns 0.

    Raises:
      InputError: the directory, its ``metrics.jsonl`` or its ``config.json`` is missing or
        malformed.
    """
    from rich.console import Console

    from leanstep.cli.render import render_summary
    from leanstep.training.curves import report

    try:
        summary = report(args.dir)
    except (FileNotFoundError, ValueError) as error:
        raise InputError(str(error)) from None
    Console().print(render_summary(summary))
    print(f"chart: {summary['curves']}")
    return 0
