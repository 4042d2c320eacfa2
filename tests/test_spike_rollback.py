"""--spike-rollback: a burst of spikes rolls the run back past it, skipping its batches exactly.

The positions a run takes are checked against a plain-Python enumeration of the positions not
skipped; in a real run (a burst of corrupted batches injected at known data positions) the
decision, the batches taken after it, the files and the learning rate are checked, and a run
stopped after the rollback, or inside it, resumes bit-identical to one that was not.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import leanstep.training.actions
from helpers.tiny_runs import QUIET, TINY_MLP
from leanstep.checkpoints.checkpointer import Checkpointer
from leanstep.cli.main import main
from leanstep.training import RunConfig, build_run, train
from leanstep.training.data import BatchSampler
from leanstep.training.records import Note, TrainRecord
from leanstep.training.rollback import (
    ROLLBACKS_FILE,
    ROLLED_BACK_FILE,
    Rollback,
    SpikeRollback,
    data_position,
    merge_skips,
    read_rollbacks,
)

# --- data positions -----------------------------------------------------------------------------


def _positions_not_skipped(count: int, skipped: set[int]) -> list[int]:
    """The first ``count`` positions not in ``skipped``, by enumeration."""
    out, position = [], 0
    while len(out) < count:
        if position not in skipped:
            out.append(position)
        position += 1
    return out


@pytest.mark.parametrize("seed", range(20))
def test_data_positions_are_the_positions_not_skipped_in_order(seed):
    rng = random.Random(seed)
    skips: tuple[tuple[int, int], ...] = ()
    skipped: set[int] = set()
    for _ in range(rng.randint(1, 6)):  # overlapping, adjacent and nested windows too
        first = rng.randint(0, 60)
        last = first + rng.randint(0, 12)
        skips = merge_skips(skips, (first, last))
        skipped |= set(range(first, last + 1))
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(skips)), skips  # sorted, disjoint, not adjacent
    assert {p for first, last in skips for p in range(first, last + 1)} == skipped
    assert [data_position(i, skips) for i in range(100)] == _positions_not_skipped(100, skipped)


def test_rollback_settings_round_trip_through_their_string():
    for policy in (SpikeRollback(), SpikeRollback(after=2, within=20, lr_factor=0.25, lr_steps=0, max_rollbacks=1)):
        assert SpikeRollback.from_string(policy.to_string()) == policy


def test_rollback_settings_are_parsed_and_refused_by_name():
    assert SpikeRollback.from_string("none") is None
    assert SpikeRollback.from_string("after=2,within=20,lr=0.25,for=0,max=1,ahead=7") == SpikeRollback(
        2, 20, 0.25, 0, 1, 7
    )
    for spec, match in [
        ("after=0", "after must be an int >= 1"),
        ("lr=1.5", r"lr_factor must be a number in \(0, 1\]"),
        ("lr=0", r"lr_factor must be a number in \(0, 1\]"),
        ("for=-1", "lr_steps must be an int >= 0"),
        ("ahead=-2", "ahead must be an int >= 0"),
        ("every=3", "unknown or repeated spike-rollback setting 'every=3'"),
        ("after=2,after=3", "unknown or repeated"),
        ("within=x", "'within=x' is not a number"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpikeRollback.from_string(spec)


def test_the_cli_refuses_a_rollback_without_the_guard(tmp_path, capsys):
    assert main(["train", "--spike-rollback", "on", "--out", str(tmp_path / "r"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--spike-rollback on rolls back past the spikes the guard skips: pass --spike-guard on" in err
    assert main(["train", "--spike-guard", "on", "--spike-rollback", "after=0", "--out", str(tmp_path / "r")]) == 2
    assert "--spike-rollback: SpikeRollback.after must be an int >= 1" in capsys.readouterr().err


# --- a run with a burst ---------------------------------------------------------------------------

STEPS = 40
BURST = range(23, 27)  # data positions of the corrupted batches: the batches of steps 24-27
GUARD = "k=6,window=8,warmup=8,watch=loss"
ROLLBACK = "after=2,within=10,lr=0.5,for=6,ahead=0"
FLAGS = [  # AdamW, as the bursts below were tuned with (0.12's default trains Muon)
    "--optimizer",
    "adamw",
    *TINY_MLP,
    "--precision",
    "float32",
    "--remat",
    "none",
    "--schedule",
    "constant",
    "--lr",
    "1e-2",
    "--eval-every",
    "1000",
    "--eval-batches",
    "1",
    *QUIET,
    "--checkpoint-every",
    "5",
    "--keep-checkpoints",
    "3",
    "--steps",
    str(STEPS),
    "--spike-guard",
    GUARD,
    "--spike-rollback",
    ROLLBACK,
]
CONFIG = RunConfig(
    optimizer="adamw",
    model="mlp",
    size="tiny",
    batch_size=4,
    seq_len=8,
    precision="float32",
    remat="none",
    schedule="constant",
    lr=1e-2,
    steps=STEPS,
    eval_every=1000,
    eval_batches=1,
    progress=False,
    chart=False,
    checkpoint_every=5,
    keep_checkpoints=3,
    spike_guard=GUARD,
    spike_rollback=ROLLBACK,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)  # text-like bytes: lowercase letters and spaces
    (root / "a.txt").write_bytes(bytes(rng.choice(list(b"abcdefgh      "), size=20_000).tolist()))
    return root


def _install_burst(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Corrupts the batches at the data positions of BURST (every token the byte 255); returns the
    positions the run's steps take (the first, 0, is the compile's)."""
    real = BatchSampler.batch_at
    taken: list[int] = []

    def batch_at(self: BatchSampler, position: int) -> dict[str, np.ndarray]:
        batch = real(self, position)
        if self.batch_size == CONFIG.batch_size and position >= 0:
            taken.append(position)
        if position in BURST:
            return {"tokens": np.full_like(batch["tokens"], 255)}
        return batch

    monkeypatch.setattr(BatchSampler, "batch_at", batch_at)
    return taken


