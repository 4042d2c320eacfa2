"""The train step: its state, its three stages, and their composition.

.. code-block:: text

    state.py           TrainState, StepMetrics: what a run carries from step to step
    param_checks.py    what may be trained as parameters
    state_init.py      TrainState.create_from: the step-0 state made in one program from init
    gradients.py       stage 1, gradient_stage: cast, microbatch, accumulate
    update/            stage 2, guarded_update: unscale, check, clip, apply or skip; chunked; offload_opt_state
    state_sharding.py  where a train state lives on a mesh
    sharding_layer.py  stage 3, ShardingLayer: both stages over a mesh, one reduction
    spec.py            StepSpec: every setting of a step as one value, checked once, to and from JSON
    spec_parts.py      LossScaleSpec, MeshLayout: the spec's loss scale and layout, as data; a part's JSON read
    settings.py        StepSettings: a spec placed on its mesh (the layer), the mesh's refusals
    train_step.py      make_train_step: the three composed, jitted, inputs checked
    layer_passes.py    a LayerStack loss's forward and backward passes, a layer at a time, layer-major
    layerwise.py       the update inside the backward pass (StepSpec.update_in_backward)

What the loss takes and returns (:class:`leanstep.LossContract`) and how the batch is walked
(:class:`leanstep.Accumulation`) are building blocks: :mod:`leanstep.blocks`.
"""

from leanstep.step.gradients import Gradients, gradient_stage
from leanstep.step.settings import StepSettings, step_settings
from leanstep.step.sharding_layer import REDUCTIONS, ShardingLayer
from leanstep.step.spec import LossScaleSpec, MeshLayout, StepSpec
from leanstep.step.state import StepMetrics, TrainState
from leanstep.step.state_sharding import shard_train_state, state_shardings
from leanstep.step.train_step import JittedTrainStep, make_train_step
from leanstep.step.update import GuardedState, UpdateInfo, guarded_update, guarded_update_transform, offload_opt_state

__all__ = [
    "REDUCTIONS",
    "Gradients",
    "GuardedState",
    "JittedTrainStep",
    "LossScaleSpec",
    "MeshLayout",
    "ShardingLayer",
    "StepMetrics",
    "StepSettings",
    "StepSpec",
    "TrainState",
    "UpdateInfo",
    "gradient_stage",
    "guarded_update",
    "guarded_update_transform",
    "make_train_step",
    "offload_opt_state",
    "shard_train_state",
    "state_shardings",
    "step_settings",
]
