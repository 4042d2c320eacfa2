"""A :class:`RunConfig` made into the parts a run trains with, in one place: :func:`build_run`.

``leanstep train``, ``plan``, ``audit`` and ``bench`` all build their model, optimizer, loss
scale, loss function and step from a config here, so the four cannot drift apart; the
planner and the auditor themselves see only those parts, never a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.blocks.layer_stack import LayerStack
from leanstep.blocks.loss_scale import LossScale
from leanstep.blocks.precision import Precision
from leanstep.blocks.rematerialization import check_saved_names
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.models import Model, build_model
from leanstep.step.sharding_layer import ShardingLayer
from leanstep.step.spec import StepSpec
from leanstep.step.state import TrainState
from leanstep.step.state_sharding import state_shardings
from leanstep.step.train_step import JittedTrainStep, make_train_step
from leanstep.training.config import RunConfig, in_backward_refusal, model_overrides
from leanstep.training.machine_size import choose_for_machine
from leanstep.training.optimizers import run_optimizer
from leanstep.training.schedule import Schedule, make_schedule

__all__ = ["Run", "build_optimizer", "build_run"]


def build_optimizer(config: RunConfig) -> tuple[optax.GradientTransformation, Schedule]:
    """``config.optimizer`` (AdamW, b1 0.9, b2 0.95; or Muon for the layers' matrices:
    :mod:`leanstep.training.optimizers`) under the configured schedule; returns it and ``schedule(count, total)``.

    The schedule's length, ``total``, is kept in the optimizer state
    (:func:`leanstep.training.schedule.scale_by_run_schedule`): ``config.steps``, or 0 until a
    run sized by ``--time-budget`` has been planned and sets it, so the compiled step does not
    depend on it. AdamW's updates are optax's ``adamw``: Adam's direction plus the decoupled weight
    decay, times the scheduled learning rate.

    Example:
      >>> optimizer, schedule = build_optimizer(RunConfig(steps=100, warmup_steps=10))
      >>> float(schedule(0, 100)), float(schedule(10, 100)), round(float(schedule(100, 100)), 6)
      (0.0, 0.003, 0.0003)
    """
    schedule = make_schedule(config.schedule, config.lr, config.warmup_steps)
    optimizer = run_optimizer(
        config.optimizer, schedule, lr=config.lr, weight_decay=config.weight_decay, total=config.steps or 0
    )
    return optimizer, schedule


@dataclasses.dataclass(frozen=True)
class Run:
    """The parts of a run (see :func:`build_run`).

    Attributes:
      config: the validated config.
      model: the model, its config bound.
      optimizer: the run's optimizer (``--optimizer``) under the schedule.
      schedule: the learning rate, ``schedule(applied_updates, total_steps)``.
      precision: the mixed-precision policy.
      loss_scale: the initial loss scale.
      precision_reason: why ``--precision auto`` chose the policy (None: the config named it).
      size_reason: why ``--size auto`` sized the run so (None: not sized for the machine).
    """

    config: RunConfig
    model: Model
    optimizer: optax.GradientTransformation
    schedule: Schedule
    precision: Precision
    loss_scale: LossScale
    precision_reason: str | None = None
    size_reason: str | None = None

    def loss_fn(self, remat: str | None = None) -> Callable[[Any, Any], Any]:
        """``loss_fn(params, batch)`` of the model under remat policy ``remat`` (default: the config's);
        with ``--update-in-backward on``, the model's :meth:`layer_stack`, which no remat applies to."""
        if self.step.update_in_backward:
            stack = self.layer_stack()
            if stack is None:  # validate() refused it, naming the flag
                raise ValueError(f"--update-in-backward on: {in_backward_refusal(self.config)}")
            return stack
        policy = self.config.remat if remat is None else remat
        return lambda params, batch: self.model.loss(params, batch, remat_policy=policy)

    def layer_stack(self) -> LayerStack | None:
        """The model's loss as a :class:`leanstep.LayerStack`, as the run's loss contract says
        (a mean, or token-weighted), or None where the update inside the backward pass cannot
        take the run (:func:`leanstep.training.config.in_backward_refusal`)."""
        if self.model.stack is None or in_backward_refusal(self.config) is not None:
            return None
        return self.model.stack(token_weighted=self.step.loss.token_weighted)

    def batch_spec(self, batch_size: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """The stand-in of one batch (default: the config's batch size): int32 tokens ``(B, T + 1)``."""
        rows = self.config.batch_size if batch_size is None else batch_size
        return {"tokens": jax.ShapeDtypeStruct((rows, self.config.seq_len + 1), np.int32)}

    def init_params(self) -> Any:
        """The model's float32 parameters from the config's seed."""
        return self.model.init(jax.random.key(self.config.seed))

    def abstract_params(self) -> Any:
        """Shapes and dtypes of :meth:`init_params`, without computing them."""
        return jax.eval_shape(self.init_params)

    def init_state(self, params: Any = None, *, shardings: Any = None) -> TrainState:
        """The step-0 :class:`TrainState` (of ``params``, default :meth:`init_params`); without
        ``params``, laid out by ``shardings`` (a sharding per leaf) as it is made, in its shards.

        Without ``params`` the state is built by one compiled call,
        :meth:`TrainState.create_from`: the float32 parameters never exist beside the state
        (which at 1.31B parameters on a 16 GiB chip is the difference between out of memory
        and training), and op by op the initializers and the optimizer's ``init`` would
        dispatch (and compile) hundreds of small operations, ~2 s of a run's start for the
        0.4M-parameter default transformer against ~0.6 s compiled (measured on the 2-core
        CPU). The values are the op-by-op ones, bit for bit (``tests/test_startup.py`` checks
        three configs).
        """
        if params is None:
            return TrainState.create_from(
                self.init_params, self.optimizer, self.step, seed=self.config.seed, shardings=shardings
            )
        return self._state_of(params)

    def _state_of(self, params: Any) -> TrainState:
        # The step's spec: its loss scale, masters, moments and spike guard (the layout is the step's).
        return TrainState.create(params, self.optimizer, self.step, seed=self.config.seed)

    @property
    def step(self) -> StepSpec:
        """The run's :class:`leanstep.StepSpec` (``run.config.step``: the flags parsed once)."""
        return self.config.step

    @property
    def spike_guard(self) -> SpikeGuard | None:
        """The run's :class:`leanstep.SpikeGuard` (``--spike-guard``), or None."""
        return self.step.spike_guard

    def abstract_state(self) -> TrainState:
        """Shapes and dtypes of :meth:`init_state`, without computing it."""
        return jax.eval_shape(self.init_state, self.abstract_params())

    def initial_state(self, mesh: Mesh | None = None) -> TrainState:
        """The step-0 state, placed as a restored one is (so that a new run and a resumed one share
        programs): over ``mesh`` made in its shards (:meth:`TrainState.create_from`: no device holds
        the whole state), the shardings a checkpoint restores into; else committed to JAX's first device."""
        if mesh is None:
            return jax.device_put(self.init_state(), jax.devices()[0])
        shardings = state_shardings(self.abstract_state(), mesh, fsdp=self.config.fsdp, rules=self.model.rules)
        return self.init_state(shardings=shardings)

    def eval_fn(self, mesh: Mesh | None = None) -> jax.stages.Wrapped:
        """The held-out loss of params on a batch, jitted; over ``mesh``, replicated: one scalar every
        process can read."""
        return jax.jit(
            lambda params, batch: self.model.loss(self.precision.cast_to_compute(params), batch),
            out_shardings=None if mesh is None else NamedSharding(mesh, PartitionSpec()),
        )

    def make_step(self, *, mesh: Mesh | None = None) -> JittedTrainStep:
        """The run's jitted train step, of :attr:`step` (laid out over ``mesh``, if given)."""
        spec = self.config.step_spec(sharded=mesh is not None)
        layout, layer = spec.sharding, None
        if mesh is not None and layout is not None:  # the spec's layout, with the model's partition rules
            layer = ShardingLayer(mesh, fsdp=layout.fsdp, rules=self.model.rules, reduce=layout.reduce)
        return make_train_step(self.loss_fn(), spec, mesh=layer)


def build_run(config: RunConfig) -> Run:
    """Validates ``config`` and builds its model, optimizer, schedule, precision and loss scale.

    ``size="auto"`` and ``precision="auto"`` are resolved here, for the device JAX runs on
    (:func:`leanstep.training.machine_size.choose_for_machine`): the run's ``config`` names the
    size and policy chosen, ``size_reason`` and ``precision_reason`` say why.

    Raises:
      ValueError: an invalid config, naming the flag.

    Example:
      >>> run = build_run(RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, microbatches=2))
      >>> run.model.name, run.batch_spec()["tokens"].shape, type(run.loss_scale).__name__
      ('mlp', (4, 9), 'DynamicLossScale')
      >>> run.abstract_state().params["embed"].shape  # shapes only: nothing is computed
      (256, 16)
    """
    choice = choose_for_machine(config)
    config = choice.config  # the step's flags parsed once, by validate()
    spec = config.step
    # the model's FP8 or int8 matmuls: the step's recipe
    recipe = {name: value for name, value in (("fp8", spec.fp8), ("int8", spec.int8)) if value is not None}
    model = build_model(config.model, config.size, **recipe, **model_overrides(config))
    optimizer, schedule = build_optimizer(config)
    run = Run(
        config,
        model,
        optimizer,
        schedule,
        spec.precision,
        spec.loss_scale.make(),
        choice.precision_reason,
        choice.size_reason,
    )
    if "save:" in config.remat and not spec.update_in_backward:  # every name saved is one the model tags
        microbatch = run.batch_spec(config.batch_size // config.microbatches)
        try:
            check_saved_names(
                jax.make_jaxpr(run.loss_fn())(run.abstract_params(), microbatch), f"--model {config.model}"
            )
        except ValueError as error:
            raise ValueError(f"--remat {config.remat}: {error}") from None
    return run
