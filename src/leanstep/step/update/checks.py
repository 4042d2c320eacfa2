"""The guarded update's checks of its inputs: an optimizer state built for its optimizer and
parameters, one gradient per parameter of its shape (named here, not deep inside optax), and the
state's spike guard with its window."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from leanstep.common.checks import same_structure, tree_difference

__all__ = ["check_grads", "check_opt_state", "spike_window"]


def check_opt_state(
    opt_state: Any, optimizer: optax.GradientTransformation, params: Any, name: str = "state.opt_state"
) -> None:
    """Raises unless ``opt_state`` has the structure, shapes and dtypes of ``optimizer.init(params)``.

    Compared with ``jax.eval_shape(optimizer.init, params)`` (nothing runs), so an optimizer
    state built for another optimizer or other parameters is named here, not deep inside the
    optimizer's update (``'EmptyState' object has no attribute 'mu'``). An ``init`` that cannot
    be traced is left to the optimizer.

    Raises:
      ValueError: the first place where the two differ.
    """
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
    try:
        expected = jax.eval_shape(optimizer.init, abstract)
    except TypeError:  # an init that reads concrete values; its own update reports a mismatch
        return
    difference = tree_difference(opt_state, expected, name, "optimizer.init(params)")
    if difference is not None:
        raise ValueError(
            f"{name} does not match the optimizer the step applies: {difference}; was the state built "
            "for another optimizer (or other parameters)? Build it with TrainState.create(params, "
            "optimizer) for the optimizer that updates it"
        )


def check_grads(scaled_grads: Any, params: Any) -> None:
    """One gradient per parameter, of its shape (the dtypes may differ: float32 gradients, any masters)."""
    if not same_structure(scaled_grads, params):
        raise ValueError(
            "scaled_grads must have the structure of the params (one gradient per parameter): "
            f"{tree_difference(scaled_grads, params, 'scaled_grads', 'params')}"
        )
    for (path, grad), param in zip(jax.tree_util.tree_leaves_with_path(scaled_grads), jax.tree.leaves(params)):
        if jnp.shape(grad) != jnp.shape(param):
            where = jax.tree_util.keystr(path)
            raise ValueError(
                f"scaled_grads{where} has shape {jnp.shape(grad)}, params{where} has "
                f"{jnp.shape(param)}; a gradient is shaped like its parameter"
            )


def spike_window(state: Any) -> Any:
    """The window of ``state``'s spike guard (a :class:`leanstep.TrainState`), or None without one.

    Raises:
      ValueError: a state with a guard and no window of it (built by hand, or replaced with ``spike=None``).
    """
    guard = state.spike_guard
    if guard is not None and (state.spike is None or jnp.shape(state.spike.values) != (len(guard.watch), guard.buffer)):
        raise ValueError(
            f"the state's spike guard {guard} has no window of its own in state.spike; build the state with "
            "TrainState.create(..., spike_guard=guard), which makes both"
        )
    return state.spike
