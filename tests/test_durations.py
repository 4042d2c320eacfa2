"""The suite's profile: conftest.py appends each test phase's seconds; tests/durations.py sums them by file."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

from durations import by_file, failed


def test_each_phase_is_appended_and_summed_by_file(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[1] / "conftest.py")
    assert spec is not None and spec.loader is not None
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    path = tmp_path / "d.tsv"
    monkeypatch.setenv("LEANSTEP_TEST_DURATIONS", str(path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # as in xdist's controller, or without xdist
    for duration, when, node in [
        (1.5, "setup", "tests/test_a.py::test_x"),
        (2.0, "call", "tests/test_a.py::test_x"),
        (4.25, "call", "tests/test_b.py::test_y[1]"),
        (0.5, "call", "tests/test_a.py::test_z"),
    ]:
        outcome = "failed" if node.endswith("test_z") else "passed"
        root.pytest_runtest_logreport(types.SimpleNamespace(duration=duration, when=when, outcome=outcome, nodeid=node))
    assert by_file(path.read_text().splitlines()) == [("tests/test_a.py", 4.0, 2), ("tests/test_b.py", 4.25, 1)][::-1]
    assert failed(path.read_text().splitlines()) == ["tests/test_a.py::test_z"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker: its controller writes the line
    root.pytest_runtest_logreport(
        types.SimpleNamespace(duration=9.0, when="call", outcome="passed", nodeid="tests/test_c.py::t")
    )
    assert len(path.read_text().splitlines()) == 4
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("LEANSTEP_TEST_DURATIONS")
    root.pytest_runtest_logreport(
        types.SimpleNamespace(duration=9.0, when="call", outcome="passed", nodeid="tests/test_c.py::t")
    )
    assert len(path.read_text().splitlines()) == 4  # unset: nothing written
