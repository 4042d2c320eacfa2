"""The step loop's periodic actions and stop checks, each alone, and the loop that runs them.

Each action's ``when`` is checked over a range of steps against a plain-Python statement of its
schedule; each ``do`` against what it must leave in the tick or raise. The loop itself runs on a
stand-in step (plain Python numbers, no compile) and a recording checkpointer, and its
``metrics.jsonl`` and checkpoints are checked against the schedule written out by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from leanstep.checkpoints.checkpointer import CheckpointError
from leanstep.training.actions import (
    CommitCheckpoint,
    EndLowerRate,
    Evaluate,
    LogRecords,
    Replan,
    RollBackOnSpikes,
    SaveCheckpoint,
    TimeSteps,
    replan_pending,
)
from leanstep.training.budget import BudgetPlan, replan, replan_step
from leanstep.training.config import RunConfig
from leanstep.training.loop_state import RunClock, RunStopped, Stop, Tick
from leanstep.training.records import EvalRecord, Note, RunStart, TrainRecord
from leanstep.training.run_steps import loop_actions, run_steps
from leanstep.training.schedule import SCHEDULES, decay_start, make_schedule
from leanstep.training.step_loop import StepLoop
from leanstep.training.stop_signals import StopSignals
from leanstep.training.stops import (
    EndRun,
    StopAtBudget,
    StopAtMinimumLossScale,
    StopAtStep,
    StopOnSignal,
    out_of_time,
)

CHECKPOINTS = Path("/runs/demo/checkpoints")


def record(step: int, *, skipped: bool = False, loss_scale: float = 1.0, elapsed_s: float = 0.0) -> TrainRecord:
    return TrainRecord(step, 2.0, 1.0, loss_scale, skipped, False, int(skipped), 1e3, elapsed_s, 1e-3)


def tick_at(step: int, steps: int = 10, **fields: Any) -> Tick:
    return Tick(**{"state": None, "step": step, "steps": steps, "records": (record(step),), **fields})


def plan_of(**fields: Any) -> BudgetPlan:
    values = dict(
        budget_s=60.0,
        planned_at_s=5.0,
        compile_s=1.0,
        step_s=0.5,
        step_times_s=(0.5,),
        eval_s=0.1,
        checkpoint_s=0.5,
        finish_s=2.0,
        steps=100,
    )
    return BudgetPlan(**{**values, **fields})


class FakeSignals:
    """A StopSignals stand-in: ``received`` as given, or set by a signal sent during a deferred block."""

    def __init__(self, received: int | None = None, *, during_save: int | None = None) -> None:
        self.received, self.during_save, self.deferring = received, during_save, []

    @contextlib.contextmanager
    def deferred(self):
        self.deferring.append(True)
        yield
        if self.during_save is not None:
            self.received = self.received or self.during_save
        self.deferring.append(False)


class RecordingCheckpointer:
    """A Checkpointer stand-in: records saves and commits; a write "finishes" when ``written`` says so."""

    def __init__(self, fail_at: int | None = None, *, fail_in_background_at: int | None = None) -> None:
        self.directory, self.saved, self.fail_at = CHECKPOINTS, [], fail_at
        self.fail_in_background_at = fail_in_background_at
        self.pending: list[int] = []
        self.committed: list[int] = []
        self.written = False

    def save(self, step: int, state: Any, *, extra: dict[str, Any], wait: bool = True) -> None:
        self.wait_until_finished()
        if step == self.fail_at:
            raise CheckpointError("no space left on device")
        self.saved.append((step, extra))
        self.pending.append(step)
        if wait:
            self.wait_until_finished()

    def wait_until_finished(self) -> None:
        pending, self.pending = self.pending, []
        if self.fail_in_background_at in pending:
            raise CheckpointError(f"saving step(s) {pending} failed: no space left on device")
        self.committed += pending

    def poll(self) -> list[int]:
        if not self.pending or not (self.written or self.fail_in_background_at in self.pending):
            return []
        steps = list(self.pending)
        self.wait_until_finished()
        return steps


# --- the actions' triggers ----------------------------------------------------------------


@pytest.mark.parametrize(("every", "steps"), [(1, 5), (3, 10), (4, 10), (7, 20), (100, 9)])
def test_evaluate_runs_every_n_steps_and_after_the_last(every, steps):
    action = Evaluate(every=every, evaluate=lambda params: 0.0)
    expected = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
    assert [s for s in range(1, steps + 1) if action.when(tick_at(s, steps))] == expected


def test_evaluate_runs_when_the_budget_ends_the_run_but_not_for_other_stops():
    action = Evaluate(every=100, evaluate=lambda params: 0.0)
    assert action.when(tick_at(7, stops=(Stop("budget"),)))
    assert not action.when(tick_at(7, stops=(Stop("signal", 15), Stop("stop_at"))))


def test_evaluate_adds_the_held_out_loss_of_the_steps_params_after_its_record():
    seen = []
    action = Evaluate(every=2, evaluate=lambda params: seen.append(params) or 2.0 * np.log(2.0))
    tick = action.do(dataclasses.replace(tick_at(4), state=FakeState(step=4, params=41.0)))
    assert seen == [41.0]
    assert tick.records[0] == record(4) and tick.records[1:] == (EvalRecord.from_loss(4, 2.0 * np.log(2.0)),)
    assert tick.records[1].heldout_bits_per_byte == pytest.approx(2.0)


@pytest.mark.parametrize(("every", "steps"), [(1, 6), (2, 7), (3, 10), (250, 12)])
def test_the_checkpoint_schedule(every, steps):
    action = SaveCheckpoint(every, RecordingCheckpointer(), "sha", FakeSignals(), Path("/runs/demo"))
    expected = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
    assert [s for s in range(1, steps + 1) if action.when(tick_at(s, steps))] == expected
    for stop in (Stop("budget"), Stop("signal", 2), Stop("stop_at")):  # every stop saves its step first
        assert all(action.when(tick_at(s, steps, stops=(stop,))) for s in range(1, steps + 1))


def test_a_step_at_the_minimum_loss_scale_is_never_saved():
    action = SaveCheckpoint(2, RecordingCheckpointer(), "sha", FakeSignals(), Path("/runs/demo"))
    for step in range(1, 11):
        stuck = tick_at(step, 10, skips_at_minimum=1, stops=(Stop("signal", 15),))
        assert not action.when(stuck)


def test_a_checkpoint_saves_the_step_with_signals_deferred_and_says_where_the_data_is():
    checkpointer, signals = RecordingCheckpointer(), FakeSignals()
    action = SaveCheckpoint(5, checkpointer, "sha", signals, Path("/runs/demo"))
    tick = action.do(tick_at(5, records=(record(5, elapsed_s=12.5),)))
    extra = {"data_position": 5, "elapsed_s": 12.5, "config_sha256": "sha", "rollbacks": 0, "spike_steps": []}
    assert checkpointer.saved == [(5, extra)]
    assert signals.deferring == [True, False] and tick.stops == ()
    # Written in the background: not committed yet, so the last checkpoint is still the one before.
    assert tick.saving == 5 and tick.last_saved == 0 and checkpointer.committed == []


def test_a_background_checkpoint_is_committed_once_written_and_never_waited_for_before():
    checkpointer, signals = RecordingCheckpointer(), FakeSignals()
    save = SaveCheckpoint(5, checkpointer, "sha", signals, Path("/runs/demo"))
    commit = CommitCheckpoint(checkpointer, signals, Path("/runs/demo"))
    tick = save.do(tick_at(5, last_saved=0))
    tick = dataclasses.replace(tick, step=6, records=(record(6),))
    assert commit.when(tick) and commit.do(tick) == tick  # still writing: the loop goes on
    checkpointer.written = True
    tick = commit.do(tick)
    assert (tick.last_saved, tick.saving, checkpointer.committed) == (5, None, [5])
    assert not commit.when(tick)
    assert not CommitCheckpoint(checkpointer, signals, Path("/r"), many=True).when(dataclasses.replace(tick, saving=7))


def test_the_next_save_commits_the_one_in_flight_first_and_the_last_step_is_waited_for():
    checkpointer = RecordingCheckpointer()
    save = SaveCheckpoint(5, checkpointer, "sha", FakeSignals(), Path("/runs/demo"))
    tick = save.do(tick_at(5))
    tick = save.do(dataclasses.replace(tick, step=10, records=(record(10),)))  # step 10 of 10: the last
    assert (tick.last_saved, tick.saving, checkpointer.committed) == (10, None, [5, 10])
    tick = save.do(dataclasses.replace(tick_at(15, 20), stops=(Stop("stop_at"),)))  # a stop: waited for
    assert (tick.last_saved, tick.saving) == (15, None)


def test_a_synchronous_save_commits_before_the_loop_goes_on():
    checkpointer = RecordingCheckpointer()
    tick = SaveCheckpoint(5, checkpointer, "sha", FakeSignals(), Path("/r"), background=False).do(tick_at(5))
    assert (tick.last_saved, tick.saving, checkpointer.committed) == (5, None, [5])


@pytest.mark.parametrize("found_by", ["commit", "next save"])
def test_a_failed_background_write_stops_the_run_naming_it_and_the_last_good_one(found_by):
    checkpointer, signals = RecordingCheckpointer(fail_in_background_at=6), FakeSignals()
    save = SaveCheckpoint(2, checkpointer, "sha", signals, Path("/runs/demo"))
    tick = save.do(tick_at(6, last_saved=4))
    assert tick.saving == 6
    with pytest.raises(RunStopped) as caught:
        if found_by == "commit":
            CommitCheckpoint(checkpointer, signals, Path("/runs/demo")).do(dataclasses.replace(tick, step=7))
        else:
            save.do(dataclasses.replace(tick, step=8, records=(record(8),)))
    step = 7 if found_by == "commit" else 8
    assert caught.value.exit_code == 1
    assert str(caught.value) == (
        f"stopped at step {step}: the checkpoint of step 6 could not be written (saving step(s) [6] failed: no space "
        f"left on device); the last checkpoint (step 4) is intact in {CHECKPOINTS}. Free space or fix the "
        "directory, then continue with --resume --out /runs/demo"
    )
    assert checkpointer.committed == []


@pytest.mark.parametrize("many", [False, True])
def test_a_signal_during_a_save_stops_a_one_process_run_at_that_step(many):
    action = SaveCheckpoint(5, RecordingCheckpointer(), "sha", FakeSignals(during_save=15), Path("/r"), many=many)
    tick = action.do(tick_at(5))
    # One process: the step is saved (and committed), so it stops there. Several: all must stop
    # after the same step, so the next step's signal check finds it.
    assert tick.stops == (() if many else (Stop("signal", 15),))
    if not many:
        assert (tick.last_saved, tick.saving) == (5, None)


def test_a_signal_during_a_save_is_not_recorded_twice():
    action = SaveCheckpoint(5, RecordingCheckpointer(), "sha", FakeSignals(15, during_save=2), Path("/r"))
    assert action.do(tick_at(3, stops=(Stop("signal", 15),))).stops == (Stop("signal", 15),)


def test_a_real_signal_during_a_save_waits_for_it_and_stops_at_the_step():
    class Killing(RecordingCheckpointer):
        def save(self, step, state, *, extra, wait=True):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a second one waits too: the save is not cut short
            super().save(step, state, extra=extra, wait=wait)

    checkpointer = Killing()
    with StopSignals() as signals:
        tick = SaveCheckpoint(5, checkpointer, "sha", signals, Path("/r")).do(tick_at(5))
    assert [step for step, _ in checkpointer.saved] == [5] and checkpointer.committed == [5]
    assert tick.stops == (Stop("signal", int(signal.SIGTERM)),) and tick.last_saved == 5


def test_a_failed_checkpoint_stops_the_run_naming_the_last_good_one():
    action = SaveCheckpoint(2, RecordingCheckpointer(fail_at=6), "sha", FakeSignals(), Path("/runs/demo"))
    with pytest.raises(RunStopped) as caught:
        action.do(tick_at(6, last_saved=4))
    assert caught.value.exit_code == 1
    assert str(caught.value) == (
        "stopped at step 6: its checkpoint could not be written (no space left on device); the last checkpoint "
        f"(step 4) is intact in {CHECKPOINTS}. Free space or fix the directory, then continue with "
        "--resume --out /runs/demo"
    )


@pytest.mark.parametrize(("stop_at", "steps"), [(3, 10), (10, 10), (1, 4), (None, 5), (12, 10)])
def test_stop_at_stops_from_its_step_until_the_last(stop_at, steps):
    check = StopAtStep(stop_at)
    expected = [s for s in range(1, steps + 1) if stop_at is not None and stop_at <= s < steps]
    assert [s for s in range(1, steps + 1) if check.when(tick_at(s, steps))] == expected
    assert check.do(tick_at(3)).stops == (Stop("stop_at"),)


@pytest.mark.parametrize("max_skips", [1, 3, 100])
def test_a_stuck_loss_scale_stops_after_max_skips_in_a_row(max_skips):
    check = StopAtMinimumLossScale(max_skips, CHECKPOINTS)
    assert [n for n in range(120) if check.when(tick_at(5, skips_at_minimum=n))] == list(range(max_skips, 120))


def test_a_stuck_loss_scale_raises_at_once_saying_where_the_last_good_state_is():
    check = StopAtMinimumLossScale(3, CHECKPOINTS)
    tick = tick_at(11, 40, skips_at_minimum=3, last_saved=8, records=(record(11, skipped=True, loss_scale=1.0),))
    with pytest.raises(
        RunStopped, match=r"stopped at step 11: the loss scale sat at its minimum \(1\) for 3"
    ) as caught:
        check.do(tick)
    assert caught.value.exit_code == 1 and "the last checkpoint (step 8) is intact" in str(caught.value)


def test_the_budget_stops_before_a_step_that_would_end_past_it():
    now = [0.0]
    check = StopAtBudget(RunClock(origin=100.0, now=lambda: now[0]))
    plan = plan_of()  # a step of 0.5 s, 2 s to finish: no step may begin after 57.5 s
    for session_s in np.arange(50.0, 60.0, 0.25):
        now[0] = 100.0 + session_s
        assert check.when(tick_at(3, 100, plan=plan)) == (session_s + 0.5 > 58.0)
        assert not check.when(tick_at(100, 100, plan=plan))  # the last step: nothing left to stop
        assert not check.when(tick_at(3, 100))  # --steps: no budget
    assert check.do(tick_at(3, plan=plan)).stops == (Stop("budget"),)


def test_the_budget_reads_the_loops_own_step_time_once_replanned():
    assert out_of_time(plan_of(loop_step_s=3.0), 55.5) and not out_of_time(plan_of(), 55.5)


@pytest.mark.parametrize(("received", "stops"), [(None, ()), (15, (Stop("signal", 15),)), (2, (Stop("signal", 2),))])
def test_a_signal_received_by_then_stops_the_run(received, stops):
    check = StopOnSignal(FakeSignals(received))
    assert all(check.when(tick_at(s)) for s in range(1, 11))  # it reads the signals after every step
    assert check.do(tick_at(4)).stops == stops


# --- the end of a run -------------------------------------------------------------------------


def end_run(received: int | None = None) -> tuple[EndRun, list]:
    emitted: list = []
    return EndRun(
        Path("/runs/demo"), CHECKPOINTS, FakeSignals(received), lambda *records: emitted.extend(records)
    ), emitted


def test_end_run_triggers_only_on_a_stop():
    action, _ = end_run()
    assert not action.when(tick_at(4)) and action.when(tick_at(4, stops=(Stop("budget"),)))


def test_stop_at_outranks_a_signal_which_outranks_the_budget():
    action, _ = end_run(received=15)
    both = tick_at(4, last_saved=4, stops=(Stop("budget"), Stop("signal", 15), Stop("stop_at")))
    with pytest.raises(RunStopped) as caught:
        action.do(both)
    assert caught.value.exit_code == 0 and caught.value.signal is None
    assert str(caught.value) == (
        "stopped at step 4 as --stop-at asked, after saving a checkpoint; continue with --resume --out /runs/demo"
    )
    with pytest.raises(RunStopped) as caught:
        action.do(dataclasses.replace(both, stops=(Stop("budget"), Stop("signal", 15))))
    assert (caught.value.exit_code, caught.value.signal) == (143, 15)
    assert str(caught.value).startswith("SIGTERM received: stopped at step 4 after saving a checkpoint")


def test_a_signal_from_another_process_is_not_delivered_again_here():
    action, _ = end_run(received=None)
    with pytest.raises(RunStopped) as caught:
        action.do(tick_at(4, last_saved=2, stops=(Stop("signal", 2),)))
    assert (caught.value.exit_code, caught.value.signal) == (130, None)
    assert f"(the last checkpoint (step 2) is intact in {CHECKPOINTS})" in str(caught.value)


def test_the_end_of_the_budget_is_a_note_and_ends_the_loop():
    action, emitted = end_run()
    tick = action.do(tick_at(7, 12, last_saved=7, plan=plan_of(steps=12), stops=(Stop("budget"),)))
    assert tick.done
    assert emitted == [
        Note(
            "warning: the time budget ran out at step 7 of the 12 planned (steps ran slower than the 500.0 ms "
            "measured when planning), after saving a checkpoint; --resume --out /runs/demo finishes the schedule"
        )
    ]


# --- planning again ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeState:
    step: int
    params: float = 0.0
    opt_state: Any = ()
    loss_scale: Any = None

    def replace(self, **changes: Any) -> FakeState:
        return dataclasses.replace(self, **changes)


def test_the_steps_are_timed_until_the_replan_which_comes_once_at_its_step():
    times: list[float] = []
    calls: list = []
    config = RunConfig(schedule="constant", eval_every=10, checkpoint_every=1000)
    clock = RunClock(origin=0.0, now=lambda: 4.0)
    timing = TimeSteps(times)
    again = Replan(config, clock, times, calls.append, lambda *records: calls.extend(records))
    tick = Tick(state=FakeState(step=0), step=0, steps=100, plan=plan_of(replan_at=20, steps=100))
    timed, replanned = [], []
    for step in range(1, 31):
        tick = dataclasses.replace(tick, step=step, seconds=0.01 * step)
        timed += [step] if timing.when(tick) else []
        tick = timing.do(tick) if timing.when(tick) else tick
        if again.when(tick):
            replanned.append(step)
            tick = again.do(tick)
    assert timed == list(range(1, 21)) and replanned == [20]
    assert times == [0.01 * s for s in range(1, 21)]
    expected = replan(plan_of(replan_at=20, steps=100), config, 20, 4.0, [0.01 * s for s in range(1, 21)])
    assert tick.plan == expected and tick.steps == expected.steps and not replan_pending(tick.plan)
    assert calls == [expected, Note(expected.describe()), RunStart(expected.steps, 20)]


@pytest.mark.parametrize("name", [name for name in SCHEDULES if name != "cosine"])
@pytest.mark.parametrize("total", [40, 123, 1000])
@pytest.mark.parametrize("pace", [0.001, 0.05, 2.0])
def test_a_steps_record_has_the_learning_rate_of_the_plan_made_after_it(name, total, pace):
    # The loop makes a step's record before the replan at that step: its rate must not depend
    # on which plan it is read over (the premise of replan_step).
    config = RunConfig(schedule=name, warmup_steps=10, eval_every=10, checkpoint_every=1000)
    at = replan_step(config, total)
    if at is None or at >= total:
        pytest.skip("no replan for this length")
    new = replan(plan_of(replan_at=at, steps=total), config, at, 10.0, [pace] * at).steps
    schedule = make_schedule(name, 3e-3, config.warmup_steps)
    for applied in range(at):
        assert float(schedule(applied, total, np)) == float(schedule(applied, new, np))
    if name == "warmup-stable-decay":
        assert decay_start(new) > at


# --- the loop -------------------------------------------------------------------------------


class Metrics(NamedTuple):
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    clipped: bool
    consecutive_skips: int
    spiked: bool | None = None


class Sampler:
    def batch_at(self, step: int) -> float:
        return float(step + 1)


def stand_in_step(state: FakeState, batch: float) -> tuple[FakeState, Metrics]:
    return state.replace(step=state.step + 1, params=state.params + batch), Metrics(batch, 1.0, 1.0, False, False, 0)


def stand_in_loop(tmp_path: Path, checkpointer: RecordingCheckpointer, emitted: list, **config: Any) -> StepLoop:
    return StepLoop(
        config=RunConfig(out=str(tmp_path), **config),
        checkpointer=checkpointer,
        metrics_path=tmp_path / "metrics.jsonl",
        step_fn=stand_in_step,
        eval_fn=lambda params, batch: params * batch,
        sampler=Sampler(),
        eval_data=[0.5, 1.5],
        schedule=lambda applied, steps, xp: applied / steps,
        emit=lambda *records: emitted.extend(records),
        mesh=None,
        origin=0.0,
    )


@pytest.mark.parametrize(("steps", "eval_every", "checkpoint_every"), [(7, 3, 2), (5, 1, 5), (9, 4, 100)])
def test_the_loop_logs_evaluates_and_saves_on_its_schedule(tmp_path, steps, eval_every, checkpoint_every):
    checkpointer, emitted = RecordingCheckpointer(), []
    loop = stand_in_loop(
        tmp_path, checkpointer, emitted, steps=steps, eval_every=eval_every, checkpoint_every=checkpoint_every
    )
    run_steps(loop, FakeState(step=0), elapsed_before=0.0)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = []
    for step in range(1, steps + 1):
        expected.append(("train", step))
        if step % eval_every == 0 or step == steps:
            expected.append(("eval", step))
    assert [(line["kind"], line["step"]) for line in lines] == expected
    params = {step: float(sum(range(1, step + 1))) for step in range(1, steps + 1)}  # step i's batch is i
    evals = [line["heldout_loss"] for line in lines if line["kind"] == "eval"]
    assert evals == [params[line["step"]] for line in lines if line["kind"] == "eval"]  # mean(p * 0.5, p * 1.5)
    assert [line["lr"] for line in lines if line["kind"] == "train"] == [s / steps for s in range(steps)]
    saved = [s for s in range(1, steps + 1) if s % checkpoint_every == 0 or s == steps]
    assert [step for step, _ in checkpointer.saved] == saved
    assert [(r.kind, r.step) for r in emitted] == expected  # the callback sees what the log holds, in order


def test_the_loop_resumed_from_a_step_goes_on_from_it_and_stops_at_stop_at(tmp_path):
    checkpointer, emitted = RecordingCheckpointer(), []
    loop = stand_in_loop(tmp_path, checkpointer, emitted, steps=10, eval_every=100, checkpoint_every=4, stop_at=6)
    with pytest.raises(RunStopped, match="stopped at step 6 as --stop-at asked, after saving") as caught:
        run_steps(loop, FakeState(step=3, params=9.0), elapsed_before=50.0)
    assert caught.value.exit_code == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, 5, 6]
    assert all(line["elapsed_s"] >= 50.0 for line in lines)  # earlier sessions count
    assert [step for step, _ in checkpointer.saved] == [4, 6]


def test_the_actions_run_in_the_loops_order(tmp_path):
    loop = stand_in_loop(tmp_path, RecordingCheckpointer(), [], steps=3)
    kinds = [type(action) for action in loop_actions(loop, RunClock(0.0), None, FakeSignals(), lambda plan: None)]
    assert kinds == [
        TimeSteps,
        Replan,
        StopAtBudget,  # before the evaluation it asks for
        Evaluate,
        LogRecords,
        StopAtMinimumLossScale,  # after the records are out, before the signals are read
        EndLowerRate,  # before the save: a checkpoint holds the factor its next step uses
        StopOnSignal,
        StopAtStep,
        CommitCheckpoint,  # the save in flight, if written, before the next one
        SaveCheckpoint,  # after every stop is found
        EndRun,
    ]
    with_rollback = dataclasses.replace(loop, config=dataclasses.replace(loop.config, spike_rollback="on"))
    kinds = [type(a) for a in loop_actions(with_rollback, RunClock(0.0), None, FakeSignals(), lambda plan: None)]
    assert kinds.index(RollBackOnSpikes) == kinds.index(StopAtMinimumLossScale) + 1  # after the spike is logged


def test_the_loop_at_the_end_of_its_budget_evaluates_saves_says_so_and_returns(tmp_path):
    checkpointer, emitted = RecordingCheckpointer(), []
    loop = stand_in_loop(tmp_path, checkpointer, emitted, steps=5, eval_every=100, checkpoint_every=100)
    loop = dataclasses.replace(loop, origin=time.perf_counter())
    spent = plan_of(budget_s=1000.0, step_s=1000.0, steps=5)  # no step fits: the first one ends the run
    run_steps(loop, FakeState(step=0), elapsed_before=0.0, plan=spent)
    assert [(r.kind, getattr(r, "step", None)) for r in emitted] == [("train", 1), ("eval", 1), ("note", None)]
    assert emitted[-1].message.startswith("warning: the time budget ran out at step 1 of the 5 planned")
    assert [step for step, _ in checkpointer.saved] == [1]


def test_the_loop_plans_again_at_its_replan_step_before_that_steps_records(tmp_path):
    checkpointer, emitted, replans = RecordingCheckpointer(), [], []
    loop = stand_in_loop(tmp_path, checkpointer, emitted, steps=5, eval_every=100, checkpoint_every=100, stop_at=4)
    loop = dataclasses.replace(loop, origin=time.perf_counter())
    plan = plan_of(budget_s=1e5, step_s=1e-3, steps=5, replan_at=2)
    with pytest.raises(RunStopped, match="stopped at step 4 as --stop-at asked"):
        run_steps(loop, FakeState(step=0), elapsed_before=0.0, plan=plan, on_replan=replans.append)
    assert len(replans) == 1 and replans[0].steps > 5 and replans[0].loop_step_s is not None
    assert [r.kind for r in emitted] == ["train", "note", "start", "train", "train", "train"]
    assert emitted[2] == RunStart(replans[0].steps, 2) and emitted[3].step == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["lr"] for line in lines] == [0 / 5, 1 / 5, 2 / replans[0].steps, 3 / replans[0].steps]
    assert [step for step, _ in checkpointer.saved] == [4]
