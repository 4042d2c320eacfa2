"""What may be trained as parameters: floating arrays, and never a framework's other variables.

Handing a whole model to the optimizer is the easy mistake: a Flax NNX module or its full
``nnx.state`` (with ``BatchStat`` and RNG variables), Linen's ``variables`` with a
``batch_stats`` collection, an Equinox module with non-array fields. The optimizer would then
weight-decay running statistics and their updates would be lost. :func:`check_params` refuses
each, naming the leaf and the split that fixes it. Frameworks are looked up in
``sys.modules`` only: a framework that was never imported cannot be what ``params`` holds.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import jax

from leanstep.blocks.fp8_state import is_fp8_state
from leanstep.common.checks import check_floating_tree

__all__ = ["check_params"]

_NNX_SPLIT = "graphdef, params, model_state = leanstep.frameworks.nnx.split(model)"
_LINEN_SPLIT = "params, model_state = leanstep.frameworks.linen.split(variables)"
_EQUINOX_SPLIT = "params, static = leanstep.frameworks.equinox.split(model)"


def _check_nnx(params: Any) -> None:
    nnx = getattr(sys.modules.get("flax.nnx"), "Module", None) and sys.modules["flax.nnx"]
    if nnx is None:
        return
    if isinstance(params, nnx.Module):
        raise TypeError(
            f"params is an nnx.Module ({type(params).__name__}); train its nnx.Param variables and "
            f"carry the rest as model state: {_NNX_SPLIT}"
        )
    variables = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, leaf in variables:
        if isinstance(leaf, nnx.Variable) and not isinstance(leaf, nnx.Param) and not is_fp8_state(leaf):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is an nnx.{type(leaf).__name__}, not an nnx.Param: "
                f"the optimizer would update it; split the model instead: {_NNX_SPLIT}"
            )


def _check_linen(params: Any) -> None:
    if isinstance(params, Mapping) and "params" in params and len(params) > 1:
        # FP8 state as leanstep.frameworks.linen.split lays it out: Flax's collection, wrapped.
        if set(params) == {"params", "_overwrite_with_gradient"} and is_fp8_state(params["_overwrite_with_gradient"]):
            return
        others = sorted(str(k) for k in params if k != "params")
        raise TypeError(
            f"params holds the Linen collections 'params' and {others}: train variables['params'] and "
            f"carry the other collections as model state: {_LINEN_SPLIT}"
        )


def _check_linen_module(params: Any) -> None:
    linen = sys.modules.get("flax.linen")
    if linen is None:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, linen.Module)):
        if isinstance(leaf, linen.Module):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is a Linen module ({type(leaf).__name__}), which holds no "
                f"parameters: initialize it (variables = module.init(key, x)), then {_LINEN_SPLIT}"
            )


def _check_equinox(params: Any) -> None:
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return
    is_state = lambda x: isinstance(x, eqx.nn.State)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_state):
        if is_state(leaf):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is an eqx.nn.State (batch statistics, counters), not "
                "parameters: pass it as TrainState.create(params, optimizer, model_state=state), with "
                "has_state=True and leanstep.frameworks.equinox.stateful_loss"
            )
    if not isinstance(params, eqx.Module):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not eqx.is_inexact_array(leaf):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is a {type(leaf).__name__} in an Equinox module; "
                f"train only its floating arrays: {_EQUINOX_SPLIT}"
            )


def check_params(params: Any) -> None:
    """Raises unless ``params`` is a non-empty pytree of floating arrays and no framework's other state.

    Raises:
      ValueError: no leaves.
      TypeError: a leaf that is not a floating array (a ``jax.ShapeDtypeStruct`` included: it
        has a dtype but no values), or a framework's module or non-parameter variables (the
        message names the leaf and the split to use).

    Example:
      >>> import jax.numpy as jnp
      >>> check_params({"params": {"w": jnp.ones(2)}, "batch_stats": {"mean": jnp.zeros(2)}})
      Traceback (most recent call last):
      ...
      TypeError: params holds the Linen collections 'params' and ['batch_stats']: ...
    """
    if not jax.tree.leaves(params):
        raise ValueError("params must have at least one array leaf, got an empty tree")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is a jax.ShapeDtypeStruct (a shape without values); "
                "TrainState.create needs concrete arrays (e.g. model.init(key)); for shapes only, trace it: "
                "jax.eval_shape(lambda p: TrainState.create(p, optimizer), params), as leanstep.planning.plan does"
            )
    _check_nnx(params)
    _check_linen(params)
    _check_linen_module(params)
    _check_equinox(params)
    check_floating_tree(params, "params", what="floating-point parameters")
