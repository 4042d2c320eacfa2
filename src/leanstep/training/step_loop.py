"""The parts the step loop of :func:`leanstep.training.train` works with, and small helpers on them."""

from __future__ import annotations

import dataclasses
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

__all__ = ["StepLoop", "applied_updates", "evaluate", "place_eval_batch", "step_batch"]


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


def step_batch(loop: StepLoop, step: int) -> Any:
    """The batch of ``step``, placed on the run's devices."""
    batch = loop.sampler.batch_at(step)
    return batch if loop.mesh is None else shard_batch(batch, loop.mesh)


def evaluate(loop: StepLoop, params: Any) -> float:
    """The mean held-out loss (nats per byte) of ``params``."""
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
