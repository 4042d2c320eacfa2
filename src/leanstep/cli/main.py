"""The ``leanstep`` command: parses arguments and hands them to one subcommand.

One handler, here, turns every anticipated failure into one line on stderr and an exit code:

    2    bad input: a flag, a file, a run directory that does not fit (InputError, argparse)
    1    the work could not be done or saved: OSError (with its path), a checkpoint, budget or
         run failure of leanstep's own, JAX unable to start the backend JAX_PLATFORMS names,
         memory exhausted
    130  interrupted (SIGINT, Ctrl-C)
    143  terminated (SIGTERM): ``train`` first saves the step it is on, other commands stop at once

Both signals are handled from the moment :func:`main` runs, whatever handlers the process
inherited (a background job's SIGINT starts ignored); one at start-up ends it at once, in one line.

An exception that none of these covers is a bug in leanstep and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings
from typing import Any

from leanstep.cli import bench, plan, report, solve, train, verify
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
    verify.add_parser(subparsers)
    return parser


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _os_error(error: OSError) -> str:
    where = f": {error.filename!r}" if error.filename else ""
    return f"{error.strerror or error}{where}"


def _backend_problem() -> str | None:
    """Why JAX cannot start a backend (e.g. JAX_PLATFORMS names one not installed), or None."""
    try:
        import jax

        jax.devices()
    except Exception as error:  # noqa: BLE001 - whatever JAX raises here, the backend is the problem
        platforms = os.environ.get("JAX_PLATFORMS")
        named = f"JAX_PLATFORMS={platforms!r}: " if platforms else ""
        return (
            f"{named}JAX cannot start a backend ({type(error).__name__}: {_one_line(error) or 'no message'}); "
            "unset JAX_PLATFORMS or install the jax plugin for that platform"
        )
    return None


def _quiet_dependencies() -> None:
    """A failed orbax save reports itself three more ways: absl ERROR logs with tracebacks from its
    threads, asyncio's "Task exception was never retrieved", and tensorstore callbacks that reach
    orbax's closed event loop ("Event loop is closed", as unraisable exceptions), and, at exit,
    "coroutine ... was never awaited" for the writes it abandoned. leanstep reports the failure
    itself, in one line; these go."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)
    if getattr(sys.unraisablehook, "leanstep", False):  # once per process, however often main runs
        return
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if isinstance(value, KeyboardInterrupt) or type(value).__name__ == "Terminated":
            _deliver_again(signal.SIGINT if isinstance(value, KeyboardInterrupt) else signal.SIGTERM)
            return
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            default(unraisable)

    hook.leanstep = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _deliver_again(signum: int) -> None:
    """A signal whose exception was raised where Python drops it (a gc callback of JAX's, at
    start-up) is sent again, from another thread, so that it is raised once this callback is over:
    the signal stops the command rather than being swallowed."""
    import _thread
    import time

    def send() -> None:
        time.sleep(0.01)  # once the hook has returned: _thread.start_new_thread does not wait for it
        os.kill(os.getpid(), signum)

    _thread.start_new_thread(send, ())


def _compile_cache(args: argparse.Namespace) -> None:
    """JAX's persistent compilation cache for a command that compiles, before anything is compiled
    (``--no-compile-cache`` or ``LEANSTEP_COMPILE_CACHE=off``: none). A folder or entry that
    cannot be used is one warning line; the command goes on without it."""
    from leanstep.compilation.cache import disable_compile_cache, enable_compile_cache

    if not hasattr(args, "compile_cache"):
        return  # a command that compiles nothing
    if not args.compile_cache:
        disable_compile_cache()  # off means off, even where JAX_COMPILATION_CACHE_DIR names a folder
        return
    enable_compile_cache(warn=lambda line: print(f"leanstep {args.command}: {line}", file=sys.stderr, flush=True))


def _stop_signals() -> Any:
    """SIGINT raises KeyboardInterrupt and SIGTERM Terminated from here on, whatever the process
    inherited (a shell's background job starts with SIGINT ignored, which would let a ``kill -INT``
    at start-up pass unseen); returns what puts the handlers back. Off the main thread: nothing."""
    from leanstep.training.stop_signals import Terminated

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated(signal.Signals(signum).name)

    try:
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread
        return lambda: None
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]


