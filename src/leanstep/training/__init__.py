"""Training runs: a :class:`RunConfig` built into parts, trained, logged, checkpointed and reported.

.. code-block:: text

    config.py       RunConfig: every flag of `leanstep train`, checked, naming the flag
    build.py        build_run(config) -> Run: model, optimizer, loss scale, loss, step
    data.py         the byte corpus (split by file) and the resumable batch sampler
    trainer.py      train(config, on_record=...): setup, compile, plan, run
    resume.py       --resume: the newest intact checkpoint, and the rollback decisions around it
    run_steps.py    the step loop: take_step (the step and its record), then loop_actions
    loop_state.py   what the loop passes between them: Tick, Stop, RunClock, RunStopped
    actions.py      the periodic actions: time steps, replan, evaluate, log, checkpoint, roll back
    rollback.py     --spike-rollback: settings, decisions (rollbacks.json), data positions
    stops.py        the stop checks: budget, stuck loss scale, signal, --stop-at; EndRun
    step_loop.py    what the loop works with (StepLoop) and compile_step
    corpus_load.py  --data read on a thread; a slow corpus is read while the step compiles
    finish.py       summary.json and curves.png of a finished run
    budget.py       --time-budget: calibrate, plan, plan again
    stop_signals.py SIGINT/SIGTERM as a stop after the step, never inside a save
    run_dir.py      the run directory: checked first, written atomically
    records.py      the typed records a run emits (TrainRecord, EvalRecord, Note, RunStart)
    metrics_log.py  metrics.jsonl: writer, reader, truncation on resume
    summary.py      the summary of a run; report(run_dir)
    curves.py       curves.png (matplotlib, Agg)
    analysis.py     plan_run and audit_run: the planner and auditor applied to a config
"""

from leanstep.training.build import Run, build_optimizer, build_run
from leanstep.training.config import RunConfig
from leanstep.training.records import EvalRecord, Note, RunStart, TrainRecord
from leanstep.training.trainer import RunStopped, train

__all__ = [
    "EvalRecord",
    "Note",
    "Run",
    "RunConfig",
    "RunStart",
    "RunStopped",
    "TrainRecord",
    "build_optimizer",
    "build_run",
    "train",
]
