"""A whole training run: data, model, step, metrics, checkpoints, exact resume.

:func:`train` runs a :class:`~leanstep.training.RunConfig` and reports through one callback
that receives typed records (:mod:`leanstep.training.records`): a ``Note`` for each warning, a
``RunStart``, then a ``TrainRecord`` per step and an ``EvalRecord`` per evaluation, the same
records ``metrics.jsonl`` holds. It prints nothing; the CLI renders the records.

What a run does when something goes wrong::

    bad flag, data path or run directory   ValueError naming the flag, before anything is written
    non-finite gradient                     the step skips it (params, optimizer state unchanged)
                                            and the record says "skipped": true
    skipped at the minimum loss scale       RunStopped(1) after --max-consecutive-skips such steps
                                            in a row; such steps are never checkpointed, so the
                                            last good checkpoint is never pruned
    SIGINT / SIGTERM                        finish the step, save, close, then the signal takes
                                            its own effect: the handler the caller had is called
                                            (Python's for SIGINT raises KeyboardInterrupt, the
                                            default for SIGTERM ends the process, as its owner
                                            expects), then RunStopped(128 + signal) if it returns;
                                            more signals during that save (or any save) wait until
                                            it is committed; outside a save a second one stops at
                                            once
    another process writing the same --out  refused at once (the run directory's lock), naming it
    SIGKILL, power loss                     --resume restores the newest verified checkpoint, drops
                                            the metrics past it and replays them bit for bit
    --resume, nothing written yet          (only run.lock: stopped at start-up) starts afresh, saying so
    a state too big for host memory         RunStopped(1) naming the flags, before anything is written
    damaged newest checkpoint               --resume falls back to an older one, with a warning
    no good checkpoint                      RunStopped(1) naming each checkpoint's fault
    a checkpoint or metrics write fails     RunStopped(1); the checkpoints before it are intact

Size: a run's life from start to end (setup, lock, resume, loop, summary) in order; the loop's
periodic work is actions, the loop step_loop, the stops stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from leanstep.checkpoints.checkpointer import Checkpointer, CheckpointError
from leanstep.checkpoints.layout import remove_unfinished_saves
from leanstep.compilation.cache import cache_directory
from leanstep.models.transformer import QKV_LAYOUT
from leanstep.sharding.distributed import device_mesh
from leanstep.sharding.meshes import mesh_axes
from leanstep.step.state import TrainState
from leanstep.training.analysis import fit_memory_budget
from leanstep.training.budget import BudgetPlan
from leanstep.training.build import Run, build_run
from leanstep.training.config import RunConfig
from leanstep.training.corpus_load import QUICK_S, CorpusLoad, EarlyStep, compile_early
from leanstep.training.data import BatchSampler, Corpus, heldout_batches
from leanstep.training.finish import finish_run
from leanstep.training.loop_state import RunStopped
from leanstep.training.memory_check import check_state_fits
from leanstep.training.records import Note, Record, RunStart
from leanstep.training.resume import resume_run
from leanstep.training.run_dir import check_out, check_run, fresh_start, with_saved_plan, write_json_atomic
from leanstep.training.run_lock import RunLock
from leanstep.training.run_steps import planned_steps, run_steps
from leanstep.training.schedule import set_total_steps
from leanstep.training.step_loop import (
    StepLoop,
    compile_step,
    place_eval_batch,
    plan_steps,
    warming_up,
)

__all__ = ["RunStopped", "train"]


def _ignore(*records: Record) -> None:
    del records


def train(config: RunConfig, *, resume: bool = False, on_record: Callable[..., None] | None = None) -> dict[str, Any]:
    """Runs (or resumes) a training run described by ``config`` and returns its summary.

    Args:
      config: the run; checked with :meth:`RunConfig.validate` first.
      resume: continue the run in ``config.out`` from its newest intact checkpoint.
      on_record: called as ``on_record(*records)`` with what the run emits (see the module
        doc); process 0 of a multi-process run emits the step records, every process its
        notes. None: nothing is reported.

    Returns:
      The summary written to ``summary.json``, plus ``"curves"``: the path of ``curves.png``.

    Raises:
      ValueError: bad configuration or data, or a run directory that does not fit.
      RunStopped: stopped by a loss scale stuck at its minimum, by a failed write, because no
        checkpoint to resume from is intact, or by a signal whose handler returned.
      KeyboardInterrupt: SIGINT under Python's default handler, once the step is saved (its
        ``__context__`` is the RunStopped that names the step).

    A SIGINT or SIGTERM stops the run after the current step and its checkpoint; the signal
    is then delivered again to the handler that was in place when :func:`train` was called, so
    that a process sent SIGTERM (by ``timeout``, a scheduler, a test runner's time limit) still
    ends, with its work saved. To get an exception instead, install a handler that raises one
    (:func:`leanstep.training.stop_signals.raising_on_sigterm`).
    """
    try:
        return _train(config, resume, on_record)
    except RunStopped as stopped:
        if stopped.signal is not None and threading.current_thread() is threading.main_thread():
            signal.raise_signal(stopped.signal)  # its own effect: may end the process, or raise here
        raise


def _train(config: RunConfig, resume: bool, on_record: Callable[..., None] | None) -> dict[str, Any]:
    origin = time.perf_counter()  # a --time-budget counts from here
    emit = _ignore if on_record is None else on_record
    fitted, said = fit_memory_budget(with_saved_plan(config) if resume else config)  # --budget's choice
    run = build_run(fitted)
    config = run.config  # --size and --precision auto resolved
    out = Path(config.out)
    check_out(out)
    if config.rollback is not None and jax.process_count() > 1:
        raise ValueError(
            f"--spike-rollback {config.spike_rollback}: a rollback restores and deletes checkpoints in the loop, "
            f"which runs on one process for now, not {jax.process_count()}; use --spike-guard alone"
        )
    check_state_fits(run)  # a state too big for the host: refused now, not a hang in XLA's allocator
    # The one writer of --out from here to the end (process 0 of a multi-process run): taken
    # first if the directory exists (a live run is named before anything else is said about it),
    # else once the checks have passed (a run that fails them creates nothing).
    lock = RunLock(out) if jax.process_index() == 0 else None
    early = lock is not None and out.is_dir()
    refused = _take(lock) if lock is not None and early else None
    note = fresh_start(out, lock.existed) if resume and refused is None and lock is not None and early else None
    if note is not None and jax.process_count() == 1:  # stopped before it wrote anything: start it
        resume = False
        emit(Note(note))
    if refused is not None and jax.process_count() == 1:
        raise refused
    emit(*(Note(line) for line in (*said, run.size_reason) if line is not None))  # after a live run is named
    compiled: EarlyStep | None = None
    try:
        loading = CorpusLoad(config.data, config.seq_len)
        # A new run's checks do not read the data: a corpus slow to read is read while the step compiles.
        overlap = not (resume or early or jax.process_count() > 1 or loading.done_within(QUICK_S))
        # --devices (or a multi-process run) shards the step over a mesh; without it, one device.
        sharded = config.devices is not None or config.mesh is not None or jax.process_count() > 1
        mesh = device_mesh(config.devices, shape=config.mesh_shape) if sharded else None
        axes = None if mesh is None else mesh_axes(mesh, fsdp=config.fsdp)
        rows = 1 if axes is None else axes.size(axes.batch)
        if mesh is not None and config.batch_size % (config.microbatches * rows):
            raise ValueError(
                f"--batch-size {config.batch_size} is not divisible by --microbatches "
                f"{config.microbatches} times the {rows} devices the batch rows are split over "
                f"({jax.process_count()} process(es))"
            )
        if config.fsdp and mesh is None:
            raise ValueError("--fsdp shards the state over devices; add --devices N")
        if overlap:  # nothing is written yet: a corpus that fails still leaves no run directory
            eval_fn, template = run.eval_fn(mesh), run.initial_state(mesh)
            compiled = compile_early(template, run.make_step(mesh=mesh), eval_fn, config, mesh)
        corpus, described = loading.result()
        if refused is None:
            check_run(config, resume, described)
        if lock is not None and not early:
            refused = _take(lock)
            if refused is None:
                check_run(config, resume, described)  # again, now that no one else can write it
        if jax.process_count() > 1:  # every process has checked --out before process 0 writes to it
            anywhere = multihost_utils.process_allgather(np.int32(refused is not None))
            if refused is None and np.any(anywhere):
                raise RunStopped("process 0 could not take the run directory --out; see its error", 1)
        if refused is not None:
            raise refused
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        return _train_locked(_Setup(config, run, resume, corpus, described, mesh, emit, lock, origin, compiled))
    finally:
        if lock is not None:
            lock.release()


def _take(lock: RunLock) -> Exception | None:
    """Takes ``lock``; the error to raise if it cannot be taken (another writer, or an OSError)."""
    try:
        lock.acquire()
    except ValueError as error:  # RunDirectoryInUse: another live run
        return error
    except OSError as error:
        return RunStopped(f"cannot lock the run directory --out {str(lock.out)!r}: {error}", 1)
    return None


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What :func:`train` has checked once it holds the run directory (``lock``; None on process > 0)."""

    config: RunConfig
    run: Run
    resume: bool
    corpus: Corpus
    described: dict[str, Any]  # corpus.describe()
    mesh: Mesh | None
    emit: Callable[..., None]
    lock: RunLock | None
    origin: float  # time.perf_counter() when train() began
    precompiled: EarlyStep | None = None  # the step and evaluation, compiled while the corpus was read

    @property
    def primary(self) -> bool:
        """Whether this process writes the run directory (process 0)."""
        return jax.process_index() == 0


def _train_locked(setup: _Setup) -> dict[str, Any]:
    """:func:`train` from the moment it holds the run directory: compile, plan, open, resume, step, finish."""
    precompiled = setup.precompiled
    loop = _make_loop(setup)
    template = setup.run.initial_state(setup.mesh) if precompiled is None else precompiled.template
    # The evaluation compiles beside the step (and matplotlib loads, for a run that draws its chart).
    loop = warming_up(loop, template.params, chart=setup.config.chart)
    step_compile = compile_step(loop, template) if precompiled is None else precompiled.compiled
    plan = None
    if setup.config.steps is None:  # sized to --time-budget: compile, time, plan (leanstep.training.budget)
        plan = plan_steps(loop, template, step_compile["seconds"])
        loop = dataclasses.replace(loop, config=dataclasses.replace(loop.config, steps=plan.steps))
    config = loop.config
    run_info = _run_info(setup, config, template, plan, step_compile)
    checkpointer, notes = _open_run_dir(setup, config, run_info, plan)
    loop = dataclasses.replace(loop, checkpointer=checkpointer)
    try:
        _resume_and_run(setup, loop, template, run_info, notes, plan)
    except BaseException:
        with contextlib.suppress(CheckpointError):  # report the first failure, not a follow-on one
            checkpointer.close()
        raise
    checkpointer.close()
    out = Path(config.out)
    if not setup.primary:
        chart = str(out / "curves.png") if config.chart else None  # process 0 draws it
        return {"process_index": jax.process_index(), "curves": chart}
    return finish_run(
        out, run_info, max_grad_norm=config.max_grad_norm, emit=setup.emit, origin=setup.origin, chart=config.chart
    )


def _make_loop(setup: _Setup) -> StepLoop:
    """The parts of the step loop, before the run directory is open (no checkpointer yet)."""
    config, run, mesh = setup.config, setup.run, setup.mesh
    eval_data = heldout_batches(setup.corpus.heldout, config.batch_size, config.seq_len, config.eval_batches)
    return StepLoop(
        config=config,
        checkpointer=None,
        metrics_path=Path(config.out) / "metrics.jsonl" if setup.primary else None,
        step_fn=run.make_step(mesh=mesh) if setup.precompiled is None else setup.precompiled.step_fn,
        eval_fn=run.eval_fn(mesh) if setup.precompiled is None else setup.precompiled.eval_fn,
        sampler=BatchSampler(setup.corpus.train, config.batch_size, config.seq_len, config.seed),
        eval_data=eval_data if mesh is None else [place_eval_batch(b, mesh) for b in eval_data],
        schedule=run.schedule,
        emit=setup.emit if setup.primary else _ignore,
        mesh=mesh,
        origin=setup.origin,
    )


def _run_info(
    setup: _Setup, config: RunConfig, template: TrainState, plan: BudgetPlan | None, step_compile: dict[str, Any]
) -> dict[str, Any]:
    """``config.json``: the run's config and what it ran on."""
    run, mesh = setup.run, setup.mesh
    return {
        "run": config.to_json(),
        "step": config.step_spec(sharded=mesh is not None).to_json(),  # the StepSpec the step was built from
        "corpus": setup.described,
        "model_config": dataclasses.asdict(run.model.config),
        "parameters": int(sum(x.size for x in jax.tree.leaves(template.params))),
        "flops_per_token": run.model.flops_per_token,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "max_grad_norm": config.max_grad_norm,
        "devices": 1 if mesh is None else mesh.size,
        "processes": jax.process_count(),
        "qkv_layout": QKV_LAYOUT,
        "precision_reason": run.precision_reason,
        "size_reason": run.size_reason,
        "time_budget_plan": None if plan is None else plan.to_json(),
        "compile_cache": {"directory": cache_directory(), "step": step_compile},
    }


def _open_run_dir(
    setup: _Setup, config: RunConfig, run_info: dict[str, Any], plan: BudgetPlan | None
) -> tuple[Checkpointer, list[str]]:
    """The run directory made and cleaned up, its checkpointer open; the notes to show before the first step."""
    out = Path(config.out)
    resume, primary = setup.resume, setup.primary
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not resume and primary:  # before the first checkpoint, so that a run killed from here on can be resumed
            write_json_atomic(out / "config.json", run_info)
        notes = remove_unfinished_saves(out / "checkpoints") if resume and primary else []
        took_over = setup.lock.took_over() if setup.lock is not None else None
        notes += [f"warning: {took_over}"] if took_over else []
        notes += [] if plan is None else [plan.describe()]
        if jax.process_count() > 1:  # ... and cleaned it up before any process opens the checkpoints
            multihost_utils.sync_global_devices("leanstep: run directory ready")
        return Checkpointer(out / "checkpoints", max_to_keep=config.keep_checkpoints), notes
    except (OSError, CheckpointError) as error:
        raise RunStopped(f"cannot write the run directory --out {str(out)!r}: {error}", 1) from None


def _resume_and_run(
    setup: _Setup,
    loop: StepLoop,
    template: TrainState,
    run_info: dict[str, Any],
    notes: list[str],
    plan: BudgetPlan | None,
) -> None:
    """Restores the newest checkpoint (``--resume``), says the notes and starts, then runs the steps."""
    config, checkpointer, primary = loop.config, loop.checkpointer, setup.primary
    assert checkpointer is not None  # the run directory is open
    out = Path(config.out)
    config_path = out / "config.json"
    steps = planned_steps(config)  # the schedule spans them: the saved length, or a longer one (an extension)
    resumed = resume_run(checkpointer, template, config, notes, steps=steps, resume=setup.resume, primary=primary)
    state = resumed.state.replace(opt_state=set_total_steps(resumed.state.opt_state, steps))
    if setup.resume and primary:
        try:
            write_json_atomic(config_path, run_info)  # a resumable field may have changed
        except OSError as error:
            raise RunStopped(f"cannot write the run directory --out {str(out)!r}: {error}", 1) from None
    setup.emit(*(Note(note) for note in notes))
    loop.emit(RunStart(steps, int(state.step)))

    def replanned(new: BudgetPlan) -> None:  # config.json names the steps before a checkpoint holds them
        run_info.update(run={**run_info["run"], "steps": new.steps}, time_budget_plan=new.to_json())
        if primary:
            write_json_atomic(config_path, run_info)

    run_steps(
        loop,
        state,
        resumed.elapsed_before,
        plan=plan,
        on_replan=replanned,
        rollbacks=resumed.rollbacks,
        spike_steps=resumed.spike_steps,
        lr_factor=resumed.lr_factor,
    )
