"""The parts the step loop of :func:`leanstep.training.train` works with, and small helpers on them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.checkpoints.checkpointer import Checkpointer
from leanstep.compilation.count import CompileCount
from leanstep.sharding.meshes import shard_batch
from leanstep.step.state import TrainState
from leanstep.step.train_step import JittedTrainStep
from leanstep.training.budget import BudgetPlan, plan_budget
from leanstep.training.config import RunConfig
from leanstep.training.data import BatchSampler
from leanstep.training.schedule import Schedule

__all__ = ["StepLoop", "applied_updates", "evaluate", "in_background", "place_eval_batch", "step_batch", "warming_up"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepLoop:
    """What the step loop works with; built, by keyword, by :func:`leanstep.training.train`."""

    config: RunConfig
    checkpointer: Checkpointer | None  # None until the run directory is open
    metrics_path: Path | None  # None: another process writes the metrics
    step_fn: JittedTrainStep
    eval_fn: jax.stages.Wrapped  # eval_fn(params, batch) -> the mean loss
    sampler: BatchSampler
    eval_data: list[Any]
    schedule: Schedule  # schedule(applied_updates, steps, numpy module)
    emit: Callable[..., None]
    mesh: Mesh | None  # shard each batch over it (None: one device, unsharded)
    origin: float  # time.perf_counter() when train() began: records' elapsed_s count from here
    eval_ready: Callable[[], None] = lambda: None  # waits for eval_fn's compile (warming_up)


def step_batch(loop: StepLoop, step: int) -> Any:
    """The batch of ``step``, placed on the run's devices."""
    batch = loop.sampler.batch_at(step)
    return batch if loop.mesh is None else shard_batch(batch, loop.mesh)


def evaluate(loop: StepLoop, params: Any) -> float:
    """The mean held-out loss (nats per byte) of ``params``."""
    loop.eval_ready()
    return float(np.mean([float(loop.eval_fn(params, b)) for b in loop.eval_data]))


def place_eval_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> Any:
    """Rows split over the mesh when they divide evenly, else (a short heldout set) replicated."""
    if len(next(iter(batch.values()))) % mesh.size == 0:
        return shard_batch(batch, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    return {k: jax.make_array_from_callback(v.shape, replicated, functools.partial(_rows, v)) for k, v in batch.items()}


def _rows(array: np.ndarray, index: Any) -> np.ndarray:
    return array[index]


def applied_updates(opt_state: Any) -> int:
    """The optimizer's update count (it does not advance on skipped steps), which drives the schedule."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return int(counts[0][1]) if counts else 0


def in_background(*calls: Callable[[], Any]) -> Callable[[], None]:
    """Runs ``calls`` in order on a thread while the caller goes on; returns ``wait()``.

    For work whose result nobody reads, only its side effect on a cache: an exception in one
    call is dropped (the real use, later, meets the same error and reports it) and the next
    call runs.
    """

    def run_all() -> None:
        for call in calls:
            with contextlib.suppress(Exception):
                call()

    # Not a daemon: Python waits for it at exit. A daemon thread still inside XLA's compiler when
    # the interpreter finalizes (a run refused or stopped before its first step) is unwound by
    # force through C++ and aborts the process ("FATAL: exception not rethrown", exit 134).
    thread = threading.Thread(target=run_all, name="leanstep-warm-up", daemon=False)
    thread.start()
    return thread.join


def _import_chart() -> None:
    import leanstep.training.curves  # noqa: F401  (matplotlib)


def warming_up(loop: StepLoop, params: Any, *, chart: bool = True) -> StepLoop:
    """``loop``, whose evaluation compiles on a thread from now (:func:`in_background`).

    XLA compiles without holding the GIL, so the evaluation compiles beside the train step
    rather than at the first evaluation; the call then finds the executable in ``jit``'s cache.
    The compile works from a shape-only stand-in of ``params`` (the step donates the state),
    placed as the step's params are: uncommitted on one device, else on the mesh. The thread
    then imports matplotlib for the chart (``chart``), which would otherwise take a second at
    the end of the run, inside a time budget.
    """
    calls: list[Callable[[], Any]] = [_import_chart] if chart else []
    if loop.eval_data:
        calls.insert(0, functools.partial(compile_eval, loop.eval_fn, params, loop.eval_data[0], loop.mesh))
    return dataclasses.replace(loop, eval_ready=in_background(*calls))


def compile_eval(eval_fn: Any, params: Any, batch: Any, mesh: Mesh | None) -> None:
    """``eval_fn`` compiled for ``batch`` and a shape-only stand-in of ``params`` (the step donates
    the state), placed as the step's params are: uncommitted on one device, else on ``mesh``."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None if mesh is None else x.sharding), params
    )
    eval_fn.lower(abstract, batch).compile()


def compile_step(loop: StepLoop, state: TrainState) -> dict[str, Any]:
    """Compiles ``loop``'s step for ``state`` and the run's batches, or loads it from JAX's cache.

    Done before the first step, so that the compile is timed and counted on its own (the first
    call then finds the executable in ``jit``'s cache). Returns :meth:`CompileCount.to_json`
    of this thread's compiles, ``"cache"`` being ``"hit"`` when every program came from the
    persistent cache, ``"miss"`` when any was compiled and ``"off"`` without a cache, plus
    ``"seconds"``: the whole of it, tracing and lowering included.
    """
    return compile_program(loop.step_fn, state, step_batch(loop, 0))


def compile_program(step_fn: JittedTrainStep, state: TrainState, batch: Any) -> dict[str, Any]:
    """:func:`compile_step` for ``step_fn``, ``state`` and ``batch`` (any batch of the run's shape and placement)."""
    start = time.perf_counter()
    with CompileCount() as count:
        step_fn.lower(state, batch).compile()
    return {**count.to_json(), "seconds": round(time.perf_counter() - start, 4)}


def plan_steps(loop: StepLoop, template: TrainState, compile_s: float) -> BudgetPlan:
    """``--time-budget``'s plan (:func:`leanstep.training.budget.plan_budget`): ``loop``'s compiled
    step timed on a scratch copy of ``template``."""

    def scratch() -> TrainState:  # buffers of its own: the calibration's steps donate their input
        return jax.jit(lambda state: jax.tree.map(jnp.copy, state))(template)

    return plan_budget(
        loop.config,
        loop.step_fn,
        scratch,
        lambda i: step_batch(loop, i),
        lambda p: evaluate(loop, p),
        loop.origin,
        compile_s=compile_s,
    )
