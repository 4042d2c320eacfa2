"""What a program that calls ``train()`` gets on SIGTERM and SIGINT: its step saved, then the signal's
own effect (the process ends on SIGTERM, KeyboardInterrupt on SIGINT), not a swallowed signal.

Each run is a fresh process (a SIGTERM under the default handler ends it); the reference for
"saved" is the run directory's committed checkpoints and ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from leanstep.checkpoints.layout import committed_steps

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from leanstep.training import RunConfig, RunStopped, train
    from leanstep.training.records import TrainRecord
    mode, out, data = sys.argv[1:]
    sent = []

    def on_record(*records):  # the signal arrives during step 2's records, as one from outside would
        if not sent and any(isinstance(r, TrainRecord) and r.step == 2 for r in records):
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT if mode == "int" else signal.SIGTERM)

    if mode == "handler":  # the caller's own handler, which returns
        signal.signal(signal.SIGTERM, lambda signum, frame: print("handler", signum, flush=True))
    if mode == "int":  # Python's own SIGINT handler (a parent that ignores SIGINT, as an xdist worker may,
        signal.signal(signal.SIGINT, signal.default_int_handler)  # leaves it ignored: then RunStopped)
    config = RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, steps=6, eval_batches=1,
                       eval_every=100, checkpoint_every=100, out=out, data=data)
    try:
        train(config, on_record=on_record)
        print("finished", flush=True)
    except RunStopped as stopped:
        print("RunStopped", stopped.exit_code, stopped.signal, flush=True)
    except KeyboardInterrupt as interrupt:
        context = interrupt.__context__
        print("KeyboardInterrupt", type(context).__name__, getattr(context, "exit_code", None), flush=True)
    print("after train", flush=True)
""")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.py").write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes())
    return root


def _run(mode: str, out: Path, corpus: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(out), str(corpus)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _saved_at_2(out: Path) -> bool:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return committed_steps(out / "checkpoints") == [2] and [r["step"] for r in records if r["kind"] == "train"] == [
        1,
        2,
    ]


@pytest.mark.parametrize("mode", ["default", "handler", "int"])
def test_a_signal_saves_the_step_then_takes_its_own_effect(tmp_path, corpus, mode):
    proc = _run(mode, tmp_path / "run", corpus)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert _saved_at_2(tmp_path / "run")
    if mode == "default":  # SIGTERM's default: the process ends, by the signal, once the step is saved
        assert proc.returncode == -signal.SIGTERM and "after train" not in proc.stdout, proc.stdout
    elif mode == "handler":  # the caller's handler runs once, then train() raises as it did before
        assert proc.returncode == 0
        assert proc.stdout.splitlines()[:2] == [f"handler {int(signal.SIGTERM)}", "RunStopped 143 15"], proc.stdout
    else:  # Python's SIGINT handler: KeyboardInterrupt, whose context names the stop
        assert proc.returncode == 0
        assert proc.stdout.splitlines()[0] == "KeyboardInterrupt RunStopped 130", proc.stdout


@pytest.mark.parametrize(("raised", "code"), [(KeyboardInterrupt, 130), ("Terminated", 143)])
@pytest.mark.parametrize("became", [TypeError, ValueError, RuntimeError])
def test_a_signal_that_comes_back_as_another_exception_is_still_the_stop(monkeypatch, capsys, raised, code, became):
    """A handler's exception raised inside a Python callback that C code called (a JAX type's
    ``__hash__`` while compiling) can reach the command as another exception with the signal's
    as its cause or context: seen in CI as a traceback and exit 1 for a SIGTERM while compiling."""
    from leanstep.cli import main as cli_main
    from leanstep.training.stop_signals import Terminated

    signal_error = Terminated("SIGTERM") if raised == "Terminated" else raised()

    def run(args):
        try:
            raise signal_error
        except BaseException as error:
            raise became("what C code made of it") from error

    monkeypatch.setattr("leanstep.cli.report.run_report", run)  # the command's run, as the parser reads it
    assert cli_main.main(["report", "nowhere"]) == code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"leanstep report: {'interrupted' if code == 130 else 'terminated (SIGTERM)'}"], lines


def test_an_error_with_no_signal_behind_it_keeps_its_traceback(monkeypatch):
    from leanstep.cli import main as cli_main

    def run(args):
        raise TypeError("a bug")

    monkeypatch.setattr("leanstep.cli.report.run_report", run)
    with pytest.raises(TypeError, match="a bug"):
        cli_main.main(["report", "nowhere"])
