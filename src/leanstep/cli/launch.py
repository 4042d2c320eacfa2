"""The ``leanstep`` command's entry point: SIGINT and SIGTERM end it cleanly while it loads.

Loading the command (JAX, XLA, the sub-packages) takes seconds. A signal in that time met
Python's own handlers: a 30-line ``KeyboardInterrupt`` traceback for SIGINT, a silent exit for
SIGTERM; a SIGINT inherited as ignored (a shell's background job) was not seen at all; and an
exception raised by a handler while a C extension initialises can abort the process (seen here:
SIGABRT and SIGSEGV inside jaxlib's import). So, first thing, both signals end the process at
once, with one line on stderr and the exit code of the signal, 130 or 143: nothing has been
written yet, so there is nothing to finish. Once loaded, :func:`leanstep.cli.main.main` sets its
own handlers (``train`` turns a signal into a stop after the current step, or a save).

A command a signal stopped ends without the interpreter's shutdown
(:func:`leanstep.cli.main.finish`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

__all__ = ["main"]

_WHAT = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}


def _exit_now(signum: int, frame: Any) -> None:
    os.write(2, f"leanstep: {_WHAT[signal.Signals(signum)]}\n".encode())
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Runs ``leanstep`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        for sig in _WHAT:
            signal.signal(sig, _exit_now)
    except ValueError:  # not the main thread: the signals are not ours to handle
        pass
    from leanstep.cli.main import finish
    from leanstep.cli.main import main as run
    from leanstep.training import stop_signals  # noqa: F401 - the heavy imports, under _exit_now

    try:
        code = run(argv)
    except SystemExit as done:  # argparse ends --help and a usage error so: their code, as a return's
        if not isinstance(done.code, int):
            raise  # not argparse's: Python's own exit prints it
        code = done.code
    # The command is over and its outcome is the exit code: a signal during the interpreter's
    # shutdown (which puts Python-level handlers back to the default) would replace it with a
    # death by signal (-2) after a finished run had printed its summary, or ``--help`` its text.
    try:
        for sig in _WHAT:
            signal.signal(sig, signal.SIG_IGN)
    except ValueError:
        pass
    return finish(code)


if __name__ == "__main__":
    sys.exit(main())
