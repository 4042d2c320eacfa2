"""One jitted train step: the gradient stage, then the guarded update, inside the sharding layer.

Size: the step's one public builder, the checks of its inputs and the wrapper that runs them belong
together; ``spec.update_in_backward`` hands the loss to :mod:`leanstep.step.layerwise` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, Protocol, overload

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from leanstep.blocks.fp8_state import split_fp8
from leanstep.blocks.masters import master_dtype
from leanstep.common.checks import INT32_MAX, check_bool, check_keywords
from leanstep.common.removed import refuses_removed_keywords
from leanstep.step.gradients import gradient_stage
from leanstep.step.layerwise import make_layerwise_step
from leanstep.step.settings import StepSettings, step_settings
from leanstep.step.sharding_layer import ShardingLayer, manual_constraint_error
from leanstep.step.spec import SHORT_KEYWORDS, StepSpec
from leanstep.step.state import StepMetrics, TrainState
from leanstep.step.update import guarded_update

__all__ = ["JittedTrainStep", "make_train_step"]


class JittedTrainStep(Protocol):
    """What :func:`make_train_step` returns with ``jit=True`` (the default): ``step(state, batch)``
    and the jitted function's ``lower``, ``trace`` and ``eval_shape``."""

    def __call__(self, state: TrainState, batch: Any, /) -> tuple[TrainState, StepMetrics]: ...

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered: ...

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced: ...

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any: ...


@overload
def make_train_step(
    loss_fn: Callable[..., Any],
    spec: StepSpec | None = ...,
    *,
    mesh: Mesh | ShardingLayer | None = ...,
    jit: Literal[True] = ...,
    **short: Any,
) -> JittedTrainStep: ...


@overload
def make_train_step(
    loss_fn: Callable[..., Any],
    spec: StepSpec | None = ...,
    *,
    mesh: Mesh | ShardingLayer | None = ...,
    jit: bool,
    **short: Any,
) -> Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]: ...


