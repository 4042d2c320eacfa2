"""SIGINT and SIGTERM as a request to stop after the current step, never inside a save.

Example:
  >>> import os, signal
  >>> with StopSignals() as stop:
  ...     with stop.deferred():          # a checkpoint save
  ...         os.kill(os.getpid(), signal.SIGTERM)
  ...         os.kill(os.getpid(), signal.SIGTERM)   # waits too: the save finishes first
  ...     stop.received == signal.SIGTERM   # and no KeyboardInterrupt
  True
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["StopSignals", "Terminated", "raising_on_sigterm"]


class StopSignals:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step.

    A second signal stops the run at once (KeyboardInterrupt), except inside :meth:`deferred`
    (a checkpoint save): there every signal is only recorded, and the run stops once the save is
    committed, so that no signal can leave a save half done.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and not self._deferring:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.received = self.received or signum

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals inside wait until the block ends; the loop then stops after that step."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Terminated(BaseException):
    """Raised by :func:`raising_on_sigterm`'s handler: the process was sent SIGTERM."""


@contextlib.contextmanager
def raising_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (as SIGINT raises KeyboardInterrupt).

    For a caller of :func:`leanstep.training.train` that reports a stop rather than ending at
    once: a run stopped by SIGTERM saves its step, then its re-delivered signal raises
    ``Terminated`` here, whose ``__context__`` is the ``RunStopped`` naming the step.

    Example:
      >>> import os, signal
      >>> with raising_on_sigterm():
      ...     try:
      ...         os.kill(os.getpid(), signal.SIGTERM)
      ...     except Terminated:
      ...         print("terminated")
      terminated
    """

    def handle(signum: int, frame: Any) -> None:
        raise Terminated(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
