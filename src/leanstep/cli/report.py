"""``leanstep report``: re-render a run directory's chart and print its summary table."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from leanstep.cli.jsontree import InputError


def add_parser(subparsers: Any) -> None:
    """Registers ``leanstep report DIR [--chart FILE]`` on the ``leanstep`` command's subparsers."""
    r = subparsers.add_parser("report", help="re-render the chart and summary of a run directory")
    r.add_argument("dir", help="a run directory written by leanstep train")
    r.add_argument(
        "--chart",
        metavar="FILE",
        default=None,
        help="write the chart here instead of DIR/curves.png (for a read-only run directory)",
    )
    r.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Redraws the chart, prints the summary table and the chart's path.

    Returns:
      0; or 1 when the chart could not be written (a read-only run directory, a full disk):
      the table is printed all the same and one line on stderr says what was not written.

    Raises:
      InputError: the directory, its ``metrics.jsonl`` or its ``config.json`` is missing,
        malformed or not a regular file; ``--chart`` cannot be written (checked first).
    """
    from rich.console import Console

    from leanstep.cli.render import render_summary
    from leanstep.common.files import expand_path
    from leanstep.common.outputs import check_output_path
    from leanstep.training.curves import report

    try:
        chart = None if args.chart is None else check_output_path(args.chart, what="--chart")
        summary = report(expand_path(args.dir), chart=chart)
    except (FileNotFoundError, ValueError) as error:
        raise InputError(str(error)) from None
    chart_error = summary.pop("curves_error")
    Console().print(render_summary(summary))
    if chart_error is not None:
        hint = "" if args.chart is not None else "; pass --chart FILE to draw it elsewhere"
        print(f"leanstep report: error: {chart_error} (the summary above is complete{hint})", file=sys.stderr)
        return 1
    print(f"chart: {summary['curves']}")
    return 0
