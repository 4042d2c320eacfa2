"""Sums a ``LEANSTEP_TEST_DURATIONS`` file (conftest.py) by test file, slowest first.

LEANSTEP_TEST_DURATIONS=/tmp/d.tsv python -m pytest -q && python tests/durations.py /tmp/d.tsv
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def by_file(lines: list[str]) -> list[tuple[str, float, int]]:
    """``(file, seconds, tests)`` per test file, slowest first."""
    seconds: dict[str, float] = collections.defaultdict(float)
    tests: dict[str, set[str]] = collections.defaultdict(set)
    for line in lines:
        duration, _, _, node = line.rstrip("\n").split("\t", 3)
        name = node.split("::", 1)[0]
        seconds[name] += float(duration)
        tests[name].add(node)
    return sorted(((f, s, len(tests[f])) for f, s in seconds.items()), key=lambda row: -row[1])


def failed(lines: list[str]) -> list[str]:
    """The node ids of the phases that failed (a test's failure, or an error in its setup or teardown)."""
    return [line.rstrip("\n").split("\t", 3)[3] for line in lines if line.split("\t")[2] == "failed"]


if __name__ == "__main__":
    rows = by_file(Path(sys.argv[1]).read_text().splitlines())
    for name, seconds, count in rows[: int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
        print(f"{seconds:9.1f} s  {count:5d} tests  {name}")
    print(f"{sum(s for _, s, _ in rows):9.1f} s  in all (the workers' sum, not the wall clock)")
    for node in failed(Path(sys.argv[1]).read_text().splitlines()):
        print("failed:", node)
