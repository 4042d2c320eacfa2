"""Strict test setup shared by every test module and doctest, and one compilation cache for the run.

The suite's processes (pytest's own, its xdist workers, every ``leanstep`` command a test
launches, and worker scripts that call :func:`leanstep.enable_compile_cache`) share one
persistent compilation cache folder, made fresh for the run and removed after it, so that a step
compiled once is loaded, not compiled, by every later test and process that builds the same
program. ``LEANSTEP_COMPILE_CACHE=DIR`` keeps the
cache in ``DIR`` instead (kept between runs: a second run compiles almost nothing).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax

from leanstep.compile_cache import ENV, OFF_VALUES, enable_compile_cache

_OWNED = "LEANSTEP_TEST_CACHE_OWNER"  # set in the environment by the process that made the folder
_NAMED = os.environ.get(ENV, "").strip()
if not _NAMED:  # inherited by every process the suite starts: the CLI reads it
    os.environ[ENV] = _NAMED = tempfile.mkdtemp(prefix="leanstep-test-compile-cache-")
    os.environ[_OWNED] = str(os.getpid())
if _NAMED.lower() not in OFF_VALUES:  # LEANSTEP_COMPILE_CACHE=off: the suite runs without one
    enable_compile_cache(_NAMED)

# Implicit rank promotion hides shape bugs; tests must spell broadcasting out.
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_unconfigure(config):
    del config
    if os.environ.get(_OWNED) == str(os.getpid()):
        shutil.rmtree(os.environ[ENV], ignore_errors=True)
