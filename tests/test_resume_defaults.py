"""``leanstep train --resume`` of a run made with 0.11's defaults (issue 57, item 10): the flags
whose defaults changed in 0.12 (64 windows of 32 bytes, 16 evaluation batches, AdamW) take the
run's own values, said on one line, and the run goes on as the run never stopped, bit for bit; a
flag given that conflicts is refused as before.

The run directory is written as 0.11 wrote it: 0.11's defaults (given as flags here), its
checkpoints' config hash by 0.11's formula (``config_hash(as_written=True)``), and ``config.json``
without what 0.11 did not write (``step``, ``run.optimizer``, ``run.chart``): a directory written
by 0.11 itself (c864286, the 0.11.0 release) holds the same keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import leanstep.training.run_steps
from leanstep.checkpoints import Checkpointer
from leanstep.cli.main import main
from leanstep.training import RunConfig, build_run
from leanstep.training.config import config_hash
from leanstep.training.run_dir import with_saved_defaults

STEPS = 3
FLAGS = ["train", "--model", "mlp", "--size", "tiny", "--steps", str(STEPS), "--eval-every", "2"]
FLAGS += ["--checkpoint-every", "1", "--no-progress", "--no-chart"]
#: 0.11's defaults of the flags whose defaults changed in 0.12.
OLD = ["--batch-size", "64", "--seq-len", "32", "--eval-batches", "16", "--optimizer", "adamw"]
NOTE = (
    "leanstep train: --resume: took the run's own --batch-size 64, --seq-len 32, --eval-batches 16, "
    "--optimizer adamw, whose defaults have changed since it started (now 32, 128, 8, muon)"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (root / "a.txt").write_bytes(bytes(rng.choice(list(b"abcdefgh      "), size=20_000).tolist()))
    return root


def _argv(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [*FLAGS, "--data", str(corpus), "--out", str(out), *extra]


@pytest.fixture
def run_0_11(corpus, tmp_path, monkeypatch) -> Path:
    """A run stopped at step 1 as 0.11 left it, made with 0.11's defaults."""
    out = tmp_path / "run"
    monkeypatch.setattr(leanstep.training.run_steps, "config_hash", lambda c: config_hash(c, as_written=True))
    assert main(_argv(corpus, out, *OLD, "--stop-at", "1")) == 0
    monkeypatch.undo()
    saved = json.loads((out / "config.json").read_text())
    del saved["step"], saved["run"]["optimizer"], saved["run"]["chart"]
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return out


def _ended(out: Path) -> tuple[list[bytes], list[dict]]:
    """The last checkpoint's every leaf, and ``metrics.jsonl`` less its timings."""
    config = RunConfig(model="mlp", size="tiny", batch_size=64, seq_len=32, optimizer="adamw", steps=STEPS)
    with Checkpointer(out / "checkpoints") as checkpointer:
        restored = checkpointer.restore(build_run(config).init_state(), step=STEPS)
    leaves = [np.asarray(x).tobytes() for x in jax.tree.leaves(restored.state)]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return leaves, [{k: v for k, v in line.items() if k not in ("tokens_per_sec", "elapsed_s")} for line in lines]


def test_a_run_with_0_11s_defaults_resumes_from_its_own_command_as_if_never_stopped(run_0_11, corpus, tmp_path, capsys):
    capsys.readouterr()
    assert main(_argv(corpus, run_0_11, "--resume")) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leanstep train: --resume:")]
    assert said == [NOTE]
    whole = tmp_path / "whole"
    assert main(_argv(corpus, whole, *OLD)) == 0
    assert _ended(run_0_11) == _ended(whole)


def test_a_flag_given_that_conflicts_is_refused_and_one_that_matches_is_kept(run_0_11, corpus, capsys):
    capsys.readouterr()
    assert main(_argv(corpus, run_0_11, "--resume", "--eval-batches", "8")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "took the run's own" not in err, err
    assert err.startswith("leanstep train: error: --resume: ")
    assert "belongs to a different config: --eval-batches 16 (now 8); give the run's own values" in err
    assert main(_argv(corpus, run_0_11, "--resume", "--optimizer", "adamw", "--stop-at", "2")) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leanstep train: --resume:")]
    assert said == [NOTE.replace(", --optimizer adamw", "").replace(", muon)", ")")]


def test_only_a_flag_not_given_whose_saved_value_is_the_old_default_is_taken(tmp_path):
    from leanstep.training.machine_size import choose_for_machine

    made = RunConfig(out=str(tmp_path), batch_size=16, seq_len=32, optimizer="adamw")
    run = choose_for_machine(made).config.to_json()  # as saved: its size and precision resolved
    del run["optimizer"]  # as 0.11 wrote it: AdamW
    (tmp_path / "config.json").write_text(json.dumps({"run": run}))
    now = RunConfig(out=str(tmp_path), batch_size=16)  # --batch-size 16 given: 16 is not 0.11's default
    resumed, note = with_saved_defaults(now, given={"batch_size"})
    assert (resumed.batch_size, resumed.seq_len, resumed.eval_batches, resumed.optimizer) == (16, 32, 8, "adamw")
    assert note == (
        "--resume: took the run's own --seq-len 32, --optimizer adamw, whose defaults have changed "
        "since it started (now 128, muon)"
    )
    # --seq-len given at today's default: it conflicts, and nothing is said (the refusal names it).
    resumed, note = with_saved_defaults(now, given={"batch_size", "seq_len"})
    assert note is None and choose_for_machine(resumed).config.mismatches(run) == ["seq_len"]
    # Not a run of this directory's: nothing is taken.
    assert with_saved_defaults(RunConfig(out=str(tmp_path / "none")), given=set()) == (
        RunConfig(out=str(tmp_path / "none")),
        None,
    )


def test_on_an_accelerator_a_run_made_before_its_sizing_resumes_as_made(tmp_path, monkeypatch):
    """0.11 had no sizing for the device: its run, resumed with no flag on a TPU, takes its own
    batch and window and is not sized (which would change its model, batch and data)."""
    from types import SimpleNamespace

    from leanstep.cli.main import build_parser
    from leanstep.cli.resume_defaults import with_run_defaults
    from leanstep.cli.train import _config_from
    from leanstep.training.auto_precision import BFLOAT16
    from leanstep.training.machine_size import choose_for_machine

    made = RunConfig(
        out=str(tmp_path),
        size="mini",
        precision=BFLOAT16,
        batch_size=64,
        seq_len=32,
        eval_batches=16,
        optimizer="adamw",
    )  # as saved: its size and precision resolved
    run = made.to_json()
    del run["optimizer"], run["chart"]
    (tmp_path / "config.json").write_text(json.dumps({"run": run}))
    tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": 16 << 30})
    monkeypatch.setattr(jax, "devices", lambda *a: [tpu])
    printed: list[str] = []
    console = SimpleNamespace(print=lambda text, **_: printed.append(str(text)))

    def resumed(*flags: str) -> RunConfig:
        args = build_parser().parse_args(["train", "--out", str(tmp_path), *flags])
        return choose_for_machine(with_run_defaults(_config_from(args), args, console)).config

    assert resumed("--resume") == made and printed == [NOTE]
    assert resumed().d_model == 384  # a new run is sized