@refuses_removed_keywords("make_train_step")
def make_train_step(
    loss_fn: Callable[..., Any],
    spec: StepSpec | None = None,
    *,
    mesh: Mesh | ShardingLayer | None = None,
    jit: bool = True,
    **short: Any,
) -> JittedTrainStep | Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]:
    r"""Builds ``step(state, batch) -> (state, metrics)``: one compiled, correctly ordered train step.

    The order, which is the point of this function::

        p_c   = cast(params, compute_dtype)                  # masters stay float32
        for each microbatch m (one lax.scan):                # value_and_grad in the body
            l_m, g_m = value_and_grad(S * loss_fn)(p_c, m)
            G += float32(g_m)                                # float32 accumulator
        G = unscale(G / M)                                   # once, after accumulation
        finite = all entries of G finite                     # once, over the whole gradient
        n = global_norm(G); G *= min(1, c / n)               # clip the unscaled total
        params', opt' = optimizer(G)                         # applied only if finite:
        params, opt = finite ? (params', opt') : (params, opt)   # bit-identical on a skip
        S = adjust(S, finite)

    It is a composition of public stages: :func:`leanstep.step.gradient_stage` (the first four
    lines), :func:`leanstep.step.guarded_update` (the rest) and, with a ``mesh``,
    :class:`leanstep.step.ShardingLayer` around both. The optimizer is the state's
    (:meth:`TrainState.create`).

    Its settings are one value, a :class:`leanstep.StepSpec` (checked once, with a JSON form);
    the short keywords (``precision=``, ``num_microbatches=``, ``max_grad_norm=``, ``has_aux=``,
    ``loss=``, ``accumulation=``, ... : :meth:`StepSpec.from_keywords`) are a thin way to build it.
    Give the spec or the keywords, not both.

    Args:
      loss_fn: ``loss_fn(params, batch)`` (``loss_fn(params, batch, key)`` with
        ``uses_rng``) returning a scalar loss, ``(loss, aux)`` with ``has_aux``, or
        ``(loss_sum, count)`` with ``token_weighted`` (then the loss is the whole batch's
        ``sum / count``, not a mean of microbatch means; with ``has_aux`` too,
        ``((loss_sum, count), aux)``); with ``has_state``, ``loss_fn(params, model_state,
        batch[, key])`` returning ``(out, new_model_state)``. It receives params (and, with
        ``cast_batch``, the batch's floating leaves) in the compute dtype. With
        ``spec.update_in_backward``, a :class:`leanstep.LayerStack` (a loss in three parts).
      spec: the step's settings (:class:`leanstep.StepSpec`: precision, loss contract,
        accumulation, clipping, update chunks, donation, layout); None: built from ``short``. The
        optimizer is not taken (a TypeError says so): it is the state's, and so are its loss scale,
        the masters' and moments' formats and the spike guard (the spec's fields that
        :meth:`TrainState.create` reads).
      mesh: run sharded on this device mesh through :class:`leanstep.step.ShardingLayer` (or
        through the layer given): the axes have roles by name (an ``"fsdp"`` axis splits
        the parameters, a ``"tensor"`` axis is tensor parallel, every other axis is data
        parallel; see :func:`leanstep.sharding.mesh_axes`); the batch's rows are split over the
        batch axes, the state is laid out by :func:`leanstep.step.state_shardings` (inputs laid
        out differently are resharded; lay them out once with
        :func:`leanstep.step.shard_train_state` and :func:`leanstep.sharding.shard_batch`); finiteness is
        decided on the reduced gradient, so every device skips the same steps. A plain ``Mesh``
        is laid out by ``spec.sharding`` (its axes checked against the mesh's), or by the
        layer's defaults (with ``has_state``, ``reduce="microbatch"``). The short form's split
        is strided on a mesh (no row moves between devices); a spec's is used as given.
        None: one device.
      jit: compile the step with ``jax.jit`` (the step then has the jitted function's
        ``lower``, ``trace`` and ``eval_shape``); with ``spec.donate`` the state passed in is
        donated and must not be used again (a call with it raises a ValueError).
      **short: the keywords of :meth:`StepSpec.from_keywords`, in place of ``spec``.

    Returns:
      The step function.

    Raises:
      ValueError: a setting refused by :class:`StepSpec` (named); a mesh that differs from
        ``spec.sharding``, a model state with a reduction that lets it differ between devices;
        at trace time, the batch not divisible by ``num_microbatches`` (times the data-axis size,
        with a mesh), ``state.params`` not float32, ``state.opt_state`` not built by the optimizer
        applied, a token count that is not a scalar, or a ``"save:NAME"`` remat policy naming a
        tag the loss never sets; at call time, an input array that was deleted (a donated state
        used again).
      TypeError: ``loss_fn`` not callable, ``jit`` not a bool, ``mesh`` not a ``Mesh``, an
        optimizer, a spec and short keywords both, an unknown keyword or one removed in 0.12
        (``fsdp=``, ``data_axis=``, ``rules=``, ``reduce=``: the TypeError names
        ``mesh=ShardingLayer(mesh, ...)``); at trace time, ``state`` not a :class:`TrainState`; at
        call time, a ``jax.ShapeDtypeStruct`` or non-array leaf in the state or batch.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> state = TrainState.create({"w": jnp.zeros((2, 1))}, optax.sgd(0.1), loss_scale="dynamic")
      >>> step = make_train_step(loss_fn, precision="compute=bfloat16",
      ...                        num_microbatches=2, max_grad_norm=1.0)
      >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.ones((4, 1))}
      >>> state, metrics = step(state, batch)
      >>> float(metrics.loss), float(metrics.grad_norm), bool(metrics.skipped), bool(metrics.clipped)
      (1.0, 2.828..., False, True)
    """
    spec = _spec_of(spec, short, mesh)
    jit = check_bool("jit", jit)
    settings = step_settings(spec, mesh)
    if spec.update_in_backward:  # each layer updated inside the backward pass: leanstep.step.layerwise
        return _in_backward(loss_fn, settings, jit)
    contract, accumulation, layer = spec.loss, spec.accumulation, settings.layer
    num_microbatches = accumulation.num_microbatches
    gradients = gradient_stage(
        loss_fn,
        precision=spec.precision,
        accumulation=settings.stage_accumulation,
        loss=contract,
        cast_batch=spec.cast_batch,
    )
    if layer is not None:
        gradients = layer.gradients(gradients, token_weighted=contract.token_weighted)

    def core(state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if contract.uses_rng else None
        grads = gradients(state.params, batch, state.loss_scale, key, state.model_state)
        new_state, info = guarded_update(
            state,
            grads.grads,
            loss=grads.loss,
            max_grad_norm=spec.max_grad_norm,
            model_state=grads.model_state,
            update_chunk=spec.update_chunk,
        )
        new_state = new_state.replace(step=jnp.minimum(state.step, INT32_MAX - 1) + 1)
        return new_state, StepMetrics(
            loss=grads.loss,
            grad_norm=info.grad_norm,
            loss_scale=jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
            skipped=~info.finite,
            clipped=info.clipped,
            consecutive_skips=new_state.consecutive_skips,
            aux=grads.aux,
            spiked=info.spike,
            step_saturated=state.step >= INT32_MAX,
        )

    sharded = core if layer is None else layer.around(core, num_microbatches)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a TrainState (see TrainState.create), got {type(state).__name__}")
        if contract.has_state != (state.model_state is not None):
            raise ValueError(
                "has_state=True needs TrainState.create(..., model_state=...)"
                if contract.has_state
                else "the state holds a model_state: pass has_state=True, and loss_fn(params, model_state, "
                "batch) returning (loss, new_model_state)"
            )
        _check_master_dtypes(state)
        jax.eval_shape(accumulation.split_batch, batch)  # the batch's errors, at trace time
        return sharded(state, batch)

    if not jit:
        return step
    return _CheckedStep(jax.jit(step, donate_argnums=(0,) if spec.donate else ()), spec.donate, layer)


_NO_OPTIMIZER = (
    "make_train_step takes no optimizer since leanstep 0.8: give it once, to TrainState.create(params, "
    "optimizer); the step applies the state's"
)


def _in_backward(
    loss_fn: Any, settings: StepSettings, jit: bool
) -> JittedTrainStep | Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]:
    """The step of :mod:`leanstep.step.layerwise`; on a mesh inside the layer's constraints, every
    reduction XLA's (``reduce="microbatch"``: each layer's gradient reduced where it is made)."""
    spec, layer = settings.spec, settings.layer
    if layer is not None:
        layer = dataclasses.replace(layer, reduce="microbatch")
        settings = dataclasses.replace(settings, layer=layer)
    layerwise = make_layerwise_step(loss_fn, spec, settings.stage_accumulation)
    if layer is not None:
        layerwise = layer.around(layerwise, spec.accumulation.num_microbatches)
    if not jit:
        return layerwise
    return _CheckedStep(jax.jit(layerwise, donate_argnums=(0,) if spec.donate else ()), spec.donate, layer)