def _out_of_memory(error: BaseException) -> str | None:
    """XLA's allocation failure (RESOURCE_EXHAUSTED), in one line; None for another error."""
    text = _one_line(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return None
    return f"out of memory ({text[:300]}); choose a smaller model, batch or input"


def main(argv: list[str] | None = None) -> int:
    _quiet_dependencies()
    restore = _stop_signals()
    try:
        return _main(argv)
    finally:
        restore()


def _stopped(who: str, sig: signal.Signals) -> int:
    """One line on stderr for a command ``sig`` stopped; returns its exit code (130 or 143)."""
    print(f"{who}: {'interrupted' if sig == signal.SIGINT else 'terminated (SIGTERM)'}", file=sys.stderr)
    return 128 + sig


def _main(argv: list[str] | None) -> int:
    from leanstep.training.stop_signals import Terminated

    try:  # building the parser imports the commands; --help prints: a signal can come in either
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return _stopped("leanstep", signal.SIGINT)
    except Terminated:
        return _stopped("leanstep", signal.SIGTERM)

    def fail(message: str, code: int) -> int:
        print(f"leanstep {args.command}: error: {_one_line(message)}", file=sys.stderr)
        return code

    try:
        return _run(args, fail)
    except BaseException as error:  # a signal's exception, however it came, is a stop
        sig = _signal_behind(error)
        if sig is None:
            raise
        return _stopped(f"leanstep {args.command}", sig)


def _signal_behind(error: BaseException) -> signal.Signals | None:
    """The signal whose handler raised ``error`` or an exception it led to, or None.

    A handler's exception raised inside a Python callback that C code called (a JAX type's
    ``__hash__`` during a compile's cache lookup) can come back as another exception whose cause
    or context is the signal's (seen once in CI: a SIGTERM while compiling ended in a traceback,
    exit 1). It is still the signal that stopped the command.
    """
    from leanstep.training.stop_signals import Terminated

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt):
            return signal.SIGINT
        if isinstance(current, Terminated):
            return signal.SIGTERM
        current = current.__cause__ or current.__context__
    return None


def _run(args: argparse.Namespace, fail: Any) -> int:
    """``args.run(args)``, with each anticipated failure as one line and its exit code (a signal's
    exception, whatever became of it on the way, goes on to :func:`_main`)."""
    try:
        _compile_cache(args)
        return args.run(args)
    except BaseException as error:  # sorted below; what is not anticipated is re-raised
        if _signal_behind(error) is not None:
            raise
        return _failure(error, fail)


def _failure(error: BaseException, fail: Any) -> int:
    """The exit code of an anticipated failure, after its one line; anything else is re-raised (a bug)."""
    from leanstep.checkpoints.checkpointer import CheckpointError

    if isinstance(error, InputError):
        return fail(str(error), 2)
    if isinstance(error, OSError):
        return fail(_os_error(error), 1)
    if isinstance(error, CheckpointError):
        return fail(str(error), 1)
    if isinstance(error, MemoryError):
        return fail("out of memory (host RAM); choose a smaller model, batch or input", 1)
    problem = _out_of_memory(error) or _backend_problem() if isinstance(error, (RuntimeError, AssertionError)) else None
    if problem is None:
        raise error  # a bug: keep the traceback
    return fail(problem, 1)


#: The exit codes of a command a signal stopped (SIGINT, SIGTERM).
_STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def finish(code: int) -> int:
    """``code``, or, for a command a signal stopped, the process ended at once with it.

    A stopped command has saved what it keeps, but JAX may still be compiling on its own threads
    (a compile whose wait the signal interrupted goes on), and the interpreter's shutdown destroys
    the client under that compile: a segmentation fault (exit 139) after the clean message, in 5
    of 6 runs signalled one second into a first compile. So it flushes the output and ends with
    ``os._exit``. Call it as a process's last act (the ``leanstep`` script and ``python -m``), never
    in a process that goes on (:func:`main` in a test).
    """
    if code not in _STOPPED:
        return code
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(finish(main()))
