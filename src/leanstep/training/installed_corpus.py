"""The Python source installed on this machine, as a corpus: ``--data @python``.

The standard library's default corpus, split exactly as ``leanstep train`` splits it by default
(:func:`leanstep.training.data.default_corpus_paths`, whole files held out), so the held-out bytes
are the same files on every machine with the same Python and its bits per byte stay comparable
with a CPU run's; plus, for training only, every ``.py`` file of the installed packages (the
site-packages and dist-packages folders Python itself names), up to :data:`PACKAGE_CORPUS_BYTES`.
A package file whose bytes equal a held-out file's is left out of training, so no held-out text is
trained on. Each file's SHA-256 is recorded (``Corpus.describe()["file_sha256"]``).

An accelerator's sized default run (:mod:`leanstep.training.machine_size`) trains on it: the
standard library alone (7 MB) would be seen dozens of times over in three minutes on a chip.
"""

from __future__ import annotations

import hashlib
import os
import site
import stat
import sysconfig
from pathlib import Path

from leanstep.common.files import read_regular_file

__all__ = ["INSTALLED_PYTHON", "PACKAGE_CORPUS_BYTES", "package_files", "package_roots", "sha256_hex"]

#: ``--data``'s name for this corpus.
INSTALLED_PYTHON = "@python"
#: The most bytes of package source read: 256 MB (the TPU v5e machine here holds 130 MB).
PACKAGE_CORPUS_BYTES = 256_000_000


def package_roots() -> list[Path]:
    """The folders installed packages live in: ``sysconfig``'s purelib and platlib and ``site``'s
    site-packages (the user's too), those that exist, each once, none inside another, sorted."""
    named = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    named += site.getsitepackages() if hasattr(site, "getsitepackages") else []  # a virtualenv's old site lacks it
    named += [site.getusersitepackages()] if hasattr(site, "getusersitepackages") else []
    found = sorted({Path(os.path.realpath(p)) for p in named if p and os.path.isdir(p)})
    return [p for p in found if not any(other != p and other in p.parents for other in found)]


def package_files(max_bytes: int = PACKAGE_CORPUS_BYTES, roots: list[Path] | None = None) -> list[tuple[str, bytes]]:
    """Every regular ``.py`` file under ``roots`` (default :func:`package_roots`) as
    ``(name, bytes)``, named ``packages/<path under its root>``, sorted by name; in that order, each
    file is taken if it keeps the total within ``max_bytes``.

    Hidden folders, ``__pycache__`` and symlinks (to files or folders) are passed over; a file
    that cannot be read, or is empty, is left out. A name found under two roots is taken once
    (from the first root).
    """
    candidates: dict[str, Path] = {}
    for root in package_roots() if roots is None else roots:
        for folder, dirs, files in os.walk(root):  # symlinked folders are not followed
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for name in files:
                path = Path(folder, name)
                if name.endswith(".py") and not name.startswith("."):
                    candidates.setdefault("packages/" + path.relative_to(root).as_posix(), path)
    chosen: list[tuple[str, bytes]] = []
    total = 0
    for name in sorted(candidates):
        path = candidates[name]
        try:
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0 or total + info.st_size > max_bytes:
                continue
            content = read_regular_file(path, what=f"installed file {str(path)!r}", limit=info.st_size)
        except (OSError, ValueError):  # gone, unreadable or grown since the walk: not part of the corpus
            continue
        if content and b"\0" not in content:
            chosen.append((name, content))
            total += len(content)
    return chosen


def sha256_hex(content: bytes) -> str:
    """The SHA-256 of ``content``, in hex."""
    return hashlib.sha256(content).hexdigest()
