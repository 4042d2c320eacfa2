"""One jitted train step that composes every building block in the right order."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.accumulation import _check_num_microbatches, microbatched_value_and_grad, split_microbatches
from leanstep.clipping import clip_by_global_norm, global_norm
from leanstep.loss_scale import LossScale, all_finite, get_loss_scale
from leanstep.precision import Precision, get_precision
from leanstep.sharding import _check_mesh, split_strided_microbatches, state_shardings

__all__ = ["TrainState", "StepMetrics", "make_train_step"]

_INT32_MAX = jnp.iinfo(jnp.int32).max


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "loss_scale", "rng", "consecutive_skips"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run carries from one step to the next, as one pytree.

    Attributes:
      step: int32 count of steps taken, skipped ones included (it indexes the data).
      params: the float32 master parameters.
      opt_state: the optax optimizer's state; it does not advance on a skipped step.
      loss_scale: a :class:`DynamicLossScale`, :class:`StaticLossScale` or
        :class:`NoOpLossScale`.
      rng: a ``uint32[2]`` PRNG key; microbatch ``j`` of step ``t`` gets
        ``fold_in(fold_in(rng, t), j)`` (with ``uses_rng``).
      consecutive_skips: int32 count of non-finite steps in a row (saturating).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale
    rng: jax.Array
    consecutive_skips: jax.Array

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        loss_scale: str | LossScale = "none",
        seed: int = 0,
    ) -> "TrainState":
        """Builds the state at step 0.

        Args:
          params: a pytree of floating-point arrays; they are stored as float32 masters.
          optimizer: any ``optax.GradientTransformation``; its ``init`` builds ``opt_state``.
          loss_scale: ``"dynamic"``, ``"static"``, ``"none"`` or a loss-scale instance.
          seed: the seed of ``rng``.

        Raises:
          TypeError: a parameter leaf is not a floating-point array, or ``optimizer``
            is not a ``GradientTransformation``.

        Example:
          >>> import jax.numpy as jnp, optax
          >>> state = TrainState.create({"w": jnp.ones(3)}, optax.sgd(0.1), loss_scale="dynamic")
          >>> int(state.step), state.params["w"].dtype, float(state.loss_scale.loss_scale)
          (0, dtype('float32'), 32768.0)
        """
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        leaves = jax.tree_util.tree_leaves_with_path(params)
        if not leaves:
            raise ValueError("params must have at least one array leaf, got an empty tree")
        for path, leaf in leaves:
            if not hasattr(leaf, "dtype") and not isinstance(leaf, (int, float)):
                raise TypeError(
                    f"params{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; parameters must be "
                    "floating-point arrays"
                )
            dtype = jnp.result_type(leaf)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(
                    f"params{jax.tree_util.keystr(path)} has dtype {dtype}; parameters must be floating-point"
                )
        params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        state = cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=get_loss_scale(loss_scale),
            rng=jax.random.key_data(jax.random.key(seed)),
            consecutive_skips=jnp.zeros((), jnp.int32),
        )
        # One buffer per leaf: the step donates the state, and XLA refuses to donate a buffer
        # that two leaves share (the caller's params, or counters built from one zeros array).
        return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), state)


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
    """

    loss: jax.Array
    grad_norm: jax.Array
    loss_scale: jax.Array
    skipped: jax.Array
    clipped: jax.Array
    consecutive_skips: jax.Array
    aux: Any = None


def _check_loss(value: Any, name: str) -> jax.Array:
    """``loss_fn``'s ``name`` output as float32, checked at trace time (shape and dtype are static)."""
    if not hasattr(value, "dtype") and not isinstance(value, float):
        raise TypeError(f"loss_fn's {name} must be a real floating scalar, got {type(value).__name__}")
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"loss_fn's {name} must be a real floating scalar, got dtype {value.dtype}")
    if value.shape != ():
        raise ValueError(f"loss_fn's {name} must be a scalar, got shape {value.shape}; reduce it (e.g. jnp.mean)")
    return value.astype(jnp.float32)


