"""One writer per run directory: an exclusive lock on ``<out>/run.lock``, held for the whole run.

Two ``leanstep train`` processes on one ``--out`` would interleave ``metrics.jsonl``, mix one
run's config with the other's checkpoints, and let a ``--resume`` delete the live run's
in-flight checkpoint. So a run takes :class:`RunLock` before it reads or writes anything in the
directory, and a second writer is refused at once, told who holds it::

    --out 'runs/a' is in use by another leanstep train (pid 4242 on host gpu-7, since
    2026-12-01T18:00:00Z); wait for it to finish, or choose another --out

The lock is ``flock(LOCK_EX | LOCK_NB)`` on a file that is never deleted (deleting a lock file
lets two processes hold "the" lock on two inodes). The kernel releases it when its holder
exits, however it exits, so a lock left by a killed process is free: the next run takes it
over and says whose it was. The holder's pid, host and start time are written into the file
after the lock is held, for the message only; the kernel, not the file, decides who holds it.
Locks on network filesystems are only as good as the filesystem's ``flock`` (NFS v4 maps it to
byte-range locks, which work across hosts).

Example:
  >>> import tempfile
  >>> out = tempfile.mkdtemp()
  >>> with RunLock(out) as lock:
  ...     try:
  ...         RunLock(out).acquire()
  ...     except RunDirectoryInUse as error:
  ...         print(str(error).split(" (pid")[0])
  --out '...' is in use by another leanstep train
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["LOCK_NAME", "RunDirectoryInUse", "RunLock"]

LOCK_NAME = "run.lock"


class RunDirectoryInUse(ValueError):
    """Another live process holds the run directory's lock."""


def _holder() -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now}


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "a process that has not said who it is yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"


class RunLock:
    """An exclusive, non-blocking lock on ``<out>/run.lock`` (``out`` is created if missing).

    Args:
      out: the run directory.

    ``acquire`` raises :class:`RunDirectoryInUse` (a ValueError naming ``--out``, the holder's
    pid and host) if another process holds it, OSError if the file cannot be created. ``previous``
    is what the file said before this process took it (the last holder, now gone), or None.
    """

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self.previous: dict[str, Any] | None = None
        self.existed = False  # whether run.lock was there before acquire (a run had started here)
        self._fd: int | None = None

    def _read(self, fd: int) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
            value = json.loads(os.pread(fd, 4096, 0).decode())
            return value if isinstance(value, dict) else None
        return None

    def acquire(self) -> Self:
        if self._fd is not None:
            return self
        self.out.mkdir(parents=True, exist_ok=True)
        self.existed = self.path.exists()
        # O_NOFOLLOW: a symlink planted as run.lock is refused (ELOOP), not followed.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            os.close(fd)
            raise RunDirectoryInUse(
                f"--out {str(self.out)!r} is in use by another leanstep train ({_describe(holder)}); "
                "wait for it to finish, or choose another --out"
            ) from None
        except OSError:
            os.close(fd)
            raise
        self.previous = self._read(fd)
        record = json.dumps(_holder()).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return self

    def took_over(self) -> str | None:
        """A note if the lock was last held by another process (which ended without a word)."""
        if not self.previous or self.previous.get("pid") == os.getpid():
            return None
        return f"took over the run directory's lock from {_describe(self.previous)}, which is no longer running"

    def release(self) -> None:
        """Releases the lock (the file stays: see the module doc); safe to call twice."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):  # an empty file: its last holder ended cleanly
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()