def _spec_of(spec: Any, short: dict[str, Any], mesh: Mesh | ShardingLayer | None) -> StepSpec:
    """The step's spec: ``spec``, or the one the short keywords build (a mesh gives it its layout)."""
    if spec is None:
        check_keywords("make_train_step", short, SHORT_KEYWORDS, {"optimizer": _NO_OPTIMIZER})
        return StepSpec.from_keywords(**short, mesh=mesh)
    if not isinstance(spec, StepSpec):
        raise TypeError(
            f"spec must be a leanstep.StepSpec or None, got {type(spec).__name__}; make_train_step takes no "
            "optimizer since leanstep 0.8 (deprecated since 0.2): give it once, to TrainState.create(params, "
            "optimizer); the step applies the state's"
        )
    if short:
        raise TypeError(
            f"make_train_step got a spec and the keywords {', '.join(sorted(short))}: give the settings once, "
            "in the spec (spec.replace(...)) or as keywords"
        )
    return spec


def _check_master_dtypes(state: TrainState) -> None:
    """Every master in the dtype of ``state.master`` (float32, or bfloat16 with stochastic
    rounding); FP8 state float32."""
    trainable, fp8 = split_fp8(state.params)
    want = master_dtype(state.master)
    for tree, dtype, what in ((trainable, want, "the master weights"), (fp8, jnp.float32, "FP8 state")):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if jnp.result_type(leaf) != dtype:
                raise ValueError(
                    f"state.params{jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}; {what} must be "
                    f"{jnp.dtype(dtype).name} (master={state.master!r}: TrainState.create stores them so; the "
                    "compute dtype is the precision's)"
                )


