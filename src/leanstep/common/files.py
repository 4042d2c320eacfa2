"""Files a user names: read without hanging or exhausting memory, written without losing work.

Every path the command line takes is someone's guess, and can be a FIFO (an ``open`` that
never returns), ``/dev/zero`` (a read that never ends), a symlink loop, or a folder holding
any of those. The readers here look before they open, open without blocking, look again at
what they opened, and read at most a stated number of bytes:

.. code-block:: text

    stat_path(path, what=)                  os.stat, its failure said in words
    read_regular_file(path, what=, limit=)  one regular file's bytes, or ValueError
    walk_regular_files(folder, what=, ...)  every regular file under a folder, and a count of the rest

Writing is :mod:`leanstep.common.outputs`'s (``check_output_path``, ``write_bytes_atomic``).

``what`` names the file in every message, path included (``"--data file '/x'"``), so the
messages read as one line: ``--data file '/x' is a FIFO (named pipe), not a regular file``.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

from leanstep.common.memory_sizes import format_bytes

__all__ = [
    "RegularFiles",
    "describe_mode",
    "describe_skipped",
    "expand_path",
    "os_error_reason",
    "read_regular_file",
    "stat_path",
    "walk_regular_files",
]

_CHUNK = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def expand_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`~pathlib.Path` with a leading ``~`` or ``~user`` expanded."""
    return Path(os.path.expanduser(os.fspath(path)))


def describe_mode(mode: int) -> str:
    """What an ``st_mode`` is, with an article: ``'a FIFO (named pipe)'``, ``'a directory'``, ...

    Example:
      >>> describe_mode(stat.S_IFIFO), describe_mode(stat.S_IFCHR | 0o666)
      ('a FIFO (named pipe)', 'a character device')
    """
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a file of unknown kind"


def os_error_reason(error: OSError) -> str:
    """The end of a message for a failed ``stat``/``open``: ``'is a symlink loop'``, ..."""
    if error.errno == errno.ELOOP:
        return "is a symlink loop (or has too many levels of symbolic links)"
    if error.errno == errno.ENOENT:
        return "does not exist"
    if error.errno == errno.ENOTDIR:
        return "does not exist (a component of the path is not a directory)"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "cannot be read: permission denied"
    return f"cannot be read ({error.strerror or error})"


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be an int >= 0 (bytes); got {limit!r}")


def _read_open(path: Path, what: str, limit: int) -> bytes:
    """Open without blocking, check the opened thing is a regular file, read at most ``limit + 1`` bytes.

    More than ``limit`` bytes back means the file holds more than ``limit``: the caller says so.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        raise ValueError(f"{what} {os_error_reason(error)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped in after the stat
            raise ValueError(f"{what} is {describe_mode(mode)}, not a regular file")
        chunks, size = [], 0
        while size <= limit:  # st_size can lie (/proc) or grow: count what arrives
            chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as error:
        raise ValueError(f"{what} cannot be read ({error})") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def stat_path(path: str | os.PathLike[str], *, what: str) -> os.stat_result:
    """``os.stat(path)`` (symlinks followed), its failure said in words.

    Raises:
      ValueError: ``"<what> does not exist"``, ``"... is a symlink loop ..."``, ``"... cannot be
        read: permission denied"`` or ``"... cannot be read (<reason>)"``.
    """
    try:
        return os.stat(path)
    except OSError as error:
        raise ValueError(f"{what} {os_error_reason(error)}") from None


def read_regular_file(path: str | os.PathLike[str], *, what: str, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them.

    ``path`` is stat'ed first (symlinks followed) and refused unless it is a regular file of at
    most ``limit`` bytes; it is then opened with ``O_NONBLOCK`` (so a FIFO swapped in after the
    stat cannot block the open), checked again with ``fstat``, and read up to ``limit + 1``
    bytes (a file that grew, or whose size the kernel does not report, is still bounded).
    ``path`` is used as given: expand ``~`` first with :func:`expand_path` if it comes from a flag.

    Args:
      path: the file.
      what: names the file in messages, path included, e.g. ``"--data file '/x'"``.
      limit: the most bytes to accept.

    Returns:
      The file's bytes.

    Raises:
      ValueError: a message starting with ``what``: the path does not exist, is a symlink loop,
        cannot be read (permission, I/O error), is not a regular file (it says what it is: a
        FIFO, a socket, a device, a directory), or holds more than ``limit`` bytes (named).

    Example:
      >>> import tempfile
      >>> folder = Path(tempfile.mkdtemp())
      >>> _ = (folder / "a.txt").write_text("hello")
      >>> read_regular_file(folder / "a.txt", what="the file", limit=10)
      b'hello'
      >>> os.mkfifo(folder / "pipe")
      >>> read_regular_file(folder / "pipe", what="'pipe'", limit=10)
      Traceback (most recent call last):
      ...
      ValueError: 'pipe' is a FIFO (named pipe), not a regular file
    """
    _check_limit(limit)
    if not os.fspath(path):  # Path("") is ".", the working directory
        raise ValueError(f"{what} is an empty path")
    path = Path(path)
    info = stat_path(path, what=what)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} is {describe_mode(info.st_mode)}, not a regular file")
    if info.st_size > limit:
        raise ValueError(
            f"{what} is {format_bytes(info.st_size)} ({info.st_size:,} bytes), over the limit of "
            f"{format_bytes(limit)} ({limit:,} bytes)"
        )
    content = _read_open(path, what, limit)
    if len(content) > limit:
        raise ValueError(f"{what} holds more than {format_bytes(limit)} ({limit:,} bytes), the limit")
    return content


