"""JAX's persistent compilation cache, set up so that it hits, and a count of what each compile found.

A second ``leanstep train`` with the same flags compiles the same XLA programs again unless they
were kept on disk. JAX keeps them (``jax_compilation_cache_dir``) but by default writes only
programs that took over a second to compile, and a cache enabled after the first compile of a
process is silently never used (jax-ml/jax#21908). :func:`enable_compile_cache` sets the folder,
writes every program (no time or size threshold) and resets JAX's cache state so that it takes
effect from the next compile.

The folder is kept by :class:`AtomicFileCache` rather than JAX's own file cache, which writes an
entry in place (a process killed mid-write leaves a truncated entry that is never replaced) and,
with a size bound, fails every later write of every process once one entry lacks its access-time
file (as a kill between the two writes leaves it). Here an entry appears whole or not at all
(written aside, then renamed), the folder is bounded by removing the least recently used entries,
and concurrent processes need no lock. Entries keep JAX's names; each carries a digest of its key
and bytes, so an entry that is not the program of its name (copied over, damaged) is a miss,
removed and written again, and an entry that is no regular file (a FIFO, a folder) is a miss too.

What keys an entry, so what must miss: JAX hashes the program (without source locations), the
jaxlib version, the backend and its version, ``XLA_FLAGS`` and ``--xla*`` arguments, the compile
options and the devices' kinds, and the folder's own path (JAX names an XLA autotuning cache
inside it in the compile options: a moved folder only misses). It does not hash the host CPU's features, although XLA:CPU
compiles for them (AVX-512 code would fault on an AVX2 machine sharing a home folder), so the
default folder is one per machine kind: :func:`machine_fingerprint` of the CPU's feature flags,
the architecture and the jax/jaxlib versions.

The command line enables it for ``train``, ``bench``, ``plan`` and ``audit`` (``--no-compile-cache``
or ``LEANSTEP_COMPILE_CACHE=off`` turn it off; ``LEANSTEP_COMPILE_CACHE=DIR`` picks the folder).
The library leaves the choice to its caller; the one line is::

    leanstep.compilation.enable_compile_cache()   # before the first jit call

A folder that cannot be written is a warning and the cache stays off; an entry that cannot be
read (damaged on disk) or written (a full disk) is one warning line, the program is compiled as
if there were no cache, and an unreadable entry is removed so that it is written again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax

from leanstep.compilation.atomic_file_cache import DEFAULT_MAX_BYTES, AtomicFileCache

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ENV",
    "OFF_VALUES",
    "CacheState",
    "cache_directory",
    "default_cache_dir",
    "disable_compile_cache",
    "enable_compile_cache",
    "machine_fingerprint",
]

#: The environment variable: ``off`` (or ``0``, ``false``, ``no``) turns the CLI's cache off,
#: a path puts it there.
ENV = "LEANSTEP_COMPILE_CACHE"
#: The values of :data:`ENV` that turn the cache off.
OFF_VALUES = ("0", "off", "false", "no", "none")
#: What JAX says, as a UserWarning, when it cannot read or write an entry.
_JAX_CACHE_ERROR = r"Error (reading|writing) persistent compilation cache entry"


def _cpu_flags() -> str:
    """The host CPU's feature flags as Linux lists them (elsewhere: ``platform.processor()``)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, arm
            return " ".join(sorted(value.split()))
    return platform.processor()


def machine_fingerprint(cpu_flags: str | None = None) -> str:
    """A folder name for this machine kind and JAX: ``jax-<version>-<12 hex digits>``.

    The digits hash the jax and jaxlib versions, the architecture and ``cpu_flags`` (default:
    this CPU's, from ``/proc/cpuinfo``), which JAX's own cache key leaves out.

    Example:
      >>> a, b = machine_fingerprint("avx2 fma sse4_2"), machine_fingerprint("avx2 avx512f fma sse4_2")
      >>> a.startswith("jax-") and a != b and a == machine_fingerprint("sse4_2 fma avx2")
      True
    """
    import jaxlib

    flags = " ".join(sorted((_cpu_flags() if cpu_flags is None else cpu_flags).split()))
    key = "\n".join([jax.__version__, getattr(jaxlib, "__version__", "?"), platform.machine(), flags])
    return f"jax-{jax.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def default_cache_dir() -> Path:
    """The per-user folder: ``$XDG_CACHE_HOME`` or the platform's cache folder, then ``leanstep/``.

    ``~/.cache/leanstep/<fingerprint>`` on Linux, ``~/Library/Caches/leanstep/...`` on macOS,
    ``%LOCALAPPDATA%\\leanstep\\...`` on Windows; :func:`machine_fingerprint` names the last part.
    """
    if os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"])
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    else:
        base = Path.home() / ".cache"
    return base / "leanstep" / machine_fingerprint()


@dataclasses.dataclass(frozen=True)
class CacheState:
    """What :func:`enable_compile_cache` did: ``directory`` in use (None: off) and why not, if off."""

    directory: Path | None
    reason: str | None = None

    @property
    def enabled(self) -> bool:
        return self.directory is not None


def _jax_option(name: str) -> Any:
    config: Any = jax.config  # its options are attributes added at run time
    return getattr(config, name)


def cache_directory() -> str | None:
    """The folder of JAX's persistent compilation cache for this process's next compiles, or None."""
    if not _jax_option("jax_enable_compilation_cache"):
        return None
    return _jax_option("jax_compilation_cache_dir") or None