def _input_problem(leaf: Any, name: str, donate: bool) -> tuple[type[Exception], str] | None:
    """What is wrong with one input leaf, or None."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return TypeError, (
            "is a jax.ShapeDtypeStruct (a shape without values); the step runs on arrays. To trace it "
            "without data use step.trace(state, batch), jax.eval_shape(step, state, batch) or "
            "leanstep.inspection.audit(step, state, batch)"
        )
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
        if name == "state" and donate:
            return ValueError, (
                "has been deleted; the step donates its input state (donate=True), so the state "
                "passed to an earlier call is gone: use the state each call returns (state, metrics "
                "= step(state, batch)), or build the step with donate=False to keep its input"
            )
        return ValueError, "has been deleted (donated to, or deleted by, an earlier call)"
    if not (hasattr(leaf, "dtype") or hasattr(leaf, "__jax_array__") or isinstance(leaf, (bool, int, float, complex))):
        return TypeError, f"is a {type(leaf).__name__}; the {name} must be a pytree of arrays"
    return None


def _check_inputs(state: Any, batch: Any, donate: bool) -> None:
    """What the compiled step cannot take, named before it reaches JAX: abstract, deleted or non-array leaves."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState (see TrainState.create), got {type(state).__name__}")
    for name, tree in (("state", state), ("batch", batch)):
        for index, leaf in enumerate(jax.tree.leaves(tree)):  # key paths (slow) only for the message
            problem = _input_problem(leaf, name, donate)
            if problem is not None:
                error, message = problem
                path = jax.tree_util.tree_leaves_with_path(tree)[index][0]
                raise error(f"{name}{jax.tree_util.keystr(path)} {message}") from None


def _off_the_mesh(counter: Any, mesh: Mesh) -> bool:
    """Whether the state's step counter is a concrete array not laid out on ``mesh`` (one leaf stands for the state)."""
    if not isinstance(counter, jax.Array) or isinstance(counter, jax.core.Tracer):
        return False
    return not (isinstance(counter.sharding, NamedSharding) and counter.sharding.mesh == mesh)


class _CheckedStep:
    """The jitted step behind a check of its inputs; everything else (``lower``, ``trace``) is the jitted one's.

    On a mesh, a state not yet on it (``TrainState.create``'s, on the default device) is first
    placed as the step leaves it (``layer.state_shardings``): the jitted step would place it too,
    but as a program of its own, so that the second call, given the step's output, compiled the
    step again.
    """

    def __init__(self, jitted: Callable[..., Any], donate: bool, layer: ShardingLayer | None = None) -> None:
        self._jitted, self._donate, self._layer = jitted, donate, layer
        self.__wrapped__ = jitted
        self.__doc__ = jitted.__doc__

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
        counter = getattr(state, "step", None)  # one leaf stands for a donated or abstract state: cheap, every call
        if isinstance(counter, jax.ShapeDtypeStruct) or (
            isinstance(counter, jax.Array) and not isinstance(counter, jax.core.Tracer) and counter.is_deleted()
        ):
            _check_inputs(state, batch, self._donate)
        elif self._layer is not None and _off_the_mesh(counter, self._layer.mesh):
            state = jax.device_put(state, self._layer.state_shardings(state))
        try:
            return self._jitted(state, batch)
        except (TypeError, ValueError, RuntimeError) as error:
            # Only on the error path (the inputs of a real run are hundreds of leaves): an input JAX
            # cannot take is named; a model's own sharding constraint over a manual axis gets both
            # fixes; any other error is the original one.
            _check_inputs(state, batch, self._donate)
            named = manual_constraint_error(error)
            if named is not None:
                raise named from error
            raise

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The jitted step's ``lower``, with the same message for a model's own sharding constraint."""
        try:
            return self._jitted.lower(*args, **kwargs)  # type: ignore[attr-defined]  # a jitted function
        except ValueError as error:
            named = manual_constraint_error(error)
            if named is not None:
                raise named from error
            raise

    def __getattr__(self, name: str) -> Any:
        if name == "_jitted":  # not yet set: no recursion
            raise AttributeError(name)
        return getattr(self._jitted, name)
