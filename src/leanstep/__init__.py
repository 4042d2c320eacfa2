"""leanstep: lean, robust JAX training steps.

bf16 compute on float32 master weights with a dynamic loss scale, gradient
accumulation over microbatches inside one jitted step, clipping by the global
gradient norm, and rematerialization, composed in the right order by
:func:`make_train_step`. The seed contracts live in :mod:`leanstep.tasks`.
"""

from leanstep.accumulation import microbatched_value_and_grad
from leanstep.auditing import AuditReport, audit
from leanstep.checkpoint import Checkpointer, CheckpointError, RestoreResult
from leanstep.clipping import (
    clip_by_global_norm,
    clip_by_global_norm_transform,
    global_norm,
)
from leanstep.collectives import Collective, CollectivesReport, collectives_report
from leanstep.compile_cache import disable_compile_cache, enable_compile_cache
from leanstep.compile_count import CompileCount
from leanstep.compute_dtype_check import PrecisionWarning
from leanstep.cost_model import ACCELERATORS, Accelerator, get_accelerator
from leanstep.gradients import Gradients, gradient_stage
from leanstep.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)
from leanstep.loss_scale_registry import get_loss_scale
from leanstep.microbatches import (
    SPLITS,
    get_splitter,
    presplit_microbatches,
    split_microbatches,
    split_strided_microbatches,
)
from leanstep.model_sharding import constrain, gathered, sharding_context
from leanstep.partition_rules import MeshAxes, param_specs
from leanstep.planning import BudgetError, Plan, plan
from leanstep.precision import Precision, get_precision
from leanstep.rematerialization import (
    REMAT_POLICIES,
    checkpoint_name,
    get_remat_policy,
    remat,
)
from leanstep.residuals import ResidualReport, saved_residuals_report
from leanstep.rounding import strict_precision
from leanstep.sharding import (
    batch_sharding,
    data_mesh,
    fsdp_partition_spec,
    mesh_axes,
    shard_batch,
    shard_train_state,
    state_shardings,
)
from leanstep.sharding_layer import REDUCTIONS, ShardingLayer
from leanstep.state import StepMetrics, TrainState
from leanstep.step import make_train_step
from leanstep.update import (
    GuardedState,
    UpdateInfo,
    guarded_update,
    guarded_update_transform,
)

__version__ = "0.7.0"

__all__ = [
    "ACCELERATORS",
    "REDUCTIONS",
    "REMAT_POLICIES",
    "SPLITS",
    "Accelerator",
    "AuditReport",
    "BudgetError",
    "CheckpointError",
    "Checkpointer",
    "Collective",
    "CollectivesReport",
    "CompileCount",
    "DynamicLossScale",
    "Gradients",
    "GuardedState",
    "LossScale",
    "MeshAxes",
    "NoOpLossScale",
    "Plan",
    "Precision",
    "PrecisionWarning",
    "ResidualReport",
    "RestoreResult",
    "ShardingLayer",
    "StaticLossScale",
    "StepMetrics",
    "TrainState",
    "UpdateInfo",
    "all_finite",
    "audit",
    "batch_sharding",
    "checkpoint_name",
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "collectives_report",
    "constrain",
    "data_mesh",
    "disable_compile_cache",
    "enable_compile_cache",
    "fsdp_partition_spec",
    "gathered",
    "get_accelerator",
    "get_loss_scale",
    "get_precision",
    "get_remat_policy",
    "get_splitter",
    "global_norm",
    "gradient_stage",
    "guarded_update",
    "guarded_update_transform",
    "make_train_step",
    "mesh_axes",
    "microbatched_value_and_grad",
    "param_specs",
    "plan",
    "presplit_microbatches",
    "remat",
    "saved_residuals_report",
    "shard_batch",
    "shard_train_state",
    "sharding_context",
    "split_microbatches",
    "split_strided_microbatches",
    "state_shardings",
    "strict_precision",
]
