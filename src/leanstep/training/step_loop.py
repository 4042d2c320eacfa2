"""The parts the step loop of :func:`leanstep.training.train` works with, and small helpers on them."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.checkpoint import Checkpointer
from leanstep.sharding import shard_batch
from leanstep.state import TrainState
from leanstep.training.config import RunConfig
from leanstep.training.data import BatchSampler

__all__ = ["StepLoop", "applied_updates", "compile_in_background", "compiling_evaluation", "evaluate",
           "place_eval_batch", "step_batch"]


@dataclasses.dataclass(frozen=True)
class StepLoop:
    """What the step loop works with; built by :func:`leanstep.training.train`."""

    config: RunConfig
    checkpointer: Checkpointer | None  # None until the run directory is open
    metrics_path: Path | None  # None: another process writes the metrics
    step_fn: Callable[[TrainState, Any], tuple[TrainState, Any]]
    eval_fn: Callable[[Any, Any], jax.Array]
    sampler: BatchSampler
    eval_data: list[Any]
    schedule: Callable[[Any, Any], Any]  # schedule(applied_updates, steps)
    emit: Callable[..., None]
    mesh: Mesh | None  # shard each batch over it (None: one device, unsharded)
    origin: float  # time.perf_counter() when train() began: records' elapsed_s count from here
    eval_ready: Callable[[], None] = lambda: None  # waits for eval_fn's compile (compile_in_background)


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
    return {k: jax.make_array_from_callback(v.shape, replicated, lambda index, v=v: v[index]) for k, v in batch.items()}


def applied_updates(opt_state: Any) -> int:
    """The optimizer's update count (it does not advance on skipped steps), which drives the schedule."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return int(counts[0][1]) if counts else 0


def compile_in_background(jitted: Any, *args: Any) -> Callable[[], None]:
    """Compiles ``jitted`` for ``args`` on a thread while the caller goes on; returns ``wait()``.

    XLA compiles without holding the GIL, so the run's evaluation compiles beside its train
    step instead of at the first evaluation. ``jitted(*args)`` then finds the executable in
    ``jit``'s cache. ``args`` only give shapes, dtypes and shardings (pass
    ``jax.ShapeDtypeStruct`` for arrays another call may donate meanwhile). A compile that
    fails is dropped: the first real call compiles again and raises the error itself. The
    thread then imports matplotlib for the run's chart, which would otherwise take its
    second at the end of the run, inside a time budget.
    """
    def compile_quietly() -> None:
        try:
            jitted.lower(*args).compile()
        except Exception:  # noqa: BLE001 - reported by the real call, where it belongs
            pass
        with contextlib.suppress(Exception):  # noqa: BLE001 - a broken matplotlib is the chart's to report
            import leanstep.training.curves  # noqa: F401

    thread = threading.Thread(target=compile_quietly, name="leanstep-compile", daemon=True)
    thread.start()
    return thread.join


def compiling_evaluation(loop: StepLoop, params: Any) -> StepLoop:
    """``loop``, its evaluation compiling in the background from now (:func:`compile_in_background`).

    The compile works from a shape-only stand-in of ``params`` (the step donates the state),
    placed as the step's params are: uncommitted on one device, else on the mesh.
    """
    if not loop.eval_data:
        return loop
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None if loop.mesh is None
                                                           else x.sharding), params)
    return dataclasses.replace(loop, eval_ready=compile_in_background(loop.eval_fn, abstract, loop.eval_data[0]))
