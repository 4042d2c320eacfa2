"""JAX's persistent compilation cache as the command line sets it up: it hits, it misses when it
must, it changes no bit of a run, and a folder or entry that cannot be used costs one warning line.

References: JAX's own monitoring events (a compile that the cache answered is counted by JAX as a
cache hit), JAX's cache-miss explanations (``JAX_EXPLAIN_CACHE_MISSES``), and an uncached run of
the same flags, bit for bit. Every run here is a real ``leanstep train`` process with a cache
folder of its own (not the suite's shared one).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers.tiny_runs import QUIET, TINY_MLP
from leanstep.checkpoints import Checkpointer
from leanstep.compilation.cache import ENV, machine_fingerprint
from leanstep.training import RunConfig
from leanstep.training.build import build_run

STEPS = 4
FLAGS = [*TINY_MLP, "--steps", str(STEPS), "--eval-every", "2", "--eval-batches", "1"]
FLAGS += ["--checkpoint-every", "2", *QUIET]
CONFIG = RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, steps=STEPS)
TIMING = ("tokens_per_sec", "elapsed_s")
#: JAX's own cache settings, which the suite sets for its processes: these runs set their own.
_SUITE_CACHE = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    "JAX_COMPILATION_CACHE_MAX_SIZE",
    ENV,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "shlex.py"):
        (root / name).write_bytes((stdlib / name).read_bytes())
    return root


def _env(cache: Path | str | None, *, xla_defaults: bool = False, **extra: str) -> dict[str, str]:
    """The suite's environment less its cache settings (and, ``xla_defaults``, less the suite's
    compile-for-speed XLA flags, conftest.py: a run whose compile time is the point)."""
    env = {k: v for k, v in os.environ.items() if k not in _SUITE_CACHE and not (xla_defaults and k == "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    if cache is not None:
        env[ENV] = str(cache)
    return env


def _train(out: Path, corpus: Path, env: dict[str, str], *extra: str, prefix: tuple[str, ...] = ()):
    command = [*prefix, sys.executable, "-m", "leanstep.cli.main", "train", *FLAGS, "--data", str(corpus)]
    proc = subprocess.run(
        [*command, "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


def _compile(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["compile_cache"]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning" in line.lower()]


def _bits(out: Path) -> tuple[list[bytes], list[dict]]:
    """The final checkpoint's every leaf and ``metrics.jsonl`` less its timings."""
    with Checkpointer(out / "checkpoints") as checkpointer:
        restored = checkpointer.restore(build_run(CONFIG).init_state(), step=STEPS)
    leaves = [np.asarray(x).tobytes() for x in jax.tree.leaves(restored.state)]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return leaves, [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    """The same flags three ways: cache off by the flag, cold, warm."""
    root = tmp_path_factory.mktemp("cached-runs")
    cache = root / "cache"
    outs = {name: root / name for name in ("flag_off", "cold", "warm")}
    # --no-compile-cache wins over a JAX_COMPILATION_CACHE_DIR of the user's own.
    flag_env = _env(None, JAX_COMPILATION_CACHE_DIR=str(root / "jax-own"))
    assert _train(outs["flag_off"], corpus, flag_env, "--no-compile-cache").returncode == 0
    for name in ("cold", "warm"):
        proc = _train(outs[name], corpus, _env(cache))
        assert proc.returncode == 0 and not _warnings(proc.stderr), proc.stderr
    assert not (root / "jax-own").exists()
    return {**outs, "cache": cache}


@pytest.mark.slow  # three CLI runs in fresh processes (cache off, cold, warm): the processes are the point
def test_a_second_run_loads_its_step_from_the_cache_and_a_first_one_compiles_it(runs):
    cold, warm = _compile(runs["cold"]), _compile(runs["warm"])
    assert cold["directory"] == warm["directory"] == str(runs["cache"])
    assert cold["step"]["cache"] == "miss" and cold["step"]["from_cache"] == 0
    assert warm["step"]["cache"] == "hit" and warm["step"]["from_cache"] == warm["step"]["programs"] >= 1
    assert any(path.name.startswith("jit_step-") for path in runs["cache"].iterdir())


@pytest.mark.slow  # three CLI runs in fresh processes (cache off, cold, warm): the processes are the point
def test_the_flag_turns_it_off_even_where_jax_is_given_a_folder(runs):
    assert _compile(runs["flag_off"]) == {
        "directory": None,
        "step": {**_compile(runs["flag_off"])["step"], "cache": "off"},
    }


@pytest.mark.parametrize("value", ["off", "0", "false", "no", "None"])
def test_the_environment_turns_it_off(monkeypatch, value):
    from leanstep.compilation.cache import enable_compile_cache

    monkeypatch.setenv(ENV, value)
    state = enable_compile_cache()  # what the CLI calls; nothing is changed
    assert not state.enabled and state.reason == f"{ENV}={value}"


@pytest.mark.slow  # three CLI runs in fresh processes (cache off, cold, warm): the processes are the point
def test_cached_uncached_cold_and_warm_runs_are_bit_identical(runs):
    reference = _bits(runs["flag_off"])
    assert len(reference[1]) > STEPS  # train and eval records
    for name in ("cold", "warm"):
        assert _bits(runs[name]) == reference, name


@pytest.mark.slow  # two CLI runs with their own cold cache
def test_a_resumed_run_compiles_nothing_new(tmp_path, corpus):
    cache, out = tmp_path / "cache", tmp_path / "run"
    first = _train(out, corpus, _env(cache, JAX_EXPLAIN_CACHE_MISSES="1"), "--stop-at", "2")
    assert first.returncode == 0, first.stderr
    # The step compiled ahead of its first call is the one the loop runs: one compile, not two.
    assert first.stderr.count("PERSISTENT COMPILATION CACHE MISS for 'jit_step'") == 1, first.stderr
    # JAX's own account: every compile the persistent cache could not answer is logged as a miss.
    resumed = _train(out, corpus, _env(cache, JAX_EXPLAIN_CACHE_MISSES="1"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    misses = [line for line in resumed.stderr.splitlines() if "PERSISTENT COMPILATION CACHE MISS" in line]
    assert misses == [], "\n".join(misses)
    assert _compile(out)["step"]["cache"] == "hit"


_PROGRAM = textwrap.dedent("""
    import json, sys
    {pad}
    import jax, jax.numpy as jnp
    from leanstep.compilation.cache import enable_compile_cache
    from leanstep.compilation.count import CompileCount
    enable_compile_cache(sys.argv[1])
    with CompileCount() as count:
        jax.jit(lambda x: jnp.tanh(x) @ x.T * {factor})(jnp.ones((8, 8))).block_until_ready()
    print(json.dumps(count.to_json()))
""")


def _program(cache: Path, factor: float = 2.0, pad: int = 0, **env: str) -> str:
    script = _PROGRAM.format(factor=factor, pad="\n" * pad)  # pad: the same program on other lines
    proc = subprocess.run(
        [sys.executable, "-c", script, str(cache)], env=_env(None, **env), capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["cache"]


@pytest.mark.slow  # four fresh JAX processes
def test_what_keys_an_entry_misses_and_what_does_not_hits(tmp_path):
    cache = tmp_path / "cache"
    assert _program(cache) == "miss"
    assert _program(cache, pad=7) == "hit"  # source lines are not part of the key
    assert _program(cache, factor=3.0) == "miss"  # another program
    assert _program(cache, XLA_FLAGS="--xla_cpu_enable_fast_math=true") == "miss"  # other XLA flags


def test_the_default_folder_is_one_per_cpu_architecture_and_jax_version(monkeypatch, tmp_path):
    import jaxlib

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from leanstep.compilation.cache import default_cache_dir

    here = default_cache_dir()
    assert here.parent == tmp_path / "leanstep" and here.name == machine_fingerprint()
    flags = "fpu sse2 avx avx2 fma"
    base = machine_fingerprint(flags)
    assert machine_fingerprint(flags + " avx512f") != base  # XLA:CPU compiles for the CPU's features
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert machine_fingerprint(flags) != base
    monkeypatch.undo()
    monkeypatch.setattr(jaxlib, "__version__", "0.0.1")
    assert machine_fingerprint(flags) != base


@pytest.mark.slow  # failure trials of the cache: a CLI run each
def test_a_folder_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path, corpus):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc = _train(tmp_path / "run", corpus, _env(blocker / "cache"))
    assert proc.returncode == 0, proc.stderr
    [line] = _warnings(proc.stderr)
    assert line.startswith("leanstep train: warning: the compilation cache folder") and "cannot be written" in line
    assert _compile(tmp_path / "run")["directory"] is None
    assert _compile(tmp_path / "run")["step"]["cache"] == "off"


@pytest.mark.slow  # failure trials of the cache: a CLI run each
def test_an_unreadable_entry_is_one_warning_then_removed_and_written_again(tmp_path, corpus, runs):
    # A cache of its own, not a copy of the module's: JAX keys entries by the folder's path too
    # (compile options name its XLA autotuning cache inside it), so a moved folder only misses.
    cache = tmp_path / "cache"
    assert _train(tmp_path / "first", corpus, _env(cache)).returncode == 0
    [entry] = cache.glob("jit_step-*-cache")
    entry.write_bytes(entry.read_bytes()[:100])  # a write cut short by a kill
    proc = _train(tmp_path / "second", corpus, _env(cache))
    assert proc.returncode == 0, proc.stderr
    [line] = _warnings(proc.stderr)
    assert "could not be read" in line and "removed 1 unreadable entry" in line, line
    assert _compile(tmp_path / "second")["step"]["cache"] == "miss"
    third = _train(tmp_path / "third", corpus, _env(cache))
    assert not _warnings(third.stderr) and _compile(tmp_path / "third")["step"]["cache"] == "hit"
    assert _bits(tmp_path / "second") == _bits(tmp_path / "third") == _bits(runs["warm"])


def _can_mount_a_tmpfs(where: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.slow  # failure trials of the cache: a CLI run each
def test_a_full_cache_disk_is_one_warning_and_the_run_goes_on(tmp_path, corpus):
    cache = tmp_path / "cache"
    cache.mkdir()
    if not _can_mount_a_tmpfs(cache):
        pytest.skip("needs unshare -m and mount (root) for a 48 KiB filesystem")
    # The cache on a filesystem of its own, too small for the step's entry; the run directory elsewhere.
    mount = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=48k tmpfs {cache} && exec "$@"', "sh"]
    proc = _train(tmp_path / "run", corpus, _env(cache), prefix=tuple(mount))
    assert proc.returncode == 0, proc.stderr
    [line] = _warnings(proc.stderr)
    assert "could not be written" in line and "No space left on device" in line, line
    assert _bits(tmp_path / "run")[1]  # the run wrote its records and its last checkpoint


def _tiny_run(out: Path, corpus: Path, cache: Path, *length: str) -> float:
    """The seconds a ``leanstep train --size tiny`` process took, at XLA's default flags (the
    compile a cache saves, as a user's run pays it) with the cache folder ``cache``."""
    command = [sys.executable, "-m", "leanstep.cli.main", "train", "--size", "tiny", *length, "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.run(
        [*command, "--no-chart", "--data", str(corpus), "--out", str(out)],
        env=_env(cache, xla_defaults=True),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return time.perf_counter() - start


@pytest.mark.slow  # a probe and two budgeted runs: the cost is the point
def test_a_second_budgeted_run_plans_sooner_and_takes_more_steps(tmp_path, corpus):
    # The budget is sized to this machine, now, not fixed: a fixed 16 s left no step at load 4.5
    # (14.8 s went to loading and compiling). A 2-step run of the same model with a cold cache of
    # its own takes its start-up, loading, compiling and finish, all of which the budget's run
    # pays but the start-up (2 s and more): 8 s more leaves the cold run time for steps even if
    # the machine slows meanwhile, while its loading and compiling stay a large part of the
    # budget, so the warm run's saving shows in its steps more than any change in step time.
    # At load 13 on two cores (four busy loops beside the suite): a 127 s probe, a 136 s budget,
    # planned at 102 and 17 s, 152 and 568 steps (of 301 and 185 ms).
    probe_s = _tiny_run(tmp_path / "probe", corpus, tmp_path / "probe-cache", "--steps", "2")
    budget_s = max(16, math.ceil(probe_s + 8))
    cache, outs = tmp_path / "cache", [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        _tiny_run(out, corpus, cache, "--time-budget", f"{budget_s}s")
    first, second = (json.loads((out / "config.json").read_text()) for out in outs)
    assert (first["compile_cache"]["step"]["cache"], second["compile_cache"]["step"]["cache"]) == ("miss", "hit")
    plans = [config["time_budget_plan"] for config in (first, second)]
    assert plans[0]["budget_s"] == plans[1]["budget_s"] == budget_s
    assert plans[1]["compile_s"] < plans[0]["compile_s"] and plans[1]["planned_at_s"] < plans[0]["planned_at_s"]
    assert second["run"]["steps"] > first["run"]["steps"], (probe_s, plans)
