"""``leanstep train`` end to end on a tiny model: artifacts, learning, exact resume, early errors."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from leanstep import Checkpointer, TrainState
from leanstep.cli.main import main
from leanstep.models import build_model
from leanstep.training import RunConfig, build_optimizer

TINY = [
    "--size",
    "tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "16",
    "--microbatches",
    "2",
    "--eval-every",
    "10",
    "--eval-batches",
    "2",
    "--checkpoint-every",
    "10",
    "--no-progress",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "5",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small folder of real text: a few standard-library modules."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
        (root / name).write_bytes((stdlib / name).read_bytes())
    return root


def _train(tmp: Path, corpus: Path, *extra: str) -> int:
    return main(["train", *TINY, "--data", str(corpus), "--out", str(tmp), *extra])


def _final_params(run: Path, steps: int):
    config = RunConfig(size="tiny", batch_size=8, seq_len=16, lr=1e-2, warmup_steps=5, steps=steps)
    model = build_model("transformer", "tiny", seq_len=16)
    optimizer, _ = build_optimizer(config)
    template = TrainState.create(model.init(jax.random.key(0)), optimizer, loss_scale="dynamic")
    with Checkpointer(run / "checkpoints") as checkpointer:
        restored = checkpointer.restore(template)
    return restored.step, restored.state


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("runs") / "straight"
    assert _train(out, corpus, "--steps", "30") == 0
    return out


def test_run_writes_every_artifact_and_learns(straight_run):
    for name in ("metrics.jsonl", "config.json", "curves.png", "summary.json"):
        assert (straight_run / name).is_file(), name
    assert (straight_run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (straight_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert np.mean([r["loss"] for r in train[-5:]]) < np.mean([r["loss"] for r in train[:5]]) - 0.3
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    config = json.loads((straight_run / "config.json").read_text())
    assert config["run"]["microbatches"] == 2 and config["corpus"]["heldout_files"]
    steps = sorted(int(p.name) for p in (straight_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 20, 30]


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, corpus, straight_run):
    out = tmp_path / "resumed"
    assert _train(out, corpus, "--steps", "30", "--stop-at", "13") == 0
    assert _train(out, corpus, "--steps", "30", "--resume") == 0
    step_a, state_a = _final_params(straight_run, 30)
    step_b, state_b = _final_params(out, 30)
    assert step_a == step_b == 30
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lines_a = (straight_run / "metrics.jsonl").read_text().splitlines()
    lines_b = (out / "metrics.jsonl").read_text().splitlines()
    strip = lambda lines: [
        {k: v for k, v in json.loads(l).items() if k not in ("tokens_per_sec", "elapsed_s")} for l in lines
    ]
    assert strip(lines_a) == strip(lines_b)


def test_report_rerenders_chart_and_summary(straight_run, capsys):
    (straight_run / "curves.png").unlink()
    assert main(["report", str(straight_run)]) == 0
    assert (straight_run / "curves.png").is_file()
    assert "held-out" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "/no/such/path"], "--data path '/no/such/path' does not exist"),
        (["--remat", "dot"], "--remat: unknown policy='dot'"),
        (["--microbatches", "3"], "--batch-size 8 is not divisible by --microbatches 3"),
        (["--precision", "compute=bf17"], "--precision"),
        (["--lr", "-1"], "--lr must be a positive finite number"),
        (["--steps", "0"], "--steps must be an integer >= 1"),
        (["--mesh", "data=2,pipe=2"], "--mesh must be name=size pairs of the axes data, fsdp, tensor"),
        (["--mesh", "auto", "--budget", "1GiB"], "--mesh auto plans a mesh over --devices N devices per process"),
    ],
)
def test_bad_flags_exit_2_with_one_line_before_training(tmp_path, corpus, capsys, args, message):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(corpus), "--out", str(out), "--steps", "5", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (out / "metrics.jsonl").exists()


def test_empty_data_and_resume_mismatch(tmp_path, corpus, capsys, straight_run):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", *TINY, "--data", str(empty), "--out", str(tmp_path / "a")]) == 2
    assert "is empty" in capsys.readouterr().err
    # A run directory that belongs to a different config.
    assert (
        main(
            [
                "train",
                *TINY,
                "--data",
                str(corpus),
                "--out",
                str(straight_run),
                "--steps",
                "30",
                "--resume",
                "--seed",
                "1",
            ]
        )
        == 2
    )
    assert "belongs to a different config: seed=0 (now 1)" in capsys.readouterr().err
    # An existing run is never overwritten without --resume.
    assert main(["train", *TINY, "--data", str(corpus), "--out", str(straight_run), "--steps", "30"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_budget_picks_a_setting_or_says_nothing_fits(tmp_path, corpus, capsys):
    # The MLP with 2 rows: few candidates to compile (the planner itself is tested in test_planning.py).
    argv = [
        "train",
        *TINY,
        "--model",
        "mlp",
        "--batch-size",
        "2",
        "--microbatches",
        "1",
        "--data",
        str(corpus),
        "--steps",
        "2",
        "--eval-every",
        "2",
    ]
    assert main([*argv, "--out", str(tmp_path / "small"), "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget: no setting fits the budget of 1.0 KiB" in err
    assert main([*argv, "--out", str(tmp_path / "ok"), "--budget", "64MiB"]) == 0
    assert "--budget 64MiB: chose --microbatches" in capsys.readouterr().err


@pytest.mark.slow  # 8 simulated devices in a child process
def test_mesh_of_three_axes_trains_like_one_device(tmp_path, corpus, straight_run):
    """``--mesh data=2,fsdp=2,tensor=2`` on 8 simulated devices (a fresh process): the same losses."""
    import os
    import subprocess
    import sys

    out = tmp_path / "mesh"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "leanstep.cli.main",
            "train",
            *TINY,
            "--data",
            str(corpus),
            "--out",
            str(out),
            "--steps",
            "30",
            "--mesh",
            "data=2,fsdp=2,tensor=2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    def losses(run: Path) -> list[float]:
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in lines if r["kind"] == "train"]

    assert json.loads((out / "config.json").read_text())["devices"] == 8
    np.testing.assert_allclose(losses(out), losses(straight_run), rtol=2e-3)
