"""A folder of compiled programs that JAX reads and writes, safe against kills and other writers.

:class:`AtomicFileCache` keeps JAX's entry names and format; :mod:`leanstep.compilation.cache`
installs it as JAX's persistent compilation cache.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

__all__ = ["DEFAULT_MAX_BYTES", "AtomicFileCache"]

#: The folder's bound: past it the least recently used entries are removed.
DEFAULT_MAX_BYTES = 2 * 1024**3


class AtomicFileCache:
    """JAX's cache interface (``get``, ``put``) over a folder, safe against kills and other writers.

    ``put`` writes ``<key>-cache`` under a temporary name and renames it into place, so that a
    reader (another process) never sees part of an entry and a killed writer leaves no entry;
    ``get`` marks an entry used (its modification time). Past ``max_bytes`` the least recently
    used entries are removed. Leftovers of killed writers are removed when they are an hour old.

    Example:
      >>> import tempfile
      >>> cache = AtomicFileCache(tempfile.mkdtemp(), max_bytes=10)
      >>> cache.put("a", b"12345"), cache.put("b", b"6789"), cache.get("a")
      (None, None, b'12345')
      >>> cache.put("c", b"abc")  # 12 bytes > 10: the least recently used, "b", goes
      >>> cache.get("b") is None and cache.get("c") == b"abc"
      True
    """

    _SUFFIX = "-cache"

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._path = Path(path)
        self.max_bytes = max_bytes
        self._path.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> bytes | None:
        entry = self._path / f"{key}{self._SUFFIX}"
        try:
            value = entry.read_bytes()
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(entry)  # used now: the last to be evicted
        return value

    def put(self, key: str, value: bytes) -> None:
        entry = self._path / f"{key}{self._SUFFIX}"
        if entry.exists():
            return
        self._evict(len(value))
        fd, aside = tempfile.mkstemp(dir=self._path, prefix=f".{key[:40]}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(value)
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