@pytest.fixture()
def burst(monkeypatch) -> list[int]:
    return _install_burst(monkeypatch)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _final_state(run: Path) -> list[np.ndarray]:
    with Checkpointer(run / "checkpoints") as checkpointer:
        restored = checkpointer.restore(build_run(CONFIG).init_state(), step=STEPS)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored.state)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> dict[str, Any]:
    """One uninterrupted run with the burst: what the other tests compare against."""
    run = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as patch:
        taken = _install_burst(patch)
        code = main(["train", *FLAGS, "--data", str(corpus), "--out", str(run)])
    assert code == 0
    assert taken[0] == 0  # the compile's batch
    return {"run": run, "taken": taken[1:], "state": _final_state(run)}


def test_a_burst_rolls_the_run_back_and_its_batches_never_come_again(straight):
    run, taken = straight["run"], straight["taken"]
    decisions = read_rollbacks(run)
    # Four corrupted batches, two spikes a burst: the first rollback skips the batches of its
    # spikes, the run meets the other two and rolls back again; together they skip the burst.
    assert len(decisions) == 2
    skipped: set[int] = set()
    for decision in decisions:
        spikes = decision.spikes
        assert len(spikes) == 2 and spikes[-1] - spikes[0] < 10
        assert all(24 <= step <= 27 for step in spikes)  # spikes only where the corrupted batches were
        assert decision.to_step == 20  # the newest checkpoint before the burst (every 5 steps)
        assert decision.lr_factor == 0.5 and decision.lr_until == decision.to_step + 6
        skipped |= set(range(decision.skip[0], decision.skip[1] + 1))
    assert skipped == set(BURST)
    # The batches taken: each segment from where the run went on, over the positions not skipped then.
    expected, skips, start = [], (), 0
    for decision in decisions:
        expected += [data_position(i, skips) for i in range(start, decision.at_step)]
        skips, start = merge_skips(skips, decision.skip), decision.to_step
    expected += [data_position(i, skips) for i in range(start, STEPS)]
    assert taken == expected
    last = decisions[-1]  # after it: the positions not in the burst, by enumeration
    assert taken[-(STEPS - last.to_step) :] == _positions_not_skipped(STEPS, skipped)[last.to_step :]
    # metrics.jsonl is the run as it went on: steps 1..40 once each, and the rollbacks' lines.
    lines = _lines(run / "metrics.jsonl")
    assert [line["step"] for line in lines if line["kind"] == "train"] == list(range(1, STEPS + 1))
    assert [line for line in lines if line["kind"] == "rollback"] == [d.line() for d in decisions]
    abandoned = _lines(run / ROLLED_BACK_FILE)
    assert [line["step"] for line in abandoned] == [
        step for d in decisions for step in range(d.to_step + 1, d.at_step + 1)
    ]
    assert sum(line["spiked"] for line in abandoned) == 4
    # The updates were halved from to_step + 1 through lr_until, then whole again.
    lr = {line["step"]: line["lr"] for line in lines if line["kind"] == "train"}
    low = range(last.to_step + 1, last.lr_until + 1)
    assert all(lr[s] == pytest.approx(5e-3) for s in low) and lr[last.lr_until + 1] == pytest.approx(1e-2)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["spike_skipped_steps"] == 0  # the run as it went on has none: they were rolled back


def test_skipping_ahead_takes_the_rest_of_the_burst_in_one_rollback(tmp_path, corpus, burst):
    run = tmp_path / "run"
    flags = [f if f != ROLLBACK else ROLLBACK.replace("ahead=0", "ahead=3") for f in FLAGS]
    assert main(["train", *flags, "--data", str(corpus), "--out", str(run)]) == 0
    (decision,) = read_rollbacks(run)
    assert decision.skip == (decision.spikes[0] - 1, decision.spikes[-1] - 1 + 3)
    after = burst[1 + decision.at_step :]  # the positions taken once it rolled back
    assert not set(after) & set(BURST) and set(range(decision.skip[0], decision.skip[1] + 1)) >= set(BURST)


