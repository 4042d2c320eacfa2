"""What the test modules share: the ``leanstep`` command run in this process, and one trained tiny run.

``cli(*argv)`` runs ``leanstep ARGV`` in the test's own process and returns its exit code and
output: no child process (a Python and JAX start of 3-5 s each), and the step programs it compiles
stay in this process's cache for the next test. A test keeps a child process only where the
behaviour needs one (a signal, a kill, several processes, a fresh interpreter, simulated devices)
and says so where it starts it.

``tiny_run`` is a copy, in the test's ``tmp_path``, of one run of the tiny transformer trained once
per pytest process (30 steps, evaluated and checkpointed every 10): a test that inspects, reports,
damages or resumes a finished run takes it instead of training its own. Its flags, and the shapes
of the suite's other tiny runs, are defined once in tests/helpers/tiny_runs.py.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

from helpers.tiny_runs import TINY_CORPUS_FILES, TINY_RUN_FLAGS, TINY_RUN_STEPS


class CliResult(NamedTuple):
    """What a ``leanstep`` command left: its exit code and what it wrote to stdout and stderr."""

    code: int
    out: str
    err: str


def run_cli(*argv: str | Path, stdin: str | None = None) -> CliResult:
    """``leanstep ARGV`` in this process, its output captured (argparse's own exits included).

    ``stdin``: the text the command reads on its standard input (``--input -``); None leaves
    pytest's. It calls :func:`leanstep.cli.main.main`, not ``leanstep.cli.launch.main``: the launcher's
    signal handlers end the process at once, which in a test would end pytest.
    """
    from leanstep.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as context:
        if stdin is not None:
            context.enter_context(mock.patch.object(sys, "stdin", io.StringIO(stdin)))
        context.enter_context(contextlib.redirect_stdout(out))
        context.enter_context(contextlib.redirect_stderr(err))
        try:
            code = main([str(arg) for arg in argv])
        except SystemExit as exit_:  # argparse: --help, or a flag it cannot parse
            code = exit_.code if isinstance(exit_.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def cli() -> Callable[..., CliResult]:
    """:func:`run_cli`, for a test or a fixture of any scope."""
    return run_cli


@pytest.fixture(scope="session")
def tiny_flags() -> tuple[str, ...]:
    """The flags of the ``tiny_run`` but ``--steps``, ``--data`` and ``--out``: to train it again, or beside it."""
    return TINY_RUN_FLAGS


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small folder of real text: six standard-library modules (the ``tiny_run``'s data)."""
    root = tmp_path_factory.mktemp("tiny_corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in TINY_CORPUS_FILES:
        (root / name).write_bytes((stdlib / name).read_bytes())
    return root


@pytest.fixture(scope="session")
def _tiny_run_trained(tmp_path_factory: pytest.TempPathFactory, tiny_corpus: Path) -> Path:
    """The tiny run, trained once per pytest process; tests get copies (:func:`tiny_run`), never this."""
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    # It draws its chart (tests/test_train_cli.py reads it); the runs trained again or beside it need none.
    flags = (*(flag for flag in TINY_RUN_FLAGS if flag != "--no-chart"), "--steps", str(TINY_RUN_STEPS))
    result = run_cli("train", *flags, "--data", tiny_corpus, "--out", out)
    assert result.code == 0, result.err[-4000:]
    return out


@pytest.fixture
def tiny_run(_tiny_run_trained: Path, tmp_path: Path) -> Path:
    """This test's own copy of the trained tiny run (``tmp_path/tiny_run``): it may change it at will."""
    return Path(shutil.copytree(_tiny_run_trained, tmp_path / "tiny_run"))
