"""Flax NNX models in leanstep's step: ``nnx.Param`` variables train, every other variable is model state.

.. code-block:: python

    graphdef, params, model_state = leanstep.frameworks.nnx.split(model)
    state = leanstep.TrainState.create(params, optax.adamw(1e-3), model_state=model_state)
    step = leanstep.make_train_step(leanstep.frameworks.nnx.loss(graphdef, loss_of_model), has_state=True)
    ...
    model = leanstep.frameworks.nnx.merge(graphdef, state.params, state.model_state)

``loss_of_model(model, batch[, key])`` is the function an ``nnx.Optimizer`` user already
writes for ``nnx.value_and_grad``. BatchNorm statistics and the counters of a model's own
``nnx.Rngs`` (Dropout) are model state: each microbatch sees what the one before it left,
exactly as one call after another of the model would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

__all__ = ["loss", "merge", "split"]


def split(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State]:
    """``(graphdef, params, model_state)``: the ``nnx.Param`` variables, and all the others.

    Example:
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> graphdef, params, model_state = split(model)
      >>> sorted(params["layers"][0]), sorted(model_state["layers"][1])
      (['bias', 'kernel'], ['mean', 'var'])
    """
    graphdef, params, *others = nnx.split(model, nnx.Param, ...)  # one State per filter
    (model_state,) = others
    return graphdef, params, model_state


def merge(graphdef: Any, params: nnx.State, model_state: nnx.State) -> nnx.Module:
    """The module again, e.g. from a trained :class:`leanstep.TrainState`'s params and model state."""
    return nnx.merge(graphdef, params, model_state)


def loss(graphdef: Any, fn: Callable[..., Any]) -> Callable[..., tuple[Any, nnx.State]]:
    """``fn(model, batch[, key])`` as ``loss_fn(params, model_state, batch[, key]) -> (out, new_model_state)``.

    Use it with ``make_train_step(..., has_state=True)``; ``out`` is whatever ``fn``
    returns (a loss, ``(loss, aux)``, ``(loss_sum, count)``).

    Example:
      >>> import jax.numpy as jnp
      >>> model = nnx.Sequential(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), nnx.BatchNorm(1, rngs=nnx.Rngs(0)))
      >>> graphdef, params, model_state = split(model)
      >>> loss_fn = loss(graphdef, lambda m, batch: jnp.mean(m(batch["x"]) ** 2))
      >>> value, new_state = loss_fn(params, model_state, {"x": jnp.ones((4, 2))})
      >>> value.shape, new_state["layers"][1]["mean"][...].shape
      ((), (1,))
    """

    def loss_fn(params: nnx.State, model_state: nnx.State, batch: Any, *key: Any) -> tuple[Any, nnx.State]:
        # Fresh variables (copy=True) belong to the trace of the transform calling this
        # (value_and_grad inside leanstep's scan), so the model may update them there.
        model = nnx.merge(graphdef, params, model_state, copy=True)
        out = fn(model, batch, *key)
        return out, nnx.state(model, nnx.Not(nnx.Param))

    return loss_fn