def test_a_run_without_rollback_applies_the_burst(tmp_path, corpus, burst):
    """The control: the guard alone skips the spikes; its batches are all taken, in order."""
    run = tmp_path / "run"
    flags = [f for f in FLAGS if f not in ("--spike-rollback", ROLLBACK)]
    assert main(["train", *flags, "--data", str(corpus), "--out", str(run)]) == 0
    assert burst[1:] == list(range(STEPS)) and not (run / ROLLBACKS_FILE).exists()
    assert sum(line.get("spiked", False) for line in _lines(run / "metrics.jsonl")) >= 2


def test_the_advice_after_too_many_rollbacks_is_a_command_that_works(tmp_path, corpus, burst, capsys):
    """max=1 and a burst that takes two rollbacks: the run stops; the advice says --resume would
    meet the burst again and refuses another --lr (both checked here), and names a new run with a
    larger max, which trains to the end."""
    one = ROLLBACK + ",max=1"
    flags = [f if f != ROLLBACK else one for f in FLAGS]
    run = ["train", *flags, "--data", str(corpus), "--out", str(tmp_path / "run")]
    assert main(run) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "stopped at step" in line]
    stopped = line[line.index("stopped at step") :]
    assert "--resume would meet this burst again, and a resumed run keeps its --lr and --spike-rollback" in stopped
    advised = stopped.rsplit("with --spike-rollback ", 1)[1]
    assert SpikeRollback.from_string(advised) == dataclasses.replace(SpikeRollback.from_string(one), max_rollbacks=2)
    assert main([*run, "--resume"]) == 1  # the same flags: the same burst, the same stop
    assert stopped in capsys.readouterr().err
    assert main([*run, "--resume", "--lr", "5e-3"]) == 2  # a resumed run keeps its --lr
    assert "--lr 0.01 (now 0.005)" in capsys.readouterr().err
    new = [f if f != one else advised for f in flags]
    assert main(["train", *new, "--data", str(corpus), "--out", str(tmp_path / "new")]) == 0
    assert len(read_rollbacks(tmp_path / "new")) == 2
    lines = _lines(tmp_path / "new" / "metrics.jsonl")
    assert [line["step"] for line in lines if line["kind"] == "train"] == list(range(1, STEPS + 1))


def test_a_run_stopped_after_the_rollback_resumes_bit_identical(tmp_path, corpus, straight, burst):
    """Stopped (an exception, no checkpoint of its own) inside the lowered rate, after a checkpoint
    saved since the rollbacks: the resume keeps the skips and the factor."""
    decisions = read_rollbacks(straight["run"])
    stop_at = decisions[-1].lr_until  # the last step of the lowered rate: step lr_until - 1 was saved
    run = tmp_path / "run"
    config = dataclasses.replace(CONFIG, data=str(corpus), out=str(run))
    notes: list[str] = []

    def stop(*records: Any) -> None:
        notes.extend(r.message for r in records if isinstance(r, Note) and "rolled back" in r.message)
        if len(notes) == len(decisions) and any(isinstance(r, TrainRecord) and r.step == stop_at for r in records):
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        train(config, on_record=stop)
    assert read_rollbacks(run) == decisions
    with Checkpointer(run / "checkpoints") as checkpointer:
        assert decisions[-1].to_step < checkpointer.latest_step() < stop_at
    train(config, resume=True)
    for a, b in zip(_final_state(run), straight["state"], strict=True):
        assert a.tobytes() == b.tobytes()
    timing = ("tokens_per_sec", "elapsed_s")
    strip = lambda lines: [{k: v for k, v in line.items() if k not in timing} for line in lines]
    assert strip(_lines(run / "metrics.jsonl")) == strip(_lines(straight["run"] / "metrics.jsonl"))


def test_a_run_stopped_inside_the_rollback_finishes_it_on_resume(tmp_path, corpus, straight, burst, monkeypatch):
    """Killed after the decision was recorded, before the checkpoints were deleted and the state restored."""
    real = leanstep.training.actions.roll_back_to

    def dies(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("killed")  # a kill at this point: rollbacks.json written, nothing else done

    run = tmp_path / "run"
    config = dataclasses.replace(CONFIG, data=str(corpus), out=str(run))
    monkeypatch.setattr(leanstep.training.actions, "roll_back_to", dies)
    with pytest.raises(RuntimeError, match="killed"):
        train(config)
    (decision,) = read_rollbacks(run)  # the first: recorded, then the kill
    with Checkpointer(run / "checkpoints") as checkpointer:  # saved before the decision: it knows none
        restored = checkpointer.restore(build_run(CONFIG).init_state())
    assert restored.step == decision.to_step and restored.extra["rollbacks"] == 0
    assert float(restored.state.spike.update_scale) == 1.0
    monkeypatch.setattr(leanstep.training.actions, "roll_back_to", real)
    train(config, resume=True)
    assert read_rollbacks(run) == read_rollbacks(straight["run"])
    for a, b in zip(_final_state(run), straight["state"], strict=True):
        assert a.tobytes() == b.tobytes()


def test_a_rollback_record_round_trips():
    rollback = Rollback(40, 30, (35, 38, 40), (34, 39), 0.5, 130)
    assert Rollback.from_json(json.loads(json.dumps(rollback.to_json()))) == rollback
    assert rollback.line()["kind"] == "rollback" and rollback.line()["step"] == 30