def _writable(directory: Path) -> str | None:
    """Why ``directory`` cannot hold the cache (made if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".leanstep-probe-"):
            pass
    except OSError as error:
        return f"{error.strerror or error}" + (f": {error.filename!r}" if error.filename else "")
    return None


def enable_compile_cache(
    directory: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    warn: Any = None,
) -> CacheState:
    """Turns on JAX's persistent compilation cache in ``directory`` for every later compile.

    Args:
      directory: the folder (made if missing); None: ``$LEANSTEP_COMPILE_CACHE`` if it names
        a folder, none at all if it says ``off`` (:data:`OFF_VALUES`), else JAX's own
        ``jax_compilation_cache_dir`` if set (``$JAX_COMPILATION_CACHE_DIR``), else
        :func:`default_cache_dir`.
      max_bytes: the folder's bound; the least recently used entries are removed past it.
      warn: ``warn(line)`` for each warning line (once for each kind of failure); None: Python's
        ``warnings.warn``.

    Returns:
      The :class:`CacheState`: the folder, or None with the reason it could not be used.

    Every program is written, however fast it compiled or small it is, so that a second run
    compiles nothing; an unreadable entry is removed when it is met, and rewritten.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive number of bytes, got {max_bytes!r}")
    say = warn if warn is not None else (lambda line: warnings.warn(line, stacklevel=3))
    if directory is None:
        named = os.environ.get(ENV, "").strip()
        if named.lower() in OFF_VALUES:
            return CacheState(None, f"{ENV}={named}")
        directory = Path(named) if named else Path(_jax_option("jax_compilation_cache_dir") or default_cache_dir())
    path = Path(directory).expanduser().absolute()
    problem = _writable(path)
    if problem is not None:
        say(f"warning: the compilation cache folder {str(path)!r} cannot be written ({problem}); compiling without it")
        return CacheState(None, problem)
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.set_cache_dir(str(path))
    compilation_cache.reset_cache()  # else a process that compiled before never opens it (jax#21908)
    _report_entry_errors(path, say)
    _install(AtomicFileCache(path, max_bytes=max_bytes, on_problem=_ERRORS.entry))
    return CacheState(path)


def _install(cache: AtomicFileCache) -> None:
    """Makes ``cache`` the one JAX reads and writes (JAX has no public hook for a cache of one's
    own; without these internals, JAX's own file cache keeps the folder, unbounded)."""
    from jax._src import compilation_cache as internals

    lock = getattr(internals, "_cache_initialized_mutex", None)
    if lock is None or not hasattr(internals, "_cache") or not hasattr(internals, "_cache_initialized"):
        return
    with lock:
        internals._cache = cache  # type: ignore[assignment]  # JAX's CacheInterface, duck-typed
        internals._cache_initialized = True


def disable_compile_cache() -> None:
    """No persistent compilation cache for the later compiles of this process, however set."""
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()


class _EntryErrors:
    """Turns JAX's warnings about unreadable or unwritable entries into one line each, and removes
    an unreadable entry so that the program is written again."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.say: Any = None
        self.said: set[str] = set()
        self.installed = False
        self._previous: Any = None  # the warnings.showwarning this one replaced

    def show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = str(message)
        if self.directory is None or not (text.startswith("Error ") and "persistent compilation cache" in text):
            self._previous(message, category, filename, lineno, file, line)
            return
        reading = text.startswith("Error reading")
        removed = _remove_unreadable(self.directory, text) if reading else 0
        self._tell("read" if reading else "written", text.split("': ", 1)[-1], removed)

    def entry(self, detail: str, removed: bool) -> None:
        """What :class:`AtomicFileCache` found wrong with an entry it was asked for (a miss)."""
        self._tell("read", detail, int(removed))

    def _tell(self, kind: str, detail: str, removed: int) -> None:
        if kind in self.said or self.say is None:
            return
        self.said.add(kind)
        done = f"; removed {removed} unreadable entr{'y' if removed == 1 else 'ies'}" if removed else ""
        self.say(
            f"warning: the compilation cache in {str(self.directory)!r} could not be {kind} ({detail}); "
            f"compiled without it{done}"
        )


_ERRORS = _EntryErrors()


def _report_entry_errors(directory: Path, say: Any) -> None:
    _ERRORS.directory, _ERRORS.say = directory, say
    # Shown (here, once as a line of ours), never raised: a cache is never worth a failed run.
    warnings.filterwarnings("always", message=_JAX_CACHE_ERROR, category=UserWarning)
    if not _ERRORS.installed:
        _ERRORS._previous = warnings.showwarning
        warnings.showwarning = _ERRORS.show
        _ERRORS.installed = True


def _remove_unreadable(directory: Path, text: str) -> int:
    """Removes the entries of the module named in JAX's read warning that do not decompress."""
    from jax._src import compilation_cache as jax_cache  # decompression as JAX writes it

    module = text.partition(" for '")[2].partition("'")[0]
    removed = 0
    for entry in directory.glob(f"{module}-*-cache") if module else ():
        try:
            jax_cache.decompress_executable(entry.read_bytes())
        except Exception:  # noqa: BLE001 - any failure to decompress means the entry is damaged
            entry.unlink(missing_ok=True)
            removed += 1
    return removed
