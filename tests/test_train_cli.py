"""``leanstep train`` end to end on a tiny model: artifacts, learning, exact resume, early errors.

The finished run the tests inspect is the suite's shared ``tiny_run`` (tests/conftest.py: trained
once per pytest process, a copy for each test), not one trained here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers.workers import child_env
from leanstep import TrainState
from leanstep.checkpoints import Checkpointer
from leanstep.models import build_model
from leanstep.training import RunConfig, build_optimizer


def _final_params(run: Path, steps: int):
    config = RunConfig(size="tiny", batch_size=8, seq_len=16, lr=1e-2, warmup_steps=5, steps=steps)
    model = build_model("transformer", "tiny", seq_len=16)
    optimizer, _ = build_optimizer(config)
    template = TrainState.create(model.init(jax.random.key(0)), optimizer, loss_scale="dynamic")
    with Checkpointer(run / "checkpoints") as checkpointer:
        restored = checkpointer.restore(template)
    return restored.step, restored.state


def _losses(run: Path) -> list[float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["kind"] == "train"]


def test_run_writes_every_artifact_and_learns(tiny_run):
    for name in ("metrics.jsonl", "config.json", "curves.png", "summary.json"):
        assert (tiny_run / name).is_file(), name
    assert (tiny_run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert np.mean([r["loss"] for r in train[-5:]]) < np.mean([r["loss"] for r in train[:5]]) - 0.3
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    config = json.loads((tiny_run / "config.json").read_text())
    assert config["run"]["microbatches"] == 2 and config["corpus"]["heldout_files"]
    steps = sorted(int(p.name) for p in (tiny_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 20, 30]


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, cli, tiny_flags, tiny_corpus, tiny_run):
    out = tmp_path / "resumed"
    argv = ("train", *tiny_flags, "--data", tiny_corpus, "--out", out, "--steps", "30")
    assert cli(*argv, "--stop-at", "13").code == 0
    assert cli(*argv, "--resume").code == 0
    step_a, state_a = _final_params(tiny_run, 30)
    step_b, state_b = _final_params(out, 30)
    assert step_a == step_b == 30
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lines_a = (tiny_run / "metrics.jsonl").read_text().splitlines()
    lines_b = (out / "metrics.jsonl").read_text().splitlines()
    strip = lambda lines: [
        {k: v for k, v in json.loads(l).items() if k not in ("tokens_per_sec", "elapsed_s")} for l in lines
    ]
    assert strip(lines_a) == strip(lines_b)


def test_report_rerenders_chart_and_summary(tiny_run, cli):
    (tiny_run / "curves.png").unlink()
    result = cli("report", tiny_run)
    assert result.code == 0
    assert (tiny_run / "curves.png").is_file()
    assert "held-out" in result.out


def test_no_chart_writes_every_number_but_the_chart_and_report_draws_it_later(tmp_path, cli, tiny_flags, tiny_corpus):
    assert "--no-chart" in tiny_flags  # the runs beside the tiny run draw none; the tiny run itself does
    out = tmp_path / "run"
    result = cli("train", *tiny_flags, "--data", tiny_corpus, "--out", out, "--steps", "2")
    assert result.code == 0 and result.err.splitlines()[-1] == f"run directory: {out}  (chart: none, --no-chart)"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["curves"] is None and summary["ended_s"] >= summary["total_time_s"] > 0
    assert not (out / "curves.png").exists() and json.loads((out / "config.json").read_text())["run"]["chart"] is False
    assert cli("report", out).code == 0 and (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_saved_without_the_chart_field_resumes_with_either_setting(tiny_run, cli, tiny_flags, tiny_corpus):
    path = tiny_run / "config.json"
    saved = json.loads(path.read_text())
    del saved["run"]["chart"]  # as 0.11 wrote it
    path.write_text(json.dumps(saved))
    (tiny_run / "curves.png").unlink()
    argv = ("train", *tiny_flags, "--data", tiny_corpus, "--out", tiny_run, "--resume")
    assert cli(*argv, "--steps", "31").code == 0 and not (tiny_run / "curves.png").exists()  # --no-chart
    resumed = cli(*[a for a in argv if a != "--no-chart"], "--steps", "32")
    assert resumed.code == 0 and (tiny_run / "curves.png").is_file(), resumed.err[-2000:]
    assert [r["step"] for r in map(json.loads, (tiny_run / "metrics.jsonl").read_text().splitlines())][-1] == 32


def test_a_run_without_its_chart_never_loads_matplotlib(tmp_path, tiny_flags, tiny_corpus):
    # A fresh interpreter: matplotlib's import is about half a second of a tiny run's two.
    argv = ["train", *tiny_flags, "--data", str(tiny_corpus), "--out", str(tmp_path / "run"), "--steps", "2"]
    script = f"import sys; from leanstep.cli.main import main; print(main({argv!r}), 'matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "0 False", done.stderr[-2000:]


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
def test_bad_flags_exit_2_with_one_line_before_training(tmp_path, cli, tiny_flags, tiny_corpus, args, message):
    out = tmp_path / "run"
    result = cli("train", *tiny_flags, "--data", tiny_corpus, "--out", out, "--steps", "5", *args)
    assert result.code == 2
    assert result.err.count("\n") == 1 and message in result.err
    assert not (out / "metrics.jsonl").exists()


def test_empty_data_and_resume_mismatch(tmp_path, cli, tiny_flags, tiny_corpus, tiny_run):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = cli("train", *tiny_flags, "--data", empty, "--out", tmp_path / "a")
    assert result.code == 2 and "is empty" in result.err
    # A run directory that belongs to a different config.
    again = ("train", *tiny_flags, "--data", tiny_corpus, "--out", tiny_run, "--steps", "30")
    result = cli(*again, "--resume", "--seed", "1")
    assert result.code == 2 and "belongs to a different config: --seed 0 (now 1)" in result.err
    # An existing run is never overwritten without --resume.
    result = cli(*again)
    assert result.code == 2 and "already holds a run" in result.err


def test_budget_picks_a_setting_or_says_nothing_fits(tmp_path, cli, tiny_flags, tiny_corpus):
    # The MLP with 2 rows: few candidates to compile (the planner itself is tested in test_planning.py).
    argv = ["train", *tiny_flags, "--model", "mlp", "--batch-size", "2", "--microbatches", "1"]
    argv += ["--data", str(tiny_corpus), "--steps", "2", "--eval-every", "2"]
    result = cli(*argv, "--out", tmp_path / "small", "--budget", "1KiB")
    assert result.code == 2
    assert result.err.count("\n") == 1 and "--budget: no setting fits the budget of 1.0 KiB" in result.err
    result = cli(*argv, "--out", tmp_path / "ok", "--budget", "64MiB")
    assert result.code == 0 and "--budget 64MiB: chose --microbatches" in result.err


@pytest.mark.slow  # 8 simulated devices: a child process, whose devices are set before JAX starts
def test_mesh_of_three_axes_trains_like_one_device(tmp_path, tiny_flags, tiny_corpus, tiny_run):
    """``--mesh data=2,fsdp=2,tensor=2`` on 8 simulated devices (a fresh process): the same losses."""
    import subprocess
    import sys

    out = tmp_path / "mesh"
    env = child_env()
    argv = ["train", *tiny_flags, "--data", str(tiny_corpus), "--out", str(out), "--steps", "30"]
    proc = subprocess.run(
        [sys.executable, "-m", "leanstep.cli.main", *argv, "--mesh", "data=2,fsdp=2,tensor=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "config.json").read_text())["devices"] == 8
    np.testing.assert_allclose(_losses(out), _losses(tiny_run), rtol=2e-3)
