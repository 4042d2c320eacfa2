"""Equinox models in leanstep's step: the floating arrays train, everything else is static.

.. code-block:: python

    params, static = leanstep.frameworks.equinox.split(model)
    step = leanstep.make_train_step(leanstep.frameworks.equinox.loss(static, loss_of_model))
    ...
    model = leanstep.frameworks.equinox.combine(state.params, static)

Models with state (``eqx.nn.BatchNorm``, ``eqx.nn.make_with_state``) pass their
``eqx.nn.State`` as leanstep's model state, with :func:`stateful_loss` and ``has_state=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx

__all__ = ["combine", "loss", "split", "stateful_loss"]


def split(model: eqx.Module) -> tuple[eqx.Module, eqx.Module]:
    """``(params, static)`` = ``eqx.partition(model, eqx.is_inexact_array)``.

    Example:
      >>> import jax
      >>> params, static = split(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0)))
      >>> len(jax.tree.leaves(params)), static.activation is jax.nn.relu
      (4, True)
    """
    return eqx.partition(model, eqx.is_inexact_array)


def combine(params: eqx.Module, static: eqx.Module) -> eqx.Module:
    """The model again: ``eqx.combine(params, static)``."""
    return eqx.combine(params, static)


def loss(static: eqx.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(model, batch[, key])`` as ``loss_fn(params, batch[, key])``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params, static = split(eqx.nn.Linear(2, 1, key=jax.random.key(0)))
      >>> loss_fn = loss(static, lambda m, batch: jnp.mean(jax.vmap(m)(batch["x"]) ** 2))
      >>> loss_fn(params, {"x": jnp.ones((3, 2))}).shape
      ()
    """
    return lambda params, batch, *key: fn(eqx.combine(params, static), batch, *key)


def stateful_loss(static: eqx.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(model, model_state, batch[, key]) -> (out, new_model_state)`` as leanstep's stateful loss.

    ``model_state`` is the model's ``eqx.nn.State``; use it with ``has_state=True``.
    """
    return lambda params, model_state, batch, *key: fn(eqx.combine(params, static), model_state, batch, *key)
