"""Flax Linen models in leanstep's step: the ``params`` collection trains, the others are model state.

.. code-block:: python

    variables = module.init(key, x, train=False)
    params, model_state = leanstep.frameworks.linen.split(variables)

    def loss_fn(params, model_state, batch, key):
        logits, model_state = leanstep.frameworks.linen.apply(
            module, params, model_state, batch["x"], train=True, rngs={"dropout": key})
        return cross_entropy(logits, batch["y"]), model_state

    step = leanstep.make_train_step(loss_fn, has_state=True, uses_rng=True)

:func:`apply` is ``module.apply`` with every collection but ``params`` mutable; a model with
no other collection gets ``model_state = {}`` and may use a plain loss without ``has_state``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

__all__ = ["apply", "merge", "split"]


def split(variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(variables["params"], {every other collection})``.

    Raises:
      ValueError: ``variables`` has no ``params`` collection.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> module = nn.BatchNorm(use_running_average=False)
      >>> params, model_state = split(module.init(jax.random.key(0), jnp.ones((4, 3))))
      >>> sorted(params), sorted(model_state["batch_stats"])
      (['bias', 'scale'], ['mean', 'var'])
    """
    if "params" not in variables:
        raise ValueError(f"variables have no 'params' collection, only {sorted(variables)}")
    return variables["params"], {name: value for name, value in variables.items() if name != "params"}


def merge(params: Any, model_state: Mapping[str, Any]) -> dict[str, Any]:
    """The ``variables`` dict again, for ``module.apply``."""
    return {"params": params, **model_state}


def apply(
    module: nn.Module,
    params: Any,
    model_state: Mapping[str, Any],
    *args: Any,
    axis_name: str | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """``module.apply`` with the model state's collections mutable: ``(out, new_model_state)``.

    Keyword arguments (``rngs=``, ``train=``, ...) go to ``module.apply``. ``axis_name`` binds the
    name a model written for ``pmap`` reduces over (``nn.BatchNorm(axis_name="batch")``, as in
    flax's imagenet ResNet) to an axis of one member, so its ``pmean`` is the identity: leanstep's
    step hands the loss the whole (micro)batch, whose statistics are already the global ones
    (without it, JAX's "unbound axis name").

    Example:
      >>> import jax, jax.numpy as jnp
      >>> module = nn.BatchNorm(use_running_average=False, momentum=0.5)
      >>> params, model_state = split(module.init(jax.random.key(0), jnp.ones((4, 3))))
      >>> y, model_state = apply(module, params, model_state, jnp.full((4, 3), 2.0))
      >>> model_state["batch_stats"]["mean"]
      Array([1., 1., 1.], dtype=float32)
    """
    if axis_name is not None:
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(f"axis_name must be a non-empty string (the module's axis_name=), got {axis_name!r}")
        bound = lambda p, s, *a: apply(module, p, s, *a, **kwargs)
        return jax.vmap(bound, in_axes=None, out_axes=None, axis_name=axis_name, axis_size=1)(
            params, model_state, *args
        )
    variables = merge(params, model_state)
    if not model_state:
        return module.apply(variables, *args, **kwargs), dict(model_state)
    out, updates = module.apply(variables, *args, mutable=list(model_state), **kwargs)
    return out, {**model_state, **updates}
