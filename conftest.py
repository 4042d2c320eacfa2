"""Strict test setup shared by every test module and doctest, and one compilation cache for the run.

The suite's processes (pytest's own, its xdist workers, every ``leanstep`` command a test
launches, and worker scripts that call :func:`leanstep.compilation.enable_compile_cache`) share one
persistent compilation cache folder, made fresh for the run and removed after it, so that a step
compiled once is loaded, not compiled, by every later test and process that builds the same
program. ``LEANSTEP_COMPILE_CACHE=DIR`` keeps the
cache in ``DIR`` instead (kept between runs: a second run compiles almost nothing).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile

# The suite's cost is compiling (a few step programs a test), not running them, so it compiles
# for speed: LLVM's optimizations off, and XLA:CPU's older loop emitters instead of its fusion
# emitters (a tiny transformer step: 5.0 s at XLA's defaults, 2.5 s with LLVM's optimizations
# off, 1.0 s with the older emitters too; the suite's then 20 verify configurations, 348 -> 181 s). Neither
# changes an op's semantics (fast math stays off, and the bit-exact tests against op-by-op and
# float64 references hold), but the older emitters contract multiply-adds into FMA instructions
# differently in two programs that compute the same sum, which the bit-identity tests between two
# programs (chunked and whole updates, compiled and op-by-op starts, NNX and its optimizer loop)
# would see; so the suite also keeps LLVM from emitting FMA (--xla_cpu_max_isa=AVX), as
# tests/test_chunked_update_meshes.py does for its meshes. The flags are added only where this
# jaxlib knows them: XLA aborts a process on a flag it does not know, and a later jaxlib may drop
# the older emitters (then the suite compiles with its fusion emitters, more slowly).
# And it compiles each program as one LLVM module: XLA:CPU splits a program's module in parts to
# compile on several threads, which on the suite's 2 cores, each busy with a worker, only adds
# the parts' own set-up (three tiny step programs: 3.3-5.6 CPU-s split, 2.8-4.6 whole, medians
# 4.8 and 3.9, six interleaved pairs under load). LEANSTEP_TEST_XLA_DEFAULTS=1 tests with XLA's defaults instead.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_max_isa=AVX"
_ONE_MODULE = "--xla_cpu_parallel_codegen_split_count=1"


def _xla_knows(flags: str) -> bool:
    """Whether a CPU client starts under ``flags`` (XLA aborts on one it does not know): a child Python."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120, check=False).returncode == 0


if not os.environ.get("LEANSTEP_TEST_XLA_DEFAULTS") and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    _flags = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    if _xla_knows(f"{_flags} {_LOOP_EMITTERS} {_ONE_MODULE}"):  # once a run: the workers inherit the flags set here
        _flags = f"{_flags} {_LOOP_EMITTERS} {_ONE_MODULE}"
    os.environ["XLA_FLAGS"] = _flags

# Processes the suite starts with simulated devices through XLA_FLAGS (not configure_devices,
# which sizes the pool itself) get XLA:CPU's pool of four threads a device for up to 8 devices:
# at its default, max(cores, devices), devices blocked in collectives can starve one still
# working (see leanstep.sharding.distributed; a CI run aborted on it).
os.environ.setdefault("PJRT_NPROC", "32")

import jax
import pytest

from leanstep.compilation.cache import ENV, OFF_VALUES, enable_compile_cache

_OWNED = "LEANSTEP_TEST_CACHE_OWNER"  # set in the environment by the process that made the folder
_NAMED = os.environ.get(ENV, "").strip()
if not _NAMED:  # inherited by every process the suite starts: the CLI reads it
    os.environ[ENV] = _NAMED = tempfile.mkdtemp(prefix="leanstep-test-compile-cache-")
    os.environ[_OWNED] = str(os.getpid())
if _NAMED.lower() not in OFF_VALUES:  # LEANSTEP_COMPILE_CACHE=off: the suite runs without one
    enable_compile_cache(_NAMED)

# leanstep writes every program to the cache, however fast it compiled (a second `leanstep train`
# then compiles nothing). The suite's own processes keep out the ones that compile in under 50 ms,
# thousands of eager operations and tiny test programs: a write cost 10 ms (cProfile of
# tests/test_verification.py: 2.6 s for 261 entries), and a hit saves nothing (a whole run, in
# pytest's processes: 1,203 hits saved -1.7 s in all; 3,999 entries written). Set again after each test: an in-process `leanstep` command
# turns it back to 0. The commands a test starts as child processes are not affected.
_SUITE_MIN_COMPILE_SECONDS = 0.05
jax.config.update("jax_persistent_cache_min_compile_time_secs", _SUITE_MIN_COMPILE_SECONDS)


@pytest.fixture(autouse=True)
def _fast_programs_stay_out_of_the_cache():
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _SUITE_MIN_COMPILE_SECONDS)


# Implicit rank promotion hides shape bugs; tests must spell broadcasting out.
jax.config.update("jax_numpy_rank_promotion", "raise")


