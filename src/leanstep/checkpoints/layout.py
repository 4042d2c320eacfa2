"""Where a checkpoint step lives on disk, and the two renames that commit and retire it.

Layout of a checkpoint directory::

    <directory>/<step>/                         a committed step: orbax's files + its manifest
    <directory>/.staging/<step>/                a step being written (orbax, then the manifest)
    <directory>/.staging/<step>.orbax-...       orbax's own temporary directory inside staging
    <directory>/.retired-<step>-<n>/            a step being deleted
    <directory>/<step>.orbax-checkpoint-tmp/    what leanstep < 0.5 left of an interrupted save

A step is written whole under ``.staging``, its manifest last, and only then renamed to its
final name (:func:`commit_step`: one ``rename`` and an ``fsync`` of the directory). So a
directory named ``<step>`` always holds its manifest: there is no moment, and no signal or
crash, at which a step exists under its final name without one. Deletion is the same in
reverse (:func:`retire_step`): the step is renamed away first, so it vanishes from the list at
once and whole, and the slow ``rmtree`` happens out of sight. :func:`remove_unfinished_saves`
clears what a killed process left in staging; only the run directory's single writer calls it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from pathlib import Path

__all__ = [
    "STAGING",
    "commit_step",
    "committed_steps",
    "remove_unfinished_saves",
    "retire_step",
    "staging_path",
    "unfinished_saves",
]

#: The subdirectory steps are written in before they are committed.
STAGING = ".staging"
_RETIRED = ".retired-"
_LEGACY_TMP = ".orbax-checkpoint-tmp"
_counter = itertools.count()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_steps(directory: Path) -> list[int]:
    """The committed steps of ``directory``, ascending (orbax's step naming: the bare number).

    Raises:
      OSError: the directory cannot be listed.
    """
    names = [e.name for e in os.scandir(directory) if e.name.isascii() and e.name.isdigit() and e.is_dir()]
    return sorted(int(n) for n in names if str(int(n)) == n)


def staging_path(directory: Path, step: int) -> Path:
    """Where step ``step`` is written before it is committed; anything already there is removed."""
    staging = directory / STAGING
    staging.mkdir(exist_ok=True)
    for entry in staging.iterdir():
        if entry.name == str(step) or entry.name.startswith(f"{step}."):
            _remove(entry)
    return staging / str(step)


def commit_step(directory: Path, step: int) -> None:
    """Renames the staged, manifested step to its final name, durably.

    Raises:
      OSError: the rename failed (the step stays in staging and is never listed).
    """
    os.rename(directory / STAGING / str(step), directory / str(step))
    _fsync_directory(directory)
    with contextlib.suppress(OSError):  # staging is left only while something is in it
        (directory / STAGING).rmdir()


def retire_step(directory: Path, step: int) -> None:
    """Deletes a committed step: renamed away first (it leaves the list whole), then removed."""
    retired = directory / f"{_RETIRED}{step}-{os.getpid()}-{next(_counter)}"
    os.rename(directory / str(step), retired)
    _fsync_directory(directory)
    _remove(retired)


def unfinished_saves(directory: Path) -> list[str]:
    """Names (relative to ``directory``) of interrupted writes and deletions left behind."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    names = [e.name for e in entries if e.name.startswith(_RETIRED) or _LEGACY_TMP in e.name]
    # A commit removes the emptied staging folder: one may vanish between the two listings.
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        names += [f"{STAGING}/{e.name}" for e in os.scandir(directory / STAGING)]
    return sorted(names)


def remove_unfinished_saves(directory: Path) -> list[str]:
    """Deletes what killed processes left in ``directory``; one note per thing removed.

    Only the single writer of the directory may call this (another writer's save in progress
    would be deleted): leanstep's run directories are locked for that (``leanstep.training``).
    """
    removed = unfinished_saves(directory)
    for name in removed:
        _remove(directory / name)
    return [f"removed an unfinished checkpoint write: {name}" for name in removed]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