def _where_tree(condition: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(condition, n, o), new, old)


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    precision: str | Precision = "float32",
    num_microbatches: int = 1,
    max_grad_norm: float | None = None,
    has_aux: bool = False,
    token_weighted: bool = False,
    uses_rng: bool = False,
    cast_batch: bool = True,
    jit: bool = True,
    donate: bool = True,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    fsdp: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]:
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

    Args:
      loss_fn: ``loss_fn(params, batch)`` (``loss_fn(params, batch, rng)`` with
        ``uses_rng``) returning a scalar loss, ``(loss, aux)`` with ``has_aux``, or
        ``(loss_sum, count)`` with ``token_weighted`` (then the loss is the
        whole batch's ``sum / count``, not a mean of microbatch means). It receives
        params (and, with ``cast_batch``, the batch's floating leaves) in the compute dtype.
      optimizer: any ``optax.GradientTransformation``.
      precision: a :class:`Precision` or its string form, e.g.
        ``"params=float32,compute=bfloat16,output=float32"``; with ``strict`` the
        loss runs under :func:`strict_precision`.
      num_microbatches: static number of equal microbatches the batch is split into.
      max_grad_norm: clip the accumulated gradient to this global norm; None: no clipping.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux comes back in the metrics,
        stacked over microbatches.
      token_weighted: ``loss_fn`` returns ``(loss_sum, count)``.
      uses_rng: pass a per-step, per-microbatch PRNG key as the third argument.
      cast_batch: cast the batch's floating leaves to the compute dtype (integer
        leaves such as token ids are left alone). Without it a float32 input would
        silently promote a bf16 matmul back to float32.
      jit: compile the step with ``jax.jit``.
      donate: donate the state's buffers to the step (only with ``jit``); the
        state passed in must not be used again.
      mesh: run sharded on this device mesh: the batch's rows are split along
        ``data_axis`` and the state is laid out by :func:`leanstep.state_shardings`
        (inputs laid out differently are resharded; lay them out once with
        :func:`leanstep.shard_train_state` and :func:`leanstep.shard_batch`). XLA inserts
        the collectives; the finiteness decision is taken on the reduced gradient, so
        every device skips the same steps. Microbatches are then *strided*
        (:func:`leanstep.split_strided_microbatches`: microbatch ``j`` is rows
        ``j, j+M, ...``) so no row moves between devices; the full-batch loss and
        gradient are those of the contiguous split, but per-microbatch ``aux`` and
        ``uses_rng`` keys follow the strided rows (the same rows on any device count).
        Each microbatch's gradient is reduced across devices inside the scan. None: one
        device, contiguous microbatches.
      data_axis: the mesh axis the batch (and, with ``fsdp``, the state) is split along.
      fsdp: shard parameters and optimizer state along ``data_axis`` (ZeRO-3 style)
        instead of replicating them.

    Returns:
      The step function.

    Raises:
      ValueError: ``num_microbatches`` < 1, ``max_grad_norm`` not positive and
        finite, ``data_axis`` not an axis of ``mesh``, or (at trace time) the batch
        not divisible by ``num_microbatches`` (times the data-axis size, with a mesh).
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> state = TrainState.create({"w": jnp.zeros((2, 1))}, opt, loss_scale="dynamic")
      >>> step = make_train_step(loss_fn, opt, precision="compute=bfloat16",
      ...                        num_microbatches=2, max_grad_norm=1.0)
      >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.ones((4, 1))}
      >>> state, metrics = step(state, batch)
      >>> float(metrics.loss), float(metrics.grad_norm), bool(metrics.skipped), bool(metrics.clipped)
      (1.0, 2.828..., False, True)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
    num_microbatches = _check_num_microbatches(num_microbatches)
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, (bool, np.bool_)) or not isinstance(max_grad_norm, (int, float, np.number)):
            raise TypeError(f"max_grad_norm must be a number or None, got {type(max_grad_norm).__name__} {max_grad_norm!r}")
        if not 0 < float(max_grad_norm) < float("inf"):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
        max_grad_norm = float(max_grad_norm)
    if has_aux and token_weighted:
        raise ValueError("has_aux and token_weighted cannot both be set: aux is not supported with (loss_sum, count)")
    if not isinstance(fsdp, (bool, np.bool_)):
        raise TypeError(f"fsdp must be a bool, got {type(fsdp).__name__} {fsdp!r}")
    if fsdp and mesh is None:
        raise ValueError("fsdp=True shards the state over a mesh; pass mesh= (e.g. leanstep.data_mesh())")
    num_shards = 1 if mesh is None else _check_mesh(mesh, data_axis)
    policy = get_precision(precision)
    model_loss = policy.wrap(loss_fn)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a TrainState (see TrainState.create), got {type(state).__name__}")
        split_microbatches(batch, num_microbatches)  # validates shapes at trace time
        if mesh is not None:
            batch_size = jax.tree.leaves(batch)[0].shape[0]
            if batch_size % (num_microbatches * num_shards):
                raise ValueError(
                    f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches} times "
                    f"the {num_shards} devices of mesh axis {data_axis!r}"
                )
            shardings = state_shardings(state, mesh, fsdp=fsdp, data_axis=data_axis)
            state = jax.lax.with_sharding_constraint(state, shardings)
            batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, PartitionSpec(data_axis)))
        loss_scale = state.loss_scale
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def scaled_loss(params_c: Any, microbatch: Any) -> tuple[Any, Any]:
            if mesh is not None:
                # Pre-split (see below): each microbatch arrives as (1, B/M, ...).
                microbatch = jax.tree.map(lambda leaf: leaf[0], microbatch)
            if uses_rng:
                # Every row of a microbatch holds its index; fold_in wants one scalar.
                index = microbatch["_index"][0]
                out = model_loss(params_c, microbatch["_batch"], jax.random.fold_in(step_rng, index))
            else:
                out = model_loss(params_c, microbatch)
            if (token_weighted or has_aux) and not (isinstance(out, tuple) and len(out) == 2):
                flag, expected = (("token_weighted", "(loss_sum, count)") if token_weighted
                                  else ("has_aux", "(loss, aux)"))
                raise TypeError(f"{flag}=True: loss_fn must return {expected}, got {type(out).__name__}")
            if token_weighted:
                loss_sum, count = out
                loss_sum = _check_loss(loss_sum, "loss_sum")
                return (loss_scale.scale(loss_sum), count), (loss_sum, jnp.asarray(count, jnp.float32))
            loss, aux = out if has_aux else (out, None)
            loss = _check_loss(loss, "loss")
            return loss_scale.scale(loss), (loss, aux)

        data = policy.cast_to_compute(batch) if cast_batch else batch
        batch_size = jax.tree.leaves(batch)[0].shape[0]
        if mesh is None:
            if uses_rng:
                indices = jnp.repeat(jnp.arange(num_microbatches), batch_size // num_microbatches)
                data = {"_batch": data, "_index": indices}
        else:
            # Strided (M, B/M, ...) microbatches split along B/M keep every row on its device;
            # handed to the accumulator as a batch of M rows, its own split adds a unit axis only.
            data = split_strided_microbatches(data, num_microbatches)
            if uses_rng:
                rows = batch_size // num_microbatches
                indices = jnp.broadcast_to(jnp.arange(num_microbatches)[:, None], (num_microbatches, rows))
                data = {"_batch": data, "_index": indices}
            data = jax.lax.with_sharding_constraint(data, NamedSharding(mesh, PartitionSpec(None, data_axis)))

        grad_fn = microbatched_value_and_grad(
            scaled_loss, num_microbatches, has_aux=True, token_weighted=token_weighted
        )
        params_c = policy.cast_to_compute(state.params)
        if mesh is not None:
            # Whole parameters for the forward and backward pass (FSDP gathers them here, once
            # per step); left to itself XLA may split the matmuls by weight columns instead and
            # move activations, i.e. batch rows, between devices.
            params_c = jax.lax.with_sharding_constraint(params_c, NamedSharding(mesh, PartitionSpec()))
        (_, (per_mb, aux)), scaled_grads = grad_fn(params_c, data)
        if token_weighted:
            loss_sums, counts = per_mb, aux
            loss = jnp.sum(loss_sums) / jnp.sum(counts)
            aux = None
        else:
            loss = jnp.mean(per_mb)
        # Gradients w.r.t. the compute-dtype copy are float32 already (the accumulator's dtype);
        # unscale once, after accumulation.
        grads = loss_scale.unscale(scaled_grads)
        # A non-finite loss is a fault even when its gradient is finite (NaN in a term that does
        # not depend on the parameters, or in a stop_gradient).
        finite = all_finite(grads) & jnp.isfinite(loss)
        if max_grad_norm is None:
            grad_norm = global_norm(grads)
            clipped = jnp.zeros((), bool)
        else:
            grads, grad_norm = clip_by_global_norm(grads, max_grad_norm)
            clipped = grad_norm > max_grad_norm
            # A finite gradient whose float32 norm overflows would be clipped to zero, not applied.
            finite = finite & jnp.isfinite(grad_norm)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        skips = jnp.where(finite, 0, jnp.minimum(state.consecutive_skips, _INT32_MAX - 1) + 1)
        new_state = TrainState(
            step=jnp.minimum(state.step, _INT32_MAX - 1) + 1,
            params=_where_tree(finite, new_params, state.params),
            opt_state=_where_tree(finite, new_opt_state, state.opt_state),
            loss_scale=loss_scale.adjust(finite),
            rng=state.rng,
            consecutive_skips=skips.astype(jnp.int32),
        )
        metrics = StepMetrics(
            loss=loss,
            grad_norm=grad_norm,
            loss_scale=jnp.asarray(loss_scale.loss_scale, jnp.float32),
            skipped=~finite,
            clipped=clipped & finite,
            consecutive_skips=new_state.consecutive_skips,
            aux=aux,
        )
        if mesh is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, shardings)
            replicated = NamedSharding(mesh, PartitionSpec())
            metrics = metrics._replace(**{
                name: jax.lax.with_sharding_constraint(getattr(metrics, name), replicated)
                for name in StepMetrics._fields if name != "aux"
            })
        return new_state, metrics

    if not jit:
        return step
    return jax.jit(step, donate_argnums=(0,) if donate else ())
