"""The train step: its state, its three stages, and their composition.

.. code-block:: text

    state.py           TrainState, StepMetrics: what a run carries from step to step
    param_checks.py    what may be trained as parameters
    loss_contract.py   LossContract: what the loss takes and returns, parsed once
    gradients.py       stage 1, gradient_stage: cast, microbatch, accumulate
    update.py          stage 2, guarded_update: unscale, check, clip, apply or skip
    state_sharding.py  where a train state lives on a mesh
    sharding_layer.py  stage 3, ShardingLayer: both stages over a mesh, one reduction
    train_step.py      make_train_step: the three composed, jitted, inputs checked
"""

from leanstep.step.gradients import Gradients, gradient_stage
from leanstep.step.sharding_layer import REDUCTIONS, ShardingLayer
from leanstep.step.state import StepMetrics, TrainState
from leanstep.step.state_sharding import shard_train_state, state_shardings
from leanstep.step.train_step import JittedTrainStep, make_train_step
from leanstep.step.update import GuardedState, UpdateInfo, guarded_update, guarded_update_transform

__all__ = [
    "REDUCTIONS",
    "Gradients",
    "GuardedState",
    "JittedTrainStep",
    "ShardingLayer",
    "StepMetrics",
    "TrainState",
    "UpdateInfo",
    "gradient_stage",
    "guarded_update",
    "guarded_update_transform",
    "make_train_step",
    "shard_train_state",
    "state_shardings",
]
