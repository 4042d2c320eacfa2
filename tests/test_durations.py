"""The suite's profile: conftest.py appends each test phase's seconds (and its seconds compiling and tracing);
tests/helpers/durations.py sums them by file."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

from helpers.durations import by_file, failed


def _root_conftest() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[1] / "conftest.py")
    assert spec is not None and spec.loader is not None
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    return root


def test_the_longest_files_are_handed_out_first_and_each_is_a_test_file():
    root = _root_conftest()
    first = root.LONGEST_FIRST
    repo = Path(__file__).parents[1]
    assert len(set(first)) == len(first) and all(
        (repo / name).is_file() and Path(name).name.startswith("test_") for name in first
    ), first
    nodes = ["tests/test_a.py::x", f"{first[1]}::y", "tests/test_b.py::z", f"{first[0]}::w", f"{first[1]}::v"]
    items = [types.SimpleNamespace(nodeid=node) for node in nodes]
    root.pytest_collection_modifyitems(None, items)
    assert [item.nodeid for item in items] == [nodes[3], nodes[1], nodes[4], nodes[0], nodes[2]]


def test_each_phase_is_appended_and_summed_by_file(tmp_path, monkeypatch):
    root = _root_conftest()
    path = tmp_path / "d.tsv"
    monkeypatch.setenv("LEANSTEP_TEST_DURATIONS", str(path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # as in xdist's controller, or without xdist
    for duration, when, node, jax_seconds in [
        (1.5, "setup", "tests/test_a.py::test_x", (1.0, 0.25)),
        (2.0, "call", "tests/test_a.py::test_x", (0.5, 0.5)),
        (4.25, "call", "tests/test_b.py::test_y[1]", None),  # no JAX figures (a report from elsewhere): zeros
        (0.5, "call", "tests/test_a.py::test_z", (0.0, 0.125)),
    ]:
        outcome = "failed" if node.endswith("test_z") else "passed"
        properties = [("jax_seconds", jax_seconds)] if jax_seconds else []
        report = types.SimpleNamespace(
            duration=duration, when=when, outcome=outcome, nodeid=node, user_properties=properties
        )
        root.pytest_runtest_logreport(report)
    assert by_file(path.read_text().splitlines()) == [
        ("tests/test_b.py", 4.25, 1, 0.0, 0.0),
        ("tests/test_a.py", 4.0, 2, 1.5, 0.875),
    ]
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


def test_a_phase_carries_its_processes_compile_and_trace_seconds(tmp_path):
    """Through pytest's own hooks: a test that compiles reports XLA and tracing seconds; the next starts at zero."""
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_compiles.py").write_text(
        "import jax, jax.numpy as jnp\n\n\n"
        "def test_one():\n    jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(3.0)).block_until_ready()\n\n\n"
        "def test_two():\n    pass\n"
    )
    path = tmp_path / "d.tsv"
    # the compile cache off: a program loaded from the suite's cache is not compiled
    env = {**os.environ, "LEANSTEP_TEST_DURATIONS": str(path), "LEANSTEP_COMPILE_CACHE": "off"}
    env.pop("PYTEST_XDIST_WORKER", None)  # under xdist: the child writes its own lines, as a controller
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "test_compiles.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {(f[1], f[5]): f for f in (line.split("\t") for line in path.read_text().splitlines())}
    one, two = lines[("call", "test_compiles.py::test_one")], lines[("call", "test_compiles.py::test_two")]
    assert float(one[3]) > 0 and float(one[4]) > 0, one
    assert float(two[3]) == 0 and float(two[4]) == 0, two
