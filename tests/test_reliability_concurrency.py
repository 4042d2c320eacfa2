"""Two writers on one run directory, signals during a save, a full disk, a backend that is not there.

References: an uninterrupted run of the same config (its final checkpoint and ``metrics.jsonl``,
bit for bit) for every trial; the kernel's ``flock`` and real processes for the lock; the process's
own file-size limit (RLIMIT_FSIZE: writes fail with EFBIG, as on a full disk) for failed saves.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from helpers.workers import child_env
from leanstep.checkpoints.layout import committed_steps, unfinished_saves
from leanstep.training import RunConfig, train
from leanstep.training.run_lock import LOCK_NAME, RunDirectoryInUse, RunLock

WORKER = Path(__file__).parent / "helpers" / "concurrency_worker.py"
TRIALS = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        (root / name).write_bytes((stdlib / name).read_bytes())
    return root


def _env() -> dict[str, str]:
    return child_env()  # the suite's compilation cache included (conftest.py)


@pytest.fixture(scope="module")
def trials(tmp_path_factory, corpus) -> dict[str, list[dict]]:
    """Both kinds of trials, each in its own worker process, side by side (mostly Python, not XLA)."""
    root = tmp_path_factory.mktemp("trials")
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(TRIALS), str(seed), str(root), str(corpus)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode, seed in (("writers", 16), ("signals", 17))
    }
    results = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-6000:]
        assert "Traceback" not in stderr, stderr[-6000:]
        results[mode] = json.loads(stdout.splitlines()[-1])
    return results


@pytest.mark.slow  # a 10-trial campaign
def test_two_writers_at_random_offsets_never_mix_and_always_resume_bit_identical(trials):
    results = trials["writers"]
    assert len(results) == TRIALS
    allowed = {"finished", "stopped(0)", "in use", "in use, holder unnamed", "holds a run", "no run"}
    for result in results:
        assert set(result["outcomes"]) <= allowed, result
        assert result["consistent"] and result["identical"], result
        # At most one writer of a new run: the other is refused, or resumes what the first left.
        assert result["outcomes"].count("stopped(0)") + result["outcomes"].count("finished") >= 1, result
    # The lock, not luck: most trials overlapped, and the second writer was refused naming the holder.
    assert sum("in use" in r["outcomes"] for r in results) >= TRIALS // 4, results


@pytest.mark.slow  # a 10-trial campaign
def test_double_and_triple_signals_during_a_save_commit_it_then_stop(trials):
    results = trials["signals"]
    assert len(results) == TRIALS
    assert {len(r["signals"]) for r in results} == {2, 3}
    assert {s for r in results for s in r["signals"]} == {"SIGTERM", "SIGINT"}
    for result in results:
        # The save the signals hit is committed, with its manifest, and the run stops right after it,
        # naming the signal handled first (CPython runs pending handlers in signal-number order).
        assert any(
            result["outcome"].startswith(
                f"stopped({128 + sig}) {sig.name} received: stopped at step "
                f"{result['at_save']} after saving a checkpoint"
            )
            for sig in map(signal.Signals.__getitem__, result["signals"])
        ), result
        # Then the signal that stopped it, and only that one, reaches the handler the caller had.
        assert len(result["delivered"]) == 1 and result["outcome"].startswith(
            f"stopped({128 + signal.Signals[result['delivered'][0]]}) {result['delivered'][0]} received"
        ), result
        assert result["committed"][-1] == result["at_save"], result
        assert result["consistent"] and result["identical"], result


def test_a_second_process_is_refused_at_once_naming_the_holder_and_a_dead_holders_lock_is_taken_over(
    tmp_path, corpus, cli
):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from leanstep.training.run_lock import RunLock
        RunLock({str(out)!r}).acquire()
        print("locked", flush=True)
        time.sleep(600)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        # The refused run in this process: the lock's holder is the other process, which is the point.
        refused = cli("train", "--model", "mlp", "--size", "tiny", "--steps", "2", "--data", corpus, "--out", out)
        assert refused.code == 2 and refused.out == ""
        assert refused.err.count("\n") == 1, refused.err
        assert (
            f"--out {str(out)!r} is in use by another leanstep train (pid {holder.pid} on host "
            f"{socket.gethostname()}, since "
        ) in refused.err
        assert time.monotonic() - started < 60  # at once: no data loaded, nothing compiled first
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # and nothing written
        with pytest.raises(RunDirectoryInUse, match=f"pid {holder.pid} on host"):
            RunLock(out).acquire()
    finally:
        holder.kill()  # SIGKILL: the holder never releases it itself
        holder.wait()
        holder.stdout.close()
    notes = []
    config = RunConfig(
        model="mlp",
        size="tiny",
        batch_size=4,
        seq_len=8,
        steps=2,
        eval_batches=1,
        progress=False,
        chart=False,
        data=str(corpus),
        out=str(out),
    )
    train(config, on_record=lambda *records: notes.extend(r.message for r in records if hasattr(r, "message")))
    assert any(f"took over the run directory's lock from pid {holder.pid} on host" in n for n in notes), notes
    assert (out / LOCK_NAME).read_text() == ""  # released cleanly: the next run has nothing to take over
    assert committed_steps(out / "checkpoints") == [2]


def test_a_save_that_fails_for_lack_of_space_stops_in_one_line_and_leaves_no_half_step(tmp_path, corpus):
    # Real failed writes: the file-size limit makes every write past 20 kB fail with EFBIG, in
    # orbax's and tensorstore's own threads, as a full disk does (the stderr pipe has no limit).
    script = textwrap.dedent("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        from leanstep.cli.main import main
        sys.exit(main(sys.argv[1:]))
        """)
    out = tmp_path / "full"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "train",
            "--model",
            "mlp",
            "--size",
            "small",
            "--batch-size",
            "4",
            "--seq-len",
            "8",
            "--steps",
            "2",
            "--no-progress",
            "--no-chart",
            "--data",
            str(corpus),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 1
    # The same full disk may refuse a compilation cache entry (unless the suite's cache has it): one line.
    every = proc.stderr.strip().splitlines()
    cache = [line for line in every if line.startswith("leanstep train: warning: the compilation cache in")]
    lines = [line for line in every if line not in cache]
    assert len(cache) <= 1 and all("File too large" in line for line in cache), proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert lines[0].startswith("leanstep train: stopped at step 2: its checkpoint could not be written")
    assert "File too large" in lines[0] and "no checkpoint was written yet" in lines[0]
    # No step without its manifest, nothing half-written left behind.
    assert committed_steps(out / "checkpoints") == [] and unfinished_saves(out / "checkpoints") == []


@pytest.mark.parametrize("platform", ["bogus", "cuda"])
def test_a_jax_platforms_that_names_a_missing_backend_is_one_line(tmp_path, platform):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "leanstep.cli.main",
            "train",
            "--model",
            "mlp",
            "--size",
            "tiny",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": platform},
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"leanstep train: error: JAX_PLATFORMS={platform!r}: JAX cannot start a backend")
