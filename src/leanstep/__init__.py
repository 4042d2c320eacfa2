"""leanstep: lean, robust JAX training steps.

bf16 compute on float32 master weights with a dynamic loss scale, gradient
accumulation over microbatches inside one jitted step, clipping by the global
gradient norm, and rematerialization, composed in the right order by
:func:`make_train_step`. The seed contracts live in :mod:`leanstep.tasks`.
"""

from leanstep.accumulation import microbatched_value_and_grad, split_microbatches
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
from leanstep.precision import Precision, get_precision, strict_precision
from leanstep.remat import (
    REMAT_POLICIES,
    ResidualReport,
    checkpoint_name,
    get_remat_policy,
    remat,
    saved_residuals_report,
)
from leanstep.step import StepMetrics, TrainState, make_train_step

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Precision",
    "REMAT_POLICIES",
    "ResidualReport",
    "RestoreResult",
    "StaticLossScale",
    "StepMetrics",
    "TrainState",
    "all_finite",
    "checkpoint_name",
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "get_loss_scale",
    "get_precision",
    "get_remat_policy",
    "global_norm",
    "make_train_step",
    "microbatched_value_and_grad",
    "remat",
    "saved_residuals_report",
    "split_microbatches",
    "strict_precision",
]
