"""--resume never loses a recorded rollback decision (issue 41, item 9).

A run with ``--spike-rollback`` makes its decisions once: each checkpoint records how many came
before it, ``rollbacks.json`` holds them, and ``metrics.jsonl`` has a ``"rollback"`` line for each.
A resume whose ``rollbacks.json`` lost some (deleted, emptied, cut short, damaged, edited) either
goes on as the run went (metrics and state bit-identical to the straight run of the same decisions)
or is refused in one line naming the file, with exit code 2, and the run directory left as it was.

The run is tests/test_spike_rollback.py's: a burst of corrupted batches at known data positions,
two rollbacks to step 20, both decided before step 30.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import leanstep.training.actions
from leanstep.checkpoints.checkpointer import Checkpointer
from leanstep.cli.main import main
from leanstep.training import build_run, train
from leanstep.training.data import BatchSampler
from leanstep.training.loop_state import RunStopped
from leanstep.training.rollback import ROLLBACKS_FILE, read_rollbacks
from test_spike_rollback import BURST, CONFIG, FLAGS, STEPS

STOP = 35  # a checkpoint saved after both rollbacks (it counts 2), 5 steps before the end


@pytest.fixture(scope="module")
def patch_burst() -> Any:
    """The corrupted batches of BURST (every token the byte 255), for the whole module."""
    real = BatchSampler.batch_at

    def batch_at(self: BatchSampler, position: int) -> dict[str, np.ndarray]:
        batch = real(self, position)
        return {"tokens": np.full_like(batch["tokens"], 255)} if position in BURST else batch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchSampler, "batch_at", batch_at)
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)  # text-like bytes, as tests/test_spike_rollback.py's
    (root / "a.txt").write_bytes(bytes(rng.choice(list(b"abcdefgh      "), size=20_000).tolist()))
    return root


def _timeless(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in ("tokens_per_sec", "elapsed_s")} for line in lines]


def _final_state(run: Path) -> list[bytes]:
    with Checkpointer(run / "checkpoints") as checkpointer:
        restored = checkpointer.restore(build_run(CONFIG).init_state(), step=STEPS)
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(restored.state)]


def _resume(corpus: Path, run: Path) -> int:
    return main(["train", *FLAGS, "--data", str(corpus), "--out", str(run), "--resume"])


def _digest(run: Path) -> dict[str, str]:
    """Every file of the run directory (but its lock) and a hash of its bytes."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, patch_burst) -> dict[str, Any]:
    """The straight run (the reference), one stopped at step STOP, and one killed inside its second rollback."""
    root = tmp_path_factory.mktemp("runs")
    straight, stopped, inside = root / "straight", root / "stopped", root / "inside"
    assert main(["train", *FLAGS, "--data", str(corpus), "--out", str(straight)]) == 0
    decisions = read_rollbacks(straight)
    assert len(decisions) == 2 and decisions[-1].at_step < STOP
    assert main(["train", *FLAGS, "--data", str(corpus), "--out", str(stopped), "--stop-at", str(STOP)]) == 0
    with Checkpointer(stopped / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == STOP
        assert checkpointer.restore(build_run(CONFIG).init_state()).extra["rollbacks"] == 2
    calls: list[int] = []
    real = leanstep.training.actions.roll_back_to

    def dies_the_second_time(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # rollbacks.json and metrics.jsonl hold the decision; nothing else is done
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    config = dataclasses.replace(CONFIG, data=str(corpus), out=str(inside))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(leanstep.training.actions, "roll_back_to", dies_the_second_time)
        with pytest.raises(RuntimeError, match="killed"):
            train(config)
    assert read_rollbacks(inside) == decisions
    with Checkpointer(inside / "checkpoints") as checkpointer:
        assert checkpointer.restore(build_run(CONFIG).init_state()).extra["rollbacks"] == 0  # step 20's
    return {
        "straight": straight,
        "stopped": stopped,
        "inside": inside,
        "metrics": _timeless(straight / "metrics.jsonl"),
        "state": _final_state(straight),
    }


def _assert_like_straight(run: Path, runs: dict[str, Any]) -> None:
    assert read_rollbacks(run) == read_rollbacks(runs["straight"])
    assert _timeless(run / "metrics.jsonl") == runs["metrics"]
    assert _final_state(run) == runs["state"]


def _first_only(text: str) -> str:
    return json.dumps(json.loads(text)[:1])


def _edited_skip(text: str) -> str:
    decisions = json.loads(text)
    decisions[0]["skip"][1] += 1  # one more batch skipped than the run decided
    return json.dumps(decisions)


# (id, which run, what is done to rollbacks.json (None: deleted), what the refusal says)
DAMAGE = [
    ("deleted", "stopped", None, "is missing, and checkpoint step 35 was saved after 2 rollback decision(s)"),
    ("emptied", "stopped", lambda text: "[]", "holds 0, and checkpoint step 35 was saved after 2 rollback decision(s)"),
    ("truncated", "stopped", _first_only, "holds 1, and checkpoint step 35 was saved after 2 rollback decision(s)"),
    ("cut_short", "stopped", lambda text: text[: len(text) // 2], "is not a list of rollbacks"),
    ("not_json", "stopped", lambda text: "\x00garbage", "is not a list of rollbacks"),
    ("edited", "stopped", _edited_skip, "decision 1 differs from metrics.jsonl's"),
    # Killed inside the second rollback: the newest checkpoint (step 20) counts none, the file holds both.
    ("pending_deleted", "inside", None, "is missing, and metrics.jsonl records 2 rollback decision(s)"),
    ("pending_dropped", "inside", _first_only, "holds 1, and metrics.jsonl records 2 rollback decision(s)"),
]


@pytest.mark.parametrize(("which", "damage", "message"), [pytest.param(*c[1:], id=c[0]) for c in DAMAGE])
def test_a_resume_that_lost_a_decision_is_refused_in_one_line(runs, corpus, tmp_path, capsys, which, damage, message):
    run = tmp_path / "run"
    shutil.copytree(runs[which], run)
    path = run / ROLLBACKS_FILE
    kept = path.read_text()
    if damage is None:
        path.unlink()
    else:
        path.write_text(damage(kept))
    before = _digest(run)
    capsys.readouterr()
    assert _resume(corpus, run) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"--resume: {path}" in err and message in err, err
    assert _digest(run) == before  # refused before anything was changed
    path.write_text(kept)  # the decisions back: the run goes on as it went
    assert _resume(corpus, run) == 0
    _assert_like_straight(run, runs)


@pytest.mark.parametrize("which", ["stopped", "inside"])
def test_a_resume_with_its_decisions_goes_on_as_the_straight_run(runs, corpus, tmp_path, which):
    """The control: the same resumes, the file untouched, equal the straight run bit for bit."""
    run = tmp_path / "run"
    shutil.copytree(runs[which], run)
    assert _resume(corpus, run) == 0
    _assert_like_straight(run, runs)


def test_a_run_whose_checkpoint_was_saved_before_any_rollback_needs_no_file(runs, corpus, tmp_path):
    """Nothing decided before the checkpoint and nothing logged: no file is no decision (and no refusal)."""
    run = tmp_path / "run"
    config = dataclasses.replace(CONFIG, data=str(corpus), out=str(run), stop_at=10)
    with pytest.raises(RunStopped):
        train(config)
    assert not (run / ROLLBACKS_FILE).exists()
    assert _resume(corpus, run) == 0
    _assert_like_straight(run, runs)
