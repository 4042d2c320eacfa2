"""Faults of the compilation cache's entries (issue 41, item 13): an entry copied over another,
one damaged in a way that still decompresses, a FIFO and a folder in an entry's place. Each is a
miss with one warning line naming the cache; a wrong or damaged entry is removed and written
again; none hangs or stops the run.

The reference for the exchanged entries is the same programs compiled without a cache."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from leanstep.compilation.atomic_file_cache import AtomicFileCache


class _Told(list):
    def __call__(self, detail: str, removed: bool) -> None:
        self.append((detail, removed))


def _cache(path: Path) -> tuple[AtomicFileCache, _Told]:
    told = _Told()
    return AtomicFileCache(path, on_problem=told), told


def test_an_entry_copied_over_another_is_a_miss_removed_and_written_again(tmp_path):
    cache, told = _cache(tmp_path)
    cache.put("step", b"the step's program")
    cache.put("init", b"the initial state's program")
    step, init = tmp_path / "step-cache", tmp_path / "init-cache"
    step_bytes, init_bytes = step.read_bytes(), init.read_bytes()
    step.write_bytes(init_bytes)  # exchanged
    init.write_bytes(step_bytes)
    assert cache.get("step") is None and cache.get("init") is None
    assert not step.exists() and not init.exists()
    assert told == [(f"{name}-cache is damaged or holds another program", True) for name in ("step", "init")]
    cache.put("step", b"the step's program")
    assert cache.get("step") == b"the step's program"


def test_an_entry_damaged_in_its_middle_is_a_miss_and_removed(tmp_path):
    cache, told = _cache(tmp_path)
    cache.put("k", bytes(range(256)) * 8)
    entry = tmp_path / "k-cache"
    data = bytearray(entry.read_bytes())
    data[1000] ^= 0x01  # one bit: a compressed stream may still decompress
    entry.write_bytes(bytes(data))
    assert cache.get("k") is None and not entry.exists()
    assert told == [("k-cache is damaged or holds another program", True)]


def test_an_entry_of_another_format_is_a_miss(tmp_path):
    cache, told = _cache(tmp_path)
    (tmp_path / "k-cache").write_bytes(b"JAX's own bytes, no header")
    assert cache.get("k") is None
    assert told == [("k-cache is not in this format", True)]


def test_a_fifo_in_an_entrys_place_does_not_block(tmp_path):
    cache, told = _cache(tmp_path)
    os.mkfifo(tmp_path / "k-cache")
    result: list = []
    reader = threading.Thread(target=lambda: result.append(cache.get("k")), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive(), "get() blocked on a FIFO"
    assert result == [None]
    [(detail, removed)] = told
    assert detail.endswith("k-cache is a FIFO, not an entry; remove it") and not removed
    cache.put("k", b"program")  # left alone: not ours to remove
    assert (tmp_path / "k-cache").is_fifo()


def test_a_folder_in_an_entrys_place_is_a_miss_not_an_error(tmp_path):
    cache, told = _cache(tmp_path)
    (tmp_path / "k-cache").mkdir()
    assert cache.get("k") is None
    cache.put("k", b"program")
    [(detail, removed)] = told
    assert detail.endswith("k-cache is a folder, not an entry; remove it") and not removed


_PROGRAMS = """
import sys, warnings
warnings.simplefilter("error")  # any warning but ours would fail the run
import jax, jax.numpy as jnp
lines = []
from leanstep.compilation.cache import enable_compile_cache
if sys.argv[1] != "off":
    enable_compile_cache(sys.argv[1], warn=lines.append)
def first(x):
    return jnp.sin(x) * 2.0
def second(x):
    return jnp.cos(x) + 1.0
x, y = jnp.asarray(jnp.arange(37.0)), jnp.asarray(jnp.arange(30.0))
a, b = jax.jit(first)(x), jax.jit(second)(y)
print(repr((float(a.sum()), float(b.sum()), a.shape, b.shape)))
print("\\n".join(lines))
"""


def _run_programs(cache: Path | str, cwd: Path) -> list[str]:
    env = {**os.environ, "LEANSTEP_COMPILE_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAMS, str(cache)], capture_output=True, text=True, env=env, timeout=300, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()


def test_two_exchanged_programs_are_compiled_again_with_one_warning(tmp_path):
    """0.11: the two entries exchanged, every later run ended in a raw AssertionError (37, 30)."""
    cache = tmp_path / "cache"
    reference = _run_programs("off", tmp_path)[0]  # no cache: the programs compiled
    assert _run_programs(cache, tmp_path) == [reference]
    entries = [*cache.glob("jit_first-*-cache"), *cache.glob("jit_second-*-cache")]
    assert len(entries) == 2
    first, second = (entry.read_bytes() for entry in entries)
    entries[0].write_bytes(second)
    entries[1].write_bytes(first)
    result, *warning = _run_programs(cache, tmp_path)
    assert result == reference
    [line] = warning
    assert line.startswith(f"warning: the compilation cache in {str(cache)!r} could not be read (")
    assert line.endswith("; compiled without it; removed 1 unreadable entry")
    assert _run_programs(cache, tmp_path) == [reference]  # written again: no warning