def _tpu_chips() -> int:
    """TPU chips attached to this host, read from PCI as JAX reads them, without opening one."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return 0
    from jax._src import hardware_utils  # jax 0.10 has no public probe that leaves the chip closed

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


# optionalhook: the hook is pytest-xdist's, and pytest refuses an unknown hook without it (``-p no:xdist``).
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker a core, at most 4 (each holds JAX, and some tests start 8-device children).

    One on a TPU host: one program at a time can hold the chip, so a second worker would fail
    to open it.
    """
    del config
    if _tpu_chips():
        return 1
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _float32_matmuls_where_marked(request):
    """A test marked ``float32_matmuls`` runs its products at float32 precision on a TPU too (tests/helpers/chip.py)."""
    if request.node.get_closest_marker("float32_matmuls") is None:
        yield
        return
    from helpers.chip import float32_matmuls  # tests/helpers/chip.py: pytest puts tests/ on the path

    with float32_matmuls():
        yield


#: The files that take longest, longest first (seconds of the suite's profile on the 2-core Xeon at
#: 16a4542, 2026-12-07: ``LEANSTEP_TEST_DURATIONS=FILE`` then ``python tests/helpers/durations.py FILE``). pytest-xdist hands
#: each worker one file at a time in collection order (``--dist loadfile --no-loadscope-reorder``);
#: by default it orders files by their number of tests, which gave a 133-s file of two tests out
#: last, to one worker while the other stood idle. Longest first, the workers end together. A name
#: that is not a test file fails tests/test_durations.py; a stale order costs time, never a result.
LONGEST_FIRST = (
    "tests/test_tpu_scripts.py",  # 29 then; tpu_check's fit ladder alone 120 s since fc2e7e0 (load 1, 2026-12-07)
    "tests/test_verification_configs.py",  # 59 s
    "tests/test_verification.py",  # 59
    "tests/test_compile_cache.py",  # 57
    "tests/test_chunked_update.py",  # 50
    "tests/test_int8_composition.py",  # 44 (alone, -n 0, at helper-compose; not in the 16a4542 profile)
    "tests/test_run_startup_faults.py",  # 48 (less since: 4 of its trials went)
    "tests/test_offload.py",  # 39
    "tests/test_lean_state_defects.py",  # 35
    "tests/test_reliability_faults.py",  # 32
    "tests/test_chunked_update_meshes.py",  # 31
    "tests/test_reliability_concurrency.py",  # 28
    "tests/test_int8_meshes.py",  # 28 (alone, as test_int8_composition.py)
    "tests/test_fp8_composition.py",  # 22
    "tests/test_time_budget.py",  # 21
    "tests/test_verification_defects.py",  # 20 (less since: 10 padded setups of 20)
    "tests/test_train_cli.py",  # 19
    "tests/test_cluster_planning.py",  # 16
    "tests/test_speedrun.py",  # 16
    "tests/test_fp8_train.py",  # 16
)


def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONGEST_FIRST` first, in its order; the rest as collected (a stable sort)."""
    del config
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_unconfigure(config):
    del config
    if os.environ.get(_OWNED) == str(os.getpid()):
        shutil.rmtree(os.environ[ENV], ignore_errors=True)


_DURATIONS = "LEANSTEP_TEST_DURATIONS"  # a file: each test's seconds appended as it ends (a killed run keeps them)

#: JAX's compile-time events -> the column they are summed in: XLA's backend compile, and tracing
#: with lowering to StableHLO (the Python side). What a test's child processes compile is not seen.
_JAX_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace",
}
_jax_seconds: collections.Counter[str] = collections.Counter()


def _count_jax_seconds(event: str, duration: float, **kwargs) -> None:
    del kwargs
    column = _JAX_EVENTS.get(event)
    if column is not None:
        _jax_seconds[column] += duration


if os.environ.get(_DURATIONS):
    jax.monitoring.register_event_duration_secs_listener(_count_jax_seconds)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``LEANSTEP_TEST_DURATIONS``: the phase's seconds in JAX's compiler and tracer ride on the
    report (``user_properties`` cross from an xdist worker to its controller)."""
    del item, call
    report = yield
    if os.environ.get(_DURATIONS):
        report.user_properties.append(("jax_seconds", (_jax_seconds["compile"], _jax_seconds["trace"])))
        _jax_seconds.clear()
    return report


def pytest_runtest_logreport(report):
    """With ``LEANSTEP_TEST_DURATIONS=FILE``: one line a test phase, ``seconds<TAB>phase<TAB>outcome<TAB>
    compile seconds<TAB>trace seconds<TAB>node id`` (the middle two: this process's XLA compiles, and
    its tracing and lowering), appended where the report arrives (xdist's controller), so a profile
    survives a run that is stopped before pytest's own ``--durations`` table prints.
    ``python tests/helpers/durations.py FILE`` sums it by file."""
    path = os.environ.get(_DURATIONS)
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # the hook runs in the worker and again in the controller
        compiled, traced = dict(getattr(report, "user_properties", ())).get("jax_seconds", (0.0, 0.0))
        with open(path, "a") as f:
            f.write(
                f"{report.duration:.3f}\t{report.when}\t{report.outcome}\t{compiled:.3f}\t{traced:.3f}\t{report.nodeid}\n"
            )