class RegularFiles(NamedTuple):
    """What :func:`walk_regular_files` found.

    Attributes:
      files: ``(relative POSIX name, bytes)`` of every regular file read, sorted by name.
      skipped: how many entries of each kind were passed over, e.g.
        ``{"a FIFO (named pipe)": 1, "a symlink loop": 2}``; empty when none was.
    """

    files: tuple[tuple[str, bytes], ...]
    skipped: dict[str, int]


def describe_skipped(skipped: dict[str, int]) -> str:
    """A :attr:`RegularFiles.skipped` count in words; ``''`` when nothing was skipped.

    Example:
      >>> describe_skipped({"a symlink loop": 2, "a FIFO (named pipe)": 1})
      '1 FIFO (named pipe), 2 x symlink loop'
    """
    return ", ".join(
        f"{count} {kind.removeprefix('a ').removeprefix('an ')}"
        if count == 1
        else f"{count} x {kind.removeprefix('a ').removeprefix('an ')}"
        for kind, count in sorted(skipped.items(), key=lambda item: item[0].lower())
    )


def walk_regular_files(
    folder: str | os.PathLike[str], *, what: str, max_bytes: int, max_entries: int, skip_hidden: bool = True
) -> RegularFiles:
    """Reads every regular file under ``folder``, skipping (and counting) everything else.

    Symlinks to files are followed; symlinked folders are not (counted as skipped), so a loop
    of folders cannot trap the walk. FIFOs, sockets, devices, broken links, symlink loops and
    entries that cannot be read are skipped and counted, never opened in a way that blocks
    (see :func:`read_regular_file`). Entries whose name starts with ``.`` are skipped silently
    when ``skip_hidden`` (``.git``, editor files).

    Args:
      folder: the folder (``~`` is not expanded here).
      what: names the folder in messages, path included, e.g. ``"--data folder '/x'"``.
      max_bytes: the most bytes to read in all; more is an error, not a silent cut.
      max_entries: the most names (files, folders and anything else) to look at.
      skip_hidden: leave out names starting with ``.``.

    Returns:
      A :class:`RegularFiles`.

    Raises:
      ValueError: a message starting with ``what``: ``folder`` cannot be listed, holds more than
        ``max_bytes`` in regular files, or more than ``max_entries`` entries (the limit is named).
    """
    _check_limit(max_bytes)
    _check_limit(max_entries)
    root = Path(folder)
    try:
        os.listdir(root)  # the top folder itself: an error here is the caller's, not a skip
    except OSError as error:
        raise ValueError(f"{what} {os_error_reason(error)}") from None
    found: list[tuple[str, bytes]] = []
    skipped: dict[str, int] = {}
    total = seen = 0

    def skip(kind: str) -> None:
        skipped[kind] = skipped.get(kind, 0) + 1

    def count(n: int) -> None:
        nonlocal seen
        seen += n
        if seen > max_entries:
            raise ValueError(f"{what} holds more than {max_entries:,} entries, the limit")

    for current, dirs, names in os.walk(root, onerror=lambda error: skip("an unreadable folder")):
        count(len(dirs) + len(names))
        kept = []
        for name in sorted(dirs):
            if skip_hidden and name.startswith("."):
                continue
            if os.path.islink(os.path.join(current, name)):
                skip("a symlinked folder (not followed)")
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            if skip_hidden and name.startswith("."):
                continue
            path = Path(current, name)
            kind = _entry_kind(path)
            if kind is not None:
                skip(kind)
                continue
            try:
                content = _read_open(path, what, max_bytes - total)
            except ValueError:  # swapped for a FIFO after the stat, or an I/O error
                skip("an unreadable file")
                continue
            total += len(content)
            if total > max_bytes:
                raise ValueError(
                    f"{what} holds more than {format_bytes(max_bytes)} ({max_bytes:,} bytes) in "
                    "regular files, the limit"
                )
            found.append((path.relative_to(root).as_posix(), content))
    return RegularFiles(tuple(sorted(found, key=lambda item: item[0])), skipped)


def _entry_kind(path: Path) -> str | None:
    """None for a regular file (after following links), else what to count it as."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "a symlink loop"
        if error.errno == errno.ENOENT:
            return "a broken symbolic link"
        return "an unreadable file"
    return None if stat.S_ISREG(mode) else describe_mode(mode)
