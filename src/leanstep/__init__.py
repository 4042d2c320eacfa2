"""leanstep: lean, robust JAX training steps.

bf16 compute on float32 master weights with a dynamic loss scale, gradient
accumulation over microbatches inside one jitted step, clipping by the global
gradient norm, and rematerialization, composed in the right order by
:func:`make_train_step`. The seed contracts live in :mod:`leanstep.tasks`.
"""

from leanstep.accumulation import microbatched_value_and_grad, split_microbatches
from leanstep.audit import AuditReport, audit
from leanstep.checkpoint import CheckpointError, Checkpointer, RestoreResult
from leanstep.clipping import clip_by_global_norm, clip_by_global_norm_transform, global_norm
from leanstep.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    get_loss_scale,
)
from leanstep.plan import BudgetError, Plan, plan
from leanstep.precision import Precision, get_precision, strict_precision
from leanstep.remat import (
    REMAT_POLICIES,
    ResidualReport,
    checkpoint_name,
    get_remat_policy,
    remat,
    saved_residuals_report,
)
from leanstep.sharding import (
    batch_sharding,
    data_mesh,
    fsdp_partition_spec,
    shard_batch,
    shard_train_state,
    split_strided_microbatches,
    state_shardings,
)
from leanstep.step import StepMetrics, TrainState, make_train_step

__version__ = "0.1.0"

__all__ = [
    "AuditReport",
    "BudgetError",
    "CheckpointError",
    "Checkpointer",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Plan",
    "Precision",
    "REMAT_POLICIES",
    "ResidualReport",
    "RestoreResult",
    "StaticLossScale",
    "StepMetrics",
    "TrainState",
    "all_finite",
    "audit",
    "batch_sharding",
    "checkpoint_name",
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "data_mesh",
    "fsdp_partition_spec",
    "get_loss_scale",
    "get_precision",
    "get_remat_policy",
    "global_norm",
    "make_train_step",
    "microbatched_value_and_grad",
    "plan",
    "remat",
    "saved_residuals_report",
    "shard_batch",
    "shard_train_state",
    "split_microbatches",
    "split_strided_microbatches",
    "state_shardings",
    "strict_precision",
]
