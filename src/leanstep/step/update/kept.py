"""The whole tree's update as one conditional: applied in full, or the state kept as it was.

A skipped step must leave the masters and the optimizer state bit-identical. Selecting per leaf,
``where(applied, new, old)``, does that, but the optimizer's new state is then written whole and
read again by the select: one more pass over the masters and the moments. On the 405M step on a
TPU v5e those selects took 17.0 of 365 ms. :func:`applied_or_kept` decides first and runs the
update under ``lax.cond``, so that the applied branch writes each leaf once and the kept branch
writes nothing. The unscaling and the clip happen inside the branch, where XLA fuses them into
the optimizer's own kernels. On XLA:CPU (the shared 2-core Xeon, loaded, 2026-12-07), AdamW over
33.5M float32 parameters took 970 ms and 252 MB of temporaries with the select, 481 ms and 34 MB
under the conditional, and 453 ms and 34 MB in :func:`~leanstep.step.update.guarded_update`, all
three to the same bits (``python -m benchmarks.update_skip``); the chip's figure is not yet measured.

It needs the decision before the update: a spike guard that watches the update's own norm reads
the update first, and keeps the per-leaf select (:func:`leanstep.step.update.guarded_update`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from leanstep.blocks.clipping import NormParts, clip_leaves
from leanstep.blocks.loss_scale import LossScale
from leanstep.blocks.masters import apply_to_masters

__all__ = ["applied_or_kept", "clipped_grads", "rounding_key"]

#: Folded into the step's key for stochastic rounding: apart from the microbatches' ``fold_in(key, j)``.
_ROUNDING_SALT = 0x53524E44


def rounding_key(state: Any) -> jax.Array:
    """The key of the step's stochastic rounding of bfloat16 masters (leaf ``i`` folds in ``i``), from a
    :class:`leanstep.TrainState`'s ``rng`` and ``step``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step), _ROUNDING_SALT)


def clipped_grads(scaled_grads: Any, loss_scale: LossScale, parts: NormParts, max_grad_norm: float | None) -> Any:
    """The unscaled gradient, clipped to ``max_grad_norm`` by the norm's ``parts`` (None: not clipped)."""
    grads = loss_scale.unscale(scaled_grads)
    if max_grad_norm is None:
        return grads
    return jax.tree.unflatten(jax.tree.structure(grads), clip_leaves(jax.tree.leaves(grads), parts, max_grad_norm))


def applied_or_kept(
    state: Any,
    params: Any,
    opt_state: Any,
    scaled_grads: Any,
    applied: jax.Array,
    parts: NormParts,
    max_grad_norm: float | None,
    rounding_key: jax.Array,
    update_scale: jax.Array | None,
) -> tuple[Any, Any, Any]:
    """``(params, opt_state, master_error)`` after the update where ``applied``, else as they were.

    Args:
      state: the :class:`leanstep.TrainState` before the step (its optimizer, loss scale, master format,
        Kahan buffer).
      params: the trainable masters (no FP8 state), in the masters' format.
      opt_state: the optimizer's state, on the device.
      scaled_grads: the loss-scaled gradient, shaped like ``params``.
      applied: the step's decision (finite, no spike).
      parts: the unscaled gradient's norm, in parts, for the clip.
      max_grad_norm: the clip's bound, or None.
      rounding_key: the key of stochastic rounding into bfloat16 masters.
      update_scale: a factor on the update (the spike guard's, after a rollback), or None.
    """

    def apply(params: Any, opt_state: Any, scaled_grads: Any, master_error: Any) -> tuple[Any, Any, Any]:
        wide = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        grads = clipped_grads(scaled_grads, state.loss_scale, parts, max_grad_norm)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, wide)
        updates, new_opt_state = state.optimizer.update(grads, opt_state, wide)
        if update_scale is not None:
            updates = jax.tree.map(lambda u: u * update_scale.astype(u.dtype), updates)
        if state.master == "float32":
            return optax.apply_updates(wide, updates), new_opt_state, master_error
        new_params, new_error = apply_to_masters(params, updates, state.master, rounding_key, master_error)
        return new_params, new_opt_state, new_error

    def keep(params: Any, opt_state: Any, scaled_grads: Any, master_error: Any) -> tuple[Any, Any, Any]:
        return params, opt_state, master_error

    return jax.lax.cond(applied, apply, keep, params, opt_state, scaled_grads, state.master_error)
