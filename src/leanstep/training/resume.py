"""Where a run goes on from: its newest intact checkpoint, and the rollback decisions around it.

``--resume`` restores the newest checkpoint that belongs to the run's config (a damaged one is
passed over, with a note), then follows ``rollbacks.json`` (:mod:`leanstep.training.rollback`),
once it has checked that the file holds every decision the checkpoint and ``metrics.jsonl`` record: a
rollback decided after that checkpoint was saved is finished (its checkpoint restored, its lines
in ``metrics.jsonl`` moved), and the skips and the updates' factor of the decisions so far carry
on. ``metrics.jsonl`` is cut back to the step the run goes on from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from leanstep.checkpoints.checkpointer import Checkpointer, CheckpointError
from leanstep.common.files import read_regular_file
from leanstep.step.state import TrainState
from leanstep.training.actions import roll_back_to
from leanstep.training.config import RunConfig, config_hashes
from leanstep.training.legacy_state import restore_state
from leanstep.training.loop_state import RunStopped
from leanstep.training.metrics_log import truncate_metrics
from leanstep.training.rollback import (
    ROLLBACKS_FILE,
    Rollback,
    check_decisions_kept,
    logged_rollbacks,
    pending_rollback,
    read_rollbacks,
    record_rollback_lines,
)

__all__ = ["Resumed", "restore_checkpoint", "resume_run"]


class Resumed(NamedTuple):
    """Where the run goes on from (a new run: its initial state, and nothing decided)."""

    state: TrainState
    elapsed_before: float
    rollbacks: tuple[Rollback, ...] = ()
    spike_steps: tuple[int, ...] = ()
    lr_factor: float = 1.0


def resume_run(
    checkpointer: Checkpointer,
    template: TrainState,
    config: RunConfig,
    notes: list[str],
    *,
    steps: int,
    resume: bool,
    primary: bool,
) -> Resumed:
    """The state a run starts from: ``template``, or with ``resume`` its newest checkpoint (see the module doc);
    ``steps``: the run's planned steps (``--steps``, or ``--time-budget``'s), which a checkpoint may not pass.
    The caller sets the schedule's length (:func:`~leanstep.training.schedule.set_total_steps`) on the state.

    Raises:
      RunStopped: no checkpoint can be restored, or ``metrics.jsonl`` cannot be rewritten.
      ValueError: the checkpoint belongs to another config, or is past ``--steps``; ``rollbacks.json``
        is damaged, or lost a decision that the checkpoint or ``metrics.jsonl`` records
        (:func:`~leanstep.training.rollback.check_decisions_kept`).
    """
    if not resume:
        return Resumed(template, 0.0)
    out = Path(config.out)
    state, elapsed_before, extra = template, 0.0, dict[str, Any]()
    try:
        rollbacks = tuple(read_rollbacks(out))
    except ValueError as error:
        raise ValueError(f"--resume: {error}") from None
    if checkpointer.latest_step() is not None:
        state, elapsed_before, extra = restore_checkpoint(checkpointer, template, config, notes, steps)
    saved = int(extra.get("rollbacks", 0))
    # Before anything is changed: a decision lost from rollbacks.json is refused, never trained past.
    logged = logged_rollbacks(out / "metrics.jsonl")
    check_decisions_kept(out / ROLLBACKS_FILE, rollbacks, saved=saved, step=int(state.step), logged=logged)
    pending = pending_rollback(rollbacks, saved)
    if pending is not None:  # stopped inside a rollback: finish it
        state = roll_back_to(checkpointer, state, pending, steps)
        notes.append(f"finishing the rollback to step {pending.to_step} that was under way at step {pending.at_step}")
    if primary:
        try:
            if pending is not None:
                record_rollback_lines(out / "metrics.jsonl", pending)
            truncate_metrics(out / "metrics.jsonl", int(state.step))
        except OSError as error:
            raise RunStopped(f"cannot write the run directory --out {str(out)!r}: {error}", 1) from None
    lowered = bool(rollbacks) and int(state.step) < rollbacks[-1].lr_until
    return Resumed(
        state,
        elapsed_before,
        rollbacks,
        () if pending is not None else tuple(extra.get("spike_steps", ())),
        rollbacks[-1].lr_factor if lowered else 1.0,  # the state's update_scale holds it too
    )


def restore_checkpoint(
    checkpointer: Checkpointer, template: TrainState, config: RunConfig, notes: list[str], steps: int
) -> tuple[TrainState, float, dict[str, Any]]:
    """The newest intact checkpoint that belongs to this config, its time and ``extra``; notes say what was passed over."""
    # A checkpoint of 0.11 or before holds the hash of the setting strings as they were written
    # then: config.json has them (still the saved run's: it is rewritten once the run resumed).
    mine = config_hashes(config, saved_fields(Path(config.out) / "config.json"))
    try:
        restored = restore_state(checkpointer, template)  # 0.5's checkpoints too
    except CheckpointError as error:
        raise RunStopped(
            f"--resume: no checkpoint of the run can be restored, so it cannot continue: {error}. "
            f"Start again with a new --out (or move {checkpointer.directory} away)",
            1,
        ) from None
    notes.extend(f"warning: skipped damaged checkpoint {reason}" for reason in restored.skipped)
    if restored.skipped:
        notes.append(f"warning: resuming from step {restored.step}, the newest intact checkpoint")
    if restored.extra.get("config_sha256", mine[0]) not in mine:
        raise ValueError(
            f"--resume: checkpoint step {restored.step} in {checkpointer.directory} was written by "
            "a different config than this one"
        )
    if restored.step > steps:
        raise ValueError(
            f"--steps {steps} is below step {restored.step}, which the run has reached; "
            f"pass --steps {restored.step} or more"
        )
    checkpointer.delete_newer_than(restored.step)
    return restored.state, float(restored.extra.get("elapsed_s", 0.0)), restored.extra


def saved_fields(config_path: Path) -> dict[str, Any] | None:
    """The run's fields in ``config.json`` (None: none readable; :func:`~leanstep.training.run_dir.check_run` has
    refused a missing or damaged one, and that the fields mean this config's, before a resume gets here)."""
    try:
        saved = json.loads(read_regular_file(config_path, what=str(config_path), limit=64 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    run = saved.get("run", saved) if isinstance(saved, dict) else None
    return run if isinstance(run, dict) else None
