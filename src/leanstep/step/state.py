"""What a training run carries from one step to the next, and what one step reports.

The state types every stage works on, in a module that depends only on the building blocks and what
stands below it (the spec, the parameter checks, the one-program initializer), so that every stage
can import it and none import each other in a circle. The state carries its own part of the step
(optimizer, masters' and moments' formats, spike guard: static fields), which a step reads from it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from leanstep.blocks.fp8_state import merge_fp8, split_fp8
from leanstep.blocks.loss_scale import LossScale
from leanstep.blocks.masters import master_dtype
from leanstep.blocks.moments import compress_moments
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.common.checks import check_optimizer, is_int
from leanstep.step.param_checks import check_params
from leanstep.step.spec import StepSpec
from leanstep.step.state_init import check_init, check_shardings, initial_params, make_in_one_program

__all__ = ["StepMetrics", "TrainState"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "step",
        "params",
        "opt_state",
        "loss_scale",
        "rng",
        "consecutive_skips",
        "model_state",
        "master_error",
        "spike",
    ],
    meta_fields=["optimizer", "master", "spike_guard", "moments"],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run carries from one step to the next, as one pytree.

    The optimizer is given once, to :meth:`create`, and travels with the state as static
    pytree metadata (as in flax's ``TrainState``): the step takes it from here, and
    ``jax.jit`` treats two different optimizers as two different programs.

    Attributes:
      step: int32 count of steps taken, skipped ones included (it indexes the data and, with
        ``uses_rng``, the keys). It saturates at ``2**31 - 1`` rather than wrap: every step from
        there leaves it there, draws the same keys as every other such step, and reports
        ``StepMetrics.step_saturated``.
      params: the float32 master parameters, and the model's FP8 state if it has any
        (:mod:`leanstep.blocks.fp8_state`: under :class:`leanstep.blocks.Fp8Meta` or ``Fp8Collection``
        nodes; written by the step, never by the optimizer).
      opt_state: the optax optimizer's state, of the trainable parameters (FP8 state left
        out); it does not advance on a skipped step.
      loss_scale: a :class:`DynamicLossScale`, :class:`StaticLossScale` or
        :class:`NoOpLossScale`.
      rng: a ``uint32[2]`` PRNG key; microbatch ``j`` of step ``t`` gets
        ``fold_in(fold_in(rng, t), j)`` (with ``uses_rng``).
      consecutive_skips: int32 count of non-finite steps in a row (saturating).
      model_state: the model's non-trainable state (batch statistics, counters, a model's own
        RNG state), or None. The optimizer never sees it, it is never cast to the compute
        dtype, and a skipped step leaves it unchanged (``make_train_step(has_state=True)``).
      optimizer: the ``optax.GradientTransformation`` (static); with compressed moments, wrapped
        by :func:`leanstep.blocks.compress_moments`.
      master: how the masters are kept (static): ``"float32"``, or bfloat16 with stochastic
        rounding, ``"bfloat16-sr"`` or ``"bfloat16-sr-kahan"`` (:mod:`leanstep.blocks.masters`).
      master_error: the compensated-summation buffer of ``"bfloat16-sr-kahan"`` (bfloat16, shaped
        like the trainable parameters), else None.
      spike: the window of the state's spike guard (a ``SpikeState``), else None.
      spike_guard: the :class:`leanstep.SpikeGuard` (static) that skips a finite step whose loss (or
        norms) leaps past the window ``spike``, or None; the step takes it from here.
      moments: the format the optimizer's moments are kept in (static): ``"float32"``, ``"bfloat16"``
        or ``"int8"`` (``optimizer`` is then wrapped by :func:`leanstep.blocks.compress_moments`).

    A checkpoint holds the arrays alone: one saved before 0.12 restores into a template built with
    its spec, whose static fields it takes.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale
    rng: jax.Array
    consecutive_skips: jax.Array
    model_state: Any
    optimizer: optax.GradientTransformation
    master_error: Any = None
    spike: Any = None
    master: Any = "float32"
    spike_guard: SpikeGuard | None = None
    moments: str = "float32"

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: optax.GradientTransformation,
        spec: StepSpec | None = None,
        *,
        seed: int = 0,
        model_state: Any = None,
        **short: Any,
    ) -> TrainState:
        """Builds the state at step 0.

        The master weights are float32 whatever the dtype of ``params``: bfloat16 and float16
        leaves are widened exactly, float64 ones (under ``jax_enable_x64``) are rounded to
        float32. A train step refuses a precision whose params dtype is not float32
        (:func:`leanstep.blocks.precision.check_train_precision`), so no policy can say otherwise.

        Args:
          params: a pytree of concrete floating-point arrays; they are stored as float32 masters.
          optimizer: any ``optax.GradientTransformation``; its ``init`` builds ``opt_state``
            and the train step applies it.
          spec: the step's :class:`leanstep.StepSpec`, whose ``loss_scale``, ``master``,
            ``moments`` and ``spike_guard`` the state is built with and carries (the step reads them
            from the state); None: built from ``short``.
          seed: the seed of ``rng``, an int in ``[0, 2**32 - 1]`` (``[0, 2**63 - 1]`` under
            ``jax_enable_x64``): without x64 a PRNG key keeps 32 bits of the seed, so a wider
            seed would give the run of another.
          model_state: a pytree of arrays the model carries besides its parameters (kept in
            its own dtypes), or None.
          **short: in place of ``spec``, its four fields as keywords: ``loss_scale``
            (``"dynamic"``, ``"none"``, a number (static) or a loss-scale instance, kept as it
            is), ``master`` (``"float32"``, or bfloat16 with stochastic rounding,
            ``"bfloat16-sr"`` or ``"bfloat16-sr-kahan"``; round-to-nearest bfloat16 is refused),
            ``moments`` (``"float32"``, ``"bfloat16"`` or ``"int8"``:
            :func:`leanstep.blocks.compress_moments` wraps ``optimizer``) and ``spike_guard`` (a
            :class:`leanstep.SpikeGuard`, which the state carries, with its empty window).

        Raises:
          TypeError: a parameter leaf is not a floating-point array (a framework's
            non-parameter variables among them are named, with the split to use) or is a
            ``jax.ShapeDtypeStruct``, ``optimizer`` is not a hashable ``GradientTransformation``,
            ``seed`` is not an int, ``loss_scale`` is neither a name nor a loss scale, a
            ``model_state`` leaf is not a concrete array, a keyword that is none of the four, or a
            spec and keywords both.
          ValueError: ``params`` has no leaves, ``seed`` is out of range, or ``master`` or
            ``moments`` is not one of their forms (plain bfloat16 masters: why, and what works).

        Example:
          >>> import jax.numpy as jnp, optax
          >>> state = TrainState.create({"w": jnp.ones(3)}, optax.sgd(0.1), loss_scale="dynamic")
          >>> int(state.step), state.params["w"].dtype, float(state.loss_scale.loss_scale)
          (0, dtype('float32'), 32768.0)
        """
        spec, loss_scale = _checked_arguments(optimizer, spec, short, seed=seed, model_state=model_state)
        check_params(params)
        master, spike_guard = spec.master, spec.spike_guard
        optimizer = compress_moments(optimizer, spec.moments)  # the optimizer itself for "float32"
        params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        trainable, fp8 = split_fp8(params)  # the optimizer and the masters' format: trainable only
        kept = jax.tree.map(lambda p: p.astype(master_dtype(master)), trainable)
        error = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), trainable) if "kahan" in str(master) else None
        state = cls(
            step=jnp.zeros((), jnp.int32),
            params=merge_fp8(kept, fp8),
            opt_state=optimizer.init(trainable),  # of float32 values: moments float32 unless compressed
            loss_scale=loss_scale,
            rng=jax.random.key_data(jax.random.key(seed)),
            consecutive_skips=jnp.zeros((), jnp.int32),
            model_state=jax.tree.map(jnp.asarray, model_state),
            optimizer=optimizer,
            master_error=error,
            spike=None if spike_guard is None else spike_guard.init(),
            master=master,
            spike_guard=spike_guard,
            moments=spec.moments,
        )
        # One buffer per leaf: the step donates the state, and XLA refuses to donate a buffer
        # that two leaves share (the caller's params, or counters built from one zeros array).
        return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), state)

    @classmethod
    def create_from(
        cls,
        init: Callable[[], Any],
        optimizer: optax.GradientTransformation,
        spec: StepSpec | None = None,
        *,
        seed: int = 0,
        model_state: Any = None,
        shardings: Any = None,
        **short: Any,
    ) -> TrainState:
        """Builds the state at step 0 from the model's initializer, in one compiled program.

        ``init()`` and :meth:`create` run inside one ``jax.jit`` program whose outputs are the
        state alone, so the float32 parameters never exist outside it. Made eagerly,
        ``create(init(), ...)`` holds them in the caller's variable beside the state: with
        ``master="bfloat16-sr", moments="int8"`` 4 bytes a parameter beside a state of about 4,
        out of memory at the first step for 1.31B parameters on a 16 GiB TPU v5e, which this
        fits (docs/lean-state.md). The values are those of ``create(jax.jit(init)(), optimizer,
        spec, seed=seed, model_state=model_state)``, bit for bit; of ``create(init(), ...)`` too
        where XLA computes ``init`` as op by op (the built-in models' initializers), though a
        compiled initializer may round an ulp apart (``normal(key, shape) * 0.1``: XLA folds the
        two constant factors into one).

        Args:
          init: a zero-argument callable that returns the parameters (a pytree of floating
            arrays), e.g. ``functools.partial(init_fn, key)`` or ``lambda: model.init(key)``.
          optimizer: as :meth:`create`'s.
          spec: as :meth:`create`'s.
          seed: as :meth:`create`'s.
          model_state: as :meth:`create`'s; an argument of the program, not a constant of it.
          shardings: the state's ``jax.sharding.Sharding`` per leaf (as
            :func:`leanstep.step.state_sharding.state_shardings` gives for a mesh, of a state made
            with the same optimizer: it is the state's static metadata), or one for
            every leaf: the program's ``out_shardings``, so each device makes only its shards.
            None: jit's default placement.
          **short: as :meth:`create`'s, in place of ``spec``.

        Raises:
          TypeError: ``init`` is not a zero-argument callable, or returns a leaf that is not a
            floating array (a ``jax.ShapeDtypeStruct`` among them), a leaf of ``shardings`` is
            not a ``Sharding``, or any of :meth:`create`'s.
          ValueError: ``init`` returns no leaves, or any of :meth:`create`'s.

        Example:
          >>> import functools, jax, optax
          >>> def init_fn(key, width):
          ...     return {"w": jax.random.normal(key, (width, width))}
          >>> init = functools.partial(init_fn, jax.random.key(0), 4)
          >>> state = TrainState.create_from(init, optax.adam(1e-3), master="bfloat16-sr", moments="int8")
          >>> state.params["w"].dtype, type(state.opt_state[0].mu["w"]).__name__
          (dtype(bfloat16), 'QuantizedArray')
        """
        check_init(init)
        _checked_arguments(optimizer, spec, short, seed=seed, model_state=model_state)
        if shardings is not None:
            check_shardings(shardings)

        def make(model_state: Any) -> TrainState:
            params = initial_params(init)
            return cls.create(params, optimizer, spec, seed=seed, model_state=model_state, **short)

        return make_in_one_program(make, model_state, shardings)

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def _checked_arguments(
    optimizer: Any, spec: StepSpec | None, short: dict[str, Any], *, seed: Any, model_state: Any
) -> tuple[StepSpec, LossScale]:
    """The checks of :meth:`TrainState.create` but of ``params``: the spec it builds from and the initial loss scale."""
    check_optimizer(optimizer)
    try:
        hash(optimizer)
    except TypeError:
        raise TypeError(
            "optimizer must be hashable: it is static metadata of the state, so jax.jit can "
            "tell two optimizers apart; build it from optax transformations"
        ) from None
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    bits = 63 if jax.config.jax_enable_x64 else 32  # type: ignore[attr-defined]  # jax adds its options at run time
    if not 0 <= seed <= 2**bits - 1:
        raise ValueError(
            f"seed must be an int in [0, 2**{bits} - 1], got {seed!r}"
            + ("" if bits == 63 else "; a PRNG key keeps 32 bits of the seed without jax_enable_x64")
        )
    spec, loss_scale = _spec_of(spec, short)
    for path, leaf in jax.tree_util.tree_leaves_with_path(model_state):
        where = f"model_state{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"{where} is a jax.ShapeDtypeStruct (a shape without values); TrainState.create needs concrete arrays"
            )
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            raise TypeError(f"{where} is a {type(leaf).__name__}; the model state must be a pytree of arrays")
    return spec, loss_scale


#: The keywords :meth:`TrainState.create` takes in place of a spec: the state's fields of a :class:`StepSpec`.
_STATE_KEYWORDS = ("loss_scale", "master", "moments", "spike_guard")


def _spec_of(spec: StepSpec | None, short: dict[str, Any]) -> tuple[StepSpec, LossScale]:
    """The spec :meth:`TrainState.create` builds from, and the initial loss scale (a loss-scale
    instance given as a keyword is kept as it is: its counters, or its own class)."""
    unknown = sorted(set(short) - set(_STATE_KEYWORDS))
    if unknown:
        raise TypeError(
            f"TrainState.create() got an unexpected keyword argument {unknown[0]!r}; it takes a spec or "
            f"{', '.join(_STATE_KEYWORDS)}"
        )
    if spec is not None:
        if not isinstance(spec, StepSpec):
            raise TypeError(f"spec must be a leanstep.StepSpec or None, got {type(spec).__name__}")
        if short:
            raise TypeError(
                f"TrainState.create got a spec and the keywords {', '.join(sorted(short))}: give them once, in "
                "the spec (spec.replace(...)) or as keywords"
            )
        return spec, spec.loss_scale.make()
    given = short.get("loss_scale", "none")
    if not isinstance(given, (str, LossScale)):  # a number is a static scale in a StepSpec, not here (0.11's form)
        raise TypeError(
            f"loss_scale must be 'dynamic', 'static', 'none' or a LossScale (e.g. "
            f"leanstep.StaticLossScale.create(1024.0)), got {type(given).__name__} {given!r}"
        )
    kept = given if isinstance(given, LossScale) else None
    spec = StepSpec.from_keywords(**{**short, "loss_scale": "none" if kept is not None else given})
    return spec, spec.loss_scale.make() if kept is None else kept


class StepMetrics(NamedTuple):
    """What one step reports, as device arrays (reading them is the caller's host sync).

    Attributes:
      loss: float32, the unscaled loss of the whole batch.
      grad_norm: float32, the global norm of the accumulated, unscaled gradient, before clipping.
      loss_scale: float32, the scale this step used.
      skipped: bool, the gradient was not finite and nothing was applied.
      clipped: bool, the gradient norm exceeded ``max_grad_norm``.
      consecutive_skips: int32, non-finite steps in a row, this one included.
      aux: the loss function's auxiliary output stacked over microbatches, or None.
      spiked: bool, the step was finite and skipped for a spike (:class:`leanstep.SpikeGuard`).
      step_saturated: bool, ``state.step`` was already ``2**31 - 1``, so it did not count this
        step; with ``uses_rng`` every such step draws the same keys (without this, a run past
        2**31 steps would go on with no sign of it).
    """

    loss: jax.Array
    grad_norm: jax.Array
    loss_scale: jax.Array
    skipped: jax.Array
    clipped: jax.Array
    consecutive_skips: jax.Array
    aux: Any = None
    spiked: Any = None
    step_saturated: Any = None
