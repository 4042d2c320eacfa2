"""The ``leanstep`` command: parses arguments and hands them to one subcommand."""

from __future__ import annotations

import argparse
import sys

from leanstep.cli import bench, plan, report, solve, train
from leanstep.cli.jsontree import InputError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line and exit code 2, like every other input error of the CLI.
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="leanstep", description="Lean, robust JAX training steps.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    train.add_parser(subparsers)
    report.add_parser(subparsers)
    solve.add_parser(subparsers)
    bench.add_parser(subparsers)
    plan.add_parsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except InputError as error:
        print(f"leanstep {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"leanstep {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
