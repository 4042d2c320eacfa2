"""Outputs a user names: checked before the work, written so that a crash leaves the old file or the new.

.. code-block:: text

    check_output_path(path, what=)  an output that can be written, checked before the work
    write_bytes_atomic(path, data)  temp file + os.replace: the old file or the new, never half
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from leanstep.common.files import expand_path, os_error_reason

__all__ = ["check_output_path", "write_bytes_atomic"]


def check_output_path(path: str | os.PathLike[str], *, what: str) -> Path:
    """Checks, before any work, that a file can be written at ``path``; returns it, ``~`` expanded.

    Accepted: an existing regular file in a writable folder (it will be replaced atomically), a
    path whose nearest existing ancestor is a writable folder (the folders are created when
    writing), or an existing non-regular file such as ``/dev/stdout`` or a pipe, written in place.

    Args:
      path: the output path, as the flag gave it.
      what: names the output in messages, e.g. ``"--json"``; the path is added.

    Returns:
      The path with ``~`` expanded.

    Raises:
      ValueError: ``"<what> '<path>' ..."``: the path is empty or a directory, a symlink loop, an
        ancestor is a file, or the folder it goes in is not writable.

    Example:
      >>> import tempfile
      >>> folder = Path(tempfile.mkdtemp())
      >>> _ = (folder / "a").write_text("x")
      >>> check_output_path(folder / "new" / "out.json", what="--json") == folder / "new" / "out.json"
      True
      >>> check_output_path(folder / "a" / "out.json", what="--json")
      Traceback (most recent call last):
      ...
      ValueError: --json '.../a/out.json' cannot be created: '.../a' is not a directory
    """
    if not os.fspath(path):
        raise ValueError(f"{what} must be a non-empty file path, got ''")
    target = expand_path(path)
    named = f"{what} {str(target)!r}"
    try:
        info = os.stat(target)
    except OSError as error:
        if error.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise ValueError(f"{named} {os_error_reason(error)}") from None
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{named} is a directory; expected a file path")
    if info is not None and not stat.S_ISREG(info.st_mode):
        return target  # a device or a pipe: written in place, nothing to create
    ancestor = target.parent
    while True:
        try:
            info = os.stat(ancestor)
            break
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.ENOTDIR) or ancestor == ancestor.parent:
                raise ValueError(f"{named} cannot be created: {str(ancestor)!r} {os_error_reason(error)}") from None
            ancestor = ancestor.parent
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{named} cannot be created: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{named} cannot be written: the folder {str(ancestor)!r} is not writable")
    return target


def _named(error: OSError, path: Path) -> OSError:
    """``error`` (same class and errno) naming ``path`` rather than a temporary file."""
    if error.errno is None:
        return OSError(f"cannot write {str(path)!r}: {error}")
    return type(error)(error.errno, error.strerror or os.strerror(error.errno), os.fspath(path))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Writes ``data`` to ``path`` whole or not at all: a temporary file, fsync, ``os.replace``.

    Missing parent folders are created. If the write fails (a full disk, a read-only folder) the
    temporary file is removed and whatever was at ``path`` before is untouched. A ``path`` that
    exists and is not a regular file (``/dev/stdout``, a pipe) is written in place instead, since
    replacing it would remove the device or pipe.

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      OSError: of the same kind and ``errno`` as the failure (``ENOSPC``, ``EACCES``, ...), its
        ``filename`` being ``path``.
    """
    path = Path(path)
    try:
        in_place = not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        in_place = False
    if in_place:
        try:
            with open(path, "wb") as file:
                file.write(data)
        except OSError as error:
            raise _named(error, path) from None
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as error:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # never created, or already gone: nothing is left behind either way
        raise _named(error, path) from None
    return path
