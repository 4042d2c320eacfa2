r"""The guarded update: unscale once, decide finiteness once, clip, apply only if finite.

.. code-block:: text

    G = unscale(G_scaled, S)                           # once, after accumulation
    finite = all(isfinite(G)) and isfinite(loss)       # once, over the whole gradient
    finite = finite and all(isfinite(new_fp8))         # and the FP8 state it would write
    n = global_norm(G);  G *= min(1, c / n)            # clip the unscaled total
    finite = finite and isfinite(n)                    # a norm that overflows float32 too
    params', opt' = optimizer(G)
    params, opt = finite ? (params', opt') : (params, opt)    # bit-identical on a skip
    S = adjust(S, finite);  skips = finite ? 0 : skips + 1
    fp8 = finite ? new_fp8 : fp8                       # FP8 state: out of all of the above

FP8 state in the params (:mod:`leanstep.blocks.fp8_state`) takes no part in unscaling, the
finiteness decision, the norm, clipping or the optimizer (whose state is of the trainable
parameters only): its "gradient" is its new value, written if the step is applied.

Masters kept in bfloat16 (``state.master``, :mod:`leanstep.blocks.masters`) are widened to float32
for the optimizer, and ``params + updates`` is rounded stochastically, with random bits from the
state's key folded with the step: the same step of a resumed run rounds the same way.

:func:`guarded_update` does this to a :class:`leanstep.TrainState`;
:func:`guarded_update_transform` offers the same as an optax transformation wrapping any
optimizer, in the spirit of ``optax.apply_if_finite`` (which neither unscales nor clips, and
counts but keeps no loss scale).

Size: the guarded update's order (unscale once, decide once, clip, apply only if finite) is the
contract, read top to bottom in one file; the update under one conditional is kept.py, chunked
application chunks.py, their checks checks.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from leanstep.blocks.clipping import NormParts, global_norm, norm_parts
from leanstep.blocks.fp8_state import has_fp8, merge_fp8, overwrite_fp8, split_fp8
from leanstep.blocks.loss_scale import LossScale, NoOpLossScale, all_finite
from leanstep.blocks.loss_scale_registry import get_loss_scale
from leanstep.blocks.masters import apply_to_masters
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.common.checks import INT32_MAX, check_optimizer, check_positive
from leanstep.common.jaxprs import OPTIMIZER_UPDATE_SCOPE
from leanstep.common.removed import refuses_removed_keywords
from leanstep.step.state import TrainState
from leanstep.step.update.checks import check_grads, check_opt_state, spike_window
from leanstep.step.update.chunk_plan import update_plan
from leanstep.step.update.chunks import chunked_update
from leanstep.step.update.kept import applied_or_kept, clipped_grads, rounding_key
from leanstep.step.update.offload import back_like, on_device

__all__ = ["GuardedState", "UpdateInfo", "guarded_update", "guarded_update_transform"]


class UpdateInfo(NamedTuple):
    """What the guarded update decided.

    Attributes:
      grad_norm: float32 global norm of the unscaled gradient, before clipping.
      finite: bool; False: the update was skipped.
      clipped: bool, the norm exceeded ``max_grad_norm`` (and the update was applied).
      spike: bool, the step was finite and skipped for a spike (:class:`leanstep.SpikeGuard`).
    """

    grad_norm: jax.Array
    finite: jax.Array
    clipped: jax.Array
    spike: Any = None

    @property
    def applied(self) -> jax.Array:
        """The update was applied: finite and no spike."""
        return self.finite if self.spike is None else self.finite & ~self.spike


def _float32(tree: Any) -> Any:
    return jax.tree.map(lambda p: p.astype(jnp.float32), tree)


def _where_tree(condition: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(condition, n, o), new, old)


def _saturating_increment(count: jax.Array) -> jax.Array:
    return (jnp.minimum(count, INT32_MAX - 1) + 1).astype(jnp.int32)


def _decide(
    scaled_grads: Any, params: Any, loss_scale: LossScale, max_grad_norm: float | None, loss: Any, new_fp8: Any
) -> tuple[Any, jax.Array, NormParts, jax.Array]:
    """The unscaled, clipped gradient, whether it is finite, its norm before clipping (in parts), and whether it was clipped."""
    check_grads(scaled_grads, params)
    # A non-finite loss is a fault even when its gradient is finite (NaN in a term that does not
    # depend on the parameters, or in a stop_gradient); so is a non-finite amax an FP8 matmul
    # recorded (an inf its quantizer would clip): written, it would freeze that scale.
    finite = all_finite(new_fp8)
    finite = finite if loss is None else finite & jnp.isfinite(loss)
    # The norm's two reductions (the largest magnitude, then the squares scaled by its power of two:
    # entries of 1e20 do not overflow) decide finiteness too, reading the scaled gradient and
    # unscaling inside each (an unscaled copy cost 4 bytes a parameter on XLA:CPU, docs/lean-state.md).
    parts = norm_parts(scaled_grads, loss_scale.unscale)
    clipped = jnp.zeros((), bool) if max_grad_norm is None else parts.norm > max_grad_norm
    return clipped_grads(scaled_grads, loss_scale, parts, max_grad_norm), finite & parts.finite, parts, clipped


def _judged(
    guard: SpikeGuard | None, window: Any, loss: Any, finite: jax.Array, grad_norm: jax.Array, updates: Any
) -> tuple[jax.Array, Any]:
    """Whether ``guard`` skips this finite step, and its window after it (a finite step is recorded,
    spike or not); no guard: no spike, and the window as it was. ``updates``: the optimizer's, read
    where the guard watches their norm (else None)."""
    if guard is None:
        return jnp.zeros((), bool), window
    values = {"loss": loss, "grad_norm": grad_norm}
    if "update_norm" in guard.watch:
        values["update_norm"] = global_norm(updates)
    return guard.decide(window, values, finite)


def _checked_update(
    scaled_grads: Any,
    opt_state: Any,
    params: Any,
    optimizer: optax.GradientTransformation,
    loss_scale: LossScale,
    max_grad_norm: float | None,
    loss: jax.Array | None,
    guard: SpikeGuard | None = None,
    window: Any = None,
    new_fp8: Any = None,
) -> tuple[Any, Any, UpdateInfo, Any]:
    """The optimizer's updates and next state (kept as it was unless applied), and the spike
    guard's window after the step, for a ``guard`` that reads the update; ``new_fp8``, the FP8
    state to write, must be finite too."""
    grads, finite, parts, clipped = _decide(scaled_grads, params, loss_scale, max_grad_norm, loss, new_fp8)
    grad_norm = parts.norm.astype(jnp.float32)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    spiked, window = _judged(guard, window, loss, finite, grad_norm, updates)
    info = UpdateInfo(grad_norm, finite, clipped & finite & ~spiked, spiked)
    return updates, _where_tree(info.applied, new_opt_state, opt_state), info, window


# The audit tells the optimizer's loops (codecs, chunks, Newton-Schulz) from the microbatch loop by this scope.
@refuses_removed_keywords("guarded_update")
@jax.named_scope(OPTIMIZER_UPDATE_SCOPE)
def guarded_update(
    state: TrainState,
    scaled_grads: Any,
    *,
    loss: jax.Array | None = None,
    max_grad_norm: float | None = None,
    model_state: Any = None,
    update_chunk: int | str | None = "auto",
) -> tuple[TrainState, UpdateInfo]:
    """Applies ``state.optimizer`` to the scaled gradient if it is finite (see the module doc).

    ``params``, ``opt_state``, ``loss_scale``, ``consecutive_skips``, the spike guard's window and
    (given the new one) ``model_state`` advance; ``step`` and ``rng`` are the caller's. On a skipped
    step params, optimizer state and model state come back bit-identical (the update under
    ``lax.cond``, not a zero update: :mod:`leanstep.step.update.kept`). The state's spike guard
    (``state.spike_guard``, a :class:`leanstep.SpikeGuard` it was built with) skips a finite step
    whose loss or norms leap past its window.

    Args:
      state: the :class:`TrainState` before the step.
      scaled_grads: the gradient of ``loss_scale * loss`` (float32), shaped like the params.
      loss: the step's loss; a non-finite one skips the step too. None: not checked.
      max_grad_norm: clip to this global norm; None: no clipping.
      model_state: the model state the step computed, kept only if the step is applied;
        None: ``state.model_state`` is left as it is.
      update_chunk: apply the optimizer in chunks of at most this many entries, one after
        another, so that one chunk's float32 widening is live at a time (the whole tree's
        operations, rounded as XLA compiles them: :mod:`leanstep.step.update.chunks`); ``"auto"``: chunks of ``DEFAULT_UPDATE_CHUNK``
        where the optimizer allows it, else the whole tree; None: the whole tree at once.

    Returns:
      ``(state, info)``: the new state and an :class:`UpdateInfo`.

    Raises:
      ValueError, TypeError: ``max_grad_norm`` is not a positive finite number or None (normal
        in float32), ``state.opt_state`` was not built by ``state.optimizer`` for these params,
        or ``scaled_grads`` is not shaped like the params; no ``loss`` for the state's spike guard;
        ``update_chunk`` an int where the optimizer needs the whole tree (a transformation mixing
        parameters, named) or the spike guard watches the update's norm; ``spike_guard=`` (removed
        in 0.12: the state carries its guard).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = TrainState.create({"w": jnp.zeros(2)}, optax.sgd(1.0), loss_scale="dynamic")
      >>> scaled = {"w": jnp.array([3.0, 4.0]) * state.loss_scale.loss_scale}
      >>> new, info = guarded_update(state, scaled, max_grad_norm=1.0)
      >>> new.params["w"], float(info.grad_norm), bool(info.clipped)
      (Array([-0.6, -0.8], dtype=float32), 5.0, True)
      >>> new, info = guarded_update(state, {"w": jnp.array([jnp.nan, 1.0])})
      >>> new.params["w"], bool(info.finite), float(new.loss_scale.loss_scale), int(new.consecutive_skips)
      (Array([0., 0.], dtype=float32), False, 16384.0, 1)
    """
    max_grad_norm = check_positive("max_grad_norm", max_grad_norm, optional=True)
    check_grads(scaled_grads, state.params)
    guard, window = state.spike_guard, spike_window(state)
    if guard is not None and loss is None:
        raise ValueError("the state's spike guard judges the step's loss: pass loss=")
    params, fp8 = split_fp8(state.params)
    scaled_grads, new_fp8 = split_fp8(scaled_grads) if has_fp8(state.params) else (scaled_grads, None)
    wide = _float32(params)  # the optimizer sees float32 masters, whatever they are kept in
    check_opt_state(state.opt_state, state.optimizer, wide)
    _refuse_second_unscale(state.opt_state, "the state's optimizer")
    # 1, or less after a rollback past spikes (leanstep train); None without a guard
    scale: Any = None if guard is None else window.update_scale
    plan = update_plan(state, wide, update_chunk)  # an offloaded state too
    if plan is not None or guard is None or "update_norm" not in guard.watch:  # decided first
        _, finite, parts, clipped = _decide(scaled_grads, wide, state.loss_scale, max_grad_norm, loss, new_fp8)
        grad_norm = parts.norm.astype(jnp.float32)
        spiked, window = _judged(guard, window, loss, finite, grad_norm, None)
        info = UpdateInfo(grad_norm, finite, clipped & finite & ~spiked, spiked)
        if plan is not None:
            new_params, opt_state, master_error = chunked_update(
                state, params, scaled_grads, plan, info.applied, parts, max_grad_norm, rounding_key(state), scale
            )
        else:  # the whole tree under one conditional: no select pass on a step that is applied
            new_params, opt_state, master_error = applied_or_kept(
                state, params, on_device(state.opt_state), scaled_grads, info.applied, parts, max_grad_norm,
                rounding_key(state), scale,
            )  # fmt: skip
            opt_state = back_like(opt_state, state.opt_state)  # an offloaded state: back to the host
    else:  # the spike guard reads the update's norm: the update computed whole, then kept or dropped
        updates, opt_state, info, window = _checked_update(
            scaled_grads, on_device(state.opt_state), wide, state.optimizer, state.loss_scale, max_grad_norm, loss,
            guard, window, new_fp8,
        )  # fmt: skip
        opt_state = back_like(opt_state, state.opt_state)  # an offloaded state: back to the host
        updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
        new_params, master_error = _applied_params(state, params, updates, info.applied)
    if new_fp8 is not None:
        new_params = merge_fp8(new_params, overwrite_fp8(fp8, new_fp8, info.applied))
    skips = jnp.where(info.finite, 0, _saturating_increment(state.consecutive_skips))
    return state.replace(
        params=new_params,
        opt_state=opt_state,
        loss_scale=state.loss_scale.adjust(info.finite),
        consecutive_skips=skips.astype(jnp.int32),
        model_state=state.model_state
        if model_state is None
        else _where_tree(info.applied, model_state, state.model_state),
        master_error=master_error,
        spike=window,
    ), info


def _applied_params(state: TrainState, params: Any, updates: Any, applied: jax.Array) -> tuple[Any, Any]:
    """``params + updates`` in the masters' format where the step is applied, else ``params``;
    and the Kahan buffer (None without one)."""
    if state.master == "float32":
        return _where_tree(applied, optax.apply_updates(params, updates), params), None
    new_params, master_error = apply_to_masters(params, updates, state.master, rounding_key(state), state.master_error)
    if master_error is not None:
        master_error = _where_tree(applied, master_error, state.master_error)
    return _where_tree(applied, new_params, params), master_error


class GuardedState(NamedTuple):
    """The state of :func:`guarded_update_transform`.

    Attributes:
      inner_state: the wrapped optimizer's state (it does not advance on a skipped update).
      loss_scale: the loss scale; scale the loss with ``state.loss_scale.scale(loss)``.
      consecutive_skips: int32 non-finite updates in a row (saturating).
      grad_norm: float32 norm of the last unscaled gradient, before clipping.
    """

    inner_state: Any
    loss_scale: LossScale
    consecutive_skips: jax.Array
    grad_norm: jax.Array


def scaling_guards(opt_state: Any) -> list[GuardedState]:
    """The :class:`GuardedState` s in an optimizer state whose loss scale is not a no-op.

    Each divides the gradient it is given by its own loss scale, which only the code that
    scaled the loss with that same scale may do: inside :func:`guarded_update` (and so
    :func:`leanstep.make_train_step`), whose gradient is already unscaled by the state's loss
    scale, or inside another guard, every one of them would unscale a second time.
    """
    found = []
    for node in jax.tree.leaves(opt_state, is_leaf=lambda node: isinstance(node, GuardedState)):
        if isinstance(node, GuardedState):  # and the guards inside it
            found += [node] * (not isinstance(node.loss_scale, NoOpLossScale)) + scaling_guards(node.inner_state)
    return found


def _refuse_second_unscale(opt_state: Any, where: str) -> None:
    if scaling_guards(opt_state):
        raise ValueError(
            f"{where} holds a guarded_update_transform with a loss scale: the gradient would be unscaled "
            "twice (the step, or the outer guard, already unscales it by its own loss scale). Give the "
            "inner optax optimizer instead; the step already unscales once, checks finiteness and clips "
            "(or build the inner guard with loss_scale='none')"
        )


def guarded_update_transform(
    optimizer: optax.GradientTransformation,
    *,
    loss_scale: str | LossScale | None = None,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    """:func:`guarded_update` as an optax transformation wrapping ``optimizer``.

    ``update(scaled_grads, state, params)`` takes the gradient of the *scaled* loss (scale
    it with ``state.loss_scale.scale(loss)``), and returns the wrapped optimizer's updates
    of the unscaled, clipped gradient, or all-zero updates when that gradient is not finite
    (the inner state is then kept, and the loss scale backs off). Zero updates leave
    finite params unchanged, except that ``-0.0 + 0.0`` is ``+0.0``; use
    :func:`guarded_update` where a skipped step must be bit-identical.

    Args:
      optimizer: the optax optimizer to guard.
      loss_scale: required: ``"none"`` for gradients of an unscaled loss (a drop-in for
        :func:`optax.apply_if_finite`), ``"dynamic"`` or a loss-scale instance (a static
        scale needs its value: ``StaticLossScale.create(S)``) when the loss is scaled with
        ``state.loss_scale.scale(loss)``. Not defaulted since 0.8: the old default,
        ``"dynamic"``, divided the updates of an unscaled loss by 32768.
      max_grad_norm: clip the unscaled gradient to this global norm; None: no clipping.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`GuardedState`; ``params``
      must be passed to ``update``.

    Raises:
      TypeError, ValueError: a bad argument, named; no ``loss_scale``; (at ``init``) an
        ``optimizer`` that holds a guard with a loss scale of its own (it would unscale twice).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from leanstep.blocks.loss_scale import StaticLossScale
      >>> tx = guarded_update_transform(optax.sgd(1.0), loss_scale=StaticLossScale.create(4.0),
      ...                               max_grad_norm=1.0)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([12.0, 16.0])}, state, params)
      >>> updates["w"], float(state.grad_norm)
      (Array([-0.6, -0.8], dtype=float32), 5.0)
      >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
      >>> updates["w"], int(state.consecutive_skips)
      (Array([0., 0.], dtype=float32), 1)
    """
    check_optimizer(optimizer)
    max_grad_norm = check_positive("max_grad_norm", max_grad_norm, optional=True)
    if loss_scale is None:
        raise TypeError(
            "guarded_update_transform needs loss_scale=: 'none' for the gradient of an unscaled loss (as "
            "optax.apply_if_finite), 'dynamic' (or a LossScale) when you scale the loss with "
            "state.loss_scale.scale(loss)"
        )
    initial_scale = get_loss_scale(loss_scale)

    def init_fn(params: Any) -> GuardedState:
        inner = optimizer.init(params)
        if not isinstance(initial_scale, NoOpLossScale):
            _refuse_second_unscale(inner, "the optimizer given to guarded_update_transform")
        return GuardedState(inner, initial_scale, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def update_fn(scaled_grads: Any, state: GuardedState, params: Any = None) -> tuple[Any, GuardedState]:
        if params is None:
            raise ValueError("guarded_update_transform needs params: call update(grads, state, params)")
        if has_fp8(params):
            raise ValueError(
                "the params hold FP8 state, which an optax update cannot overwrite bit-exactly: use "
                "leanstep.step.guarded_update or leanstep.make_train_step, which write it once per step"
            )
        updates, inner, info, _ = _checked_update(
            scaled_grads, state.inner_state, params, optimizer, state.loss_scale, max_grad_norm, None
        )
        updates = _where_tree(info.finite, updates, jax.tree.map(jnp.zeros_like, updates))
        skips = jnp.where(info.finite, 0, _saturating_increment(state.consecutive_skips))
        return updates, GuardedState(
            inner, state.loss_scale.adjust(info.finite), skips.astype(jnp.int32), info.grad_norm
        )

    return optax.GradientTransformation(init_fn, update_fn)
