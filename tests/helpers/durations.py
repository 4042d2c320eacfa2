"""Sums a ``LEANSTEP_TEST_DURATIONS`` file (conftest.py) by test file, slowest first.

LEANSTEP_TEST_DURATIONS=/tmp/d.tsv python -m pytest -q && python tests/helpers/durations.py /tmp/d.tsv
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def _fields(line: str) -> tuple[float, str, float, float, str]:
    """``(seconds, outcome, compile seconds, trace seconds, node id)`` of one line."""
    duration, _, outcome, compiled, traced, node = line.rstrip("\n").split("\t", 5)
    return float(duration), outcome, float(compiled), float(traced), node


def by_file(lines: list[str]) -> list[tuple[str, float, int, float, float]]:
    """``(file, seconds, tests, compile seconds, trace seconds)`` per test file, slowest first."""
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    tests: dict[str, set[str]] = collections.defaultdict(set)
    for line in lines:
        duration, _, compiled, traced, node = _fields(line)
        name = node.split("::", 1)[0]
        sums[name] = [a + b for a, b in zip(sums[name], (duration, compiled, traced), strict=True)]
        tests[name].add(node)
    rows = [(f, s[0], len(tests[f]), s[1], s[2]) for f, s in sums.items()]
    return sorted(rows, key=lambda row: -row[1])


def failed(lines: list[str]) -> list[str]:
    """The node ids of the phases that failed (a test's failure, or an error in its setup or teardown)."""
    return [_fields(line)[4] for line in lines if _fields(line)[1] == "failed"]


if __name__ == "__main__":
    rows = by_file(Path(sys.argv[1]).read_text().splitlines())
    print(
        "  seconds  compiling  tracing  tests  file   (compiling and tracing: in pytest's processes, not their children)"
    )
    for name, seconds, count, compiled, traced in rows[: int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
        print(f"{seconds:9.1f}  {compiled:9.1f}  {traced:7.1f}  {count:5d}  {name}")
    total = [sum(row[i] for row in rows) for i in (1, 3, 4)]
    print(f"{total[0]:9.1f}  {total[1]:9.1f}  {total[2]:7.1f}         in all (the workers' sums, not the wall clock)")
    for node in failed(Path(sys.argv[1]).read_text().splitlines()):
        print("failed:", node)
