"""A folder of compiled programs that JAX reads and writes, safe against kills and other writers.

:class:`AtomicFileCache` keeps JAX's entry names; :mod:`leanstep.compilation.cache` installs it as
JAX's persistent compilation cache. Each entry is JAX's bytes behind a header: a magic line and
a 16-byte BLAKE2b digest of the entry's key and those bytes. JAX itself trusts whatever a file of
the right name holds, so an entry copied over another one (a program of other shapes: the run
then fails deep inside with a raw error), or damaged in a way that still decompresses, would be
loaded, again on every run. Here such an entry is a miss: it is removed, reported once, and
written again. An entry that is no regular file (a FIFO would block the read forever, a folder
would raise) is a miss too, reported, and left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["DEFAULT_MAX_BYTES", "AtomicFileCache"]

#: The folder's bound: past it the least recently used entries are removed.
DEFAULT_MAX_BYTES = 2 * 1024**3

_MAGIC = b"leanstep compiled program 1\n"
_DIGEST_BYTES = 16


def _digest(key: str, value: bytes) -> bytes:
    return hashlib.blake2b(key.encode() + b"\0" + value, digest_size=_DIGEST_BYTES).digest()


def _payload(key: str, data: bytes) -> bytes | None:
    """JAX's bytes of an entry read back, or None if it is not the entry written for ``key``."""
    head = len(_MAGIC) + _DIGEST_BYTES
    if len(data) < head or not data.startswith(_MAGIC):
        return None
    value = data[head:]
    return value if data[len(_MAGIC) : head] == _digest(key, value) else None


class AtomicFileCache:
    """JAX's cache interface (``get``, ``put``) over a folder, safe against kills and other writers.

    ``put`` writes ``<key>-cache`` under a temporary name and renames it into place, so that a
    reader (another process) never sees part of an entry and a killed writer leaves no entry;
    ``get`` marks an entry used (its modification time) and checks it (the module doc): an entry
    that is not the one written for its key is removed, one that is no regular file is left, and
    either is a miss, told to ``on_problem(detail, removed)``. Past ``max_bytes`` the least recently
    used entries are removed. Leftovers of killed writers are removed when they are an hour old.

    Example:
      >>> import tempfile
      >>> cache = AtomicFileCache(tempfile.mkdtemp(), max_bytes=100)  # each entry: 44 bytes + its own
      >>> cache.put("a", b"12345"), cache.put("b", b"6789"), cache.get("a")
      (None, None, b'12345')
      >>> cache.put("c", b"abc")  # 144 bytes > 100: the least recently used, "b", goes
      >>> cache.get("b") is None and cache.get("c") == b"abc"
      True
    """

    _SUFFIX = "-cache"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        on_problem: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._path = Path(path)
        self.max_bytes = max_bytes
        self._on_problem = on_problem if on_problem is not None else (lambda detail, removed: None)
        self._path.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> bytes | None:
        entry = self._path / f"{key}{self._SUFFIX}"
        data = self._read(entry)
        if data is None:
            return None
        value = _payload(key, data)
        if value is None:
            with contextlib.suppress(OSError):
                entry.unlink()
            what = "is damaged or holds another program" if data.startswith(_MAGIC) else "is not in this format"
            self._on_problem(f"{entry.name} {what}", True)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry)  # used now: the last to be evicted
        return value

    def _read(self, entry: Path) -> bytes | None:
        """The bytes of ``entry`` if it is a regular file; None (told) if not, or unreadable."""
        try:  # non-blocking: opening a FIFO must not wait for a writer
            fd = os.open(entry, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as error:
            self._on_problem(f"{entry.name}: {error.strerror or error}", False)
            return None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "folder" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "special file"
            self._on_problem(f"{entry} is a {kind}, not an entry; remove it", False)
            return None
        with os.fdopen(fd, "rb") as file:
            try:
                return file.read()
            except OSError as error:
                self._on_problem(f"{entry.name}: {error.strerror or error}", False)
                return None

    def put(self, key: str, value: bytes) -> None:
        entry = self._path / f"{key}{self._SUFFIX}"
        if entry.exists() or entry.is_symlink():
            return
        self._evict(len(_MAGIC) + _DIGEST_BYTES + len(value))
        fd, aside = tempfile.mkstemp(dir=self._path, prefix=f".{key[:40]}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(_MAGIC + _digest(key, value) + value)
            os.replace(aside, entry)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(aside)
            raise

    def _evict(self, adding: int) -> None:
        """Removes the least recently used entries until ``adding`` more bytes fit the bound."""
        entries, total, stale = [], adding, time.time() - 3600
        for item in os.scandir(self._path):
            try:
                info = item.stat()
            except OSError:  # removed by another process meanwhile
                continue
            if item.name.endswith(self._SUFFIX):
                entries.append((info.st_mtime, info.st_size, item.path))
                total += info.st_size
            elif item.name.endswith(".partial") and info.st_mtime < stale:  # a killed writer's
                with contextlib.suppress(OSError):
                    os.unlink(item.path)
        entries.sort()
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):  # another process may evict it first
                os.unlink(path)
            total -= size
