"""The step-0 state made in one compiled program, from the model's initializer.

Made eagerly, ``TrainState.create(init(key), optimizer)`` holds the float32 parameters from
``init`` in the caller's variable beside the state: 4 bytes a parameter more than a state of
bfloat16 masters and 8-bit moments (about 4), so a model that trains in a chip's memory cannot be
made in it (1.31B parameters on a 16 GiB TPU v5e: out of memory at the first step).
:meth:`leanstep.TrainState.create_from` calls ``init`` and ``TrainState.create`` inside one
``jax.jit`` program, whose outputs are the state alone: the float32 parameters are temporaries of
that program, if XLA keeps them at all. The checks here are of ``init`` and what it returns; the
state's own checks are ``create``'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from leanstep.step.param_checks import check_params

__all__ = ["check_init", "check_shardings", "initial_params", "make_in_one_program"]

_ZERO_ARGUMENTS = "a zero-argument callable, e.g. functools.partial(init_fn, key)"


def check_init(init: Any) -> None:
    """Raises a ``TypeError`` naming ``init`` unless it can be called with no arguments."""
    if not callable(init):
        raise TypeError(f"init must be {_ZERO_ARGUMENTS}, got {type(init).__name__} {init!r:.80}")
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):  # a builtin without a signature: its call will say
        return
    try:
        signature.bind()
    except TypeError:
        raise TypeError(f"init must be {_ZERO_ARGUMENTS}; it takes arguments: {signature}") from None


def initial_params(init: Callable[[], Any]) -> Any:
    """``init()``, checked as ``TrainState.create`` checks its ``params`` (a tracer passes).

    Raises:
      TypeError, ValueError: what ``init`` returned is not a non-empty pytree of floating arrays
        (a ``jax.ShapeDtypeStruct`` leaf named as such); the message names ``init``.
    """
    params = init()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"init returned a jax.ShapeDtypeStruct at params{jax.tree_util.keystr(path)} (a shape without "
                f"values): init must compute the parameters, {_ZERO_ARGUMENTS}; for shapes only, trace it: "
                "jax.eval_shape(lambda: TrainState.create_from(init, optimizer))"
            )
    try:
        check_params(params)
    except (TypeError, ValueError) as error:
        raise type(error)(f"init must return the parameters, a pytree of floating arrays: {error}") from None
    return params


def check_shardings(shardings: Any) -> None:
    """Raises a ``TypeError`` naming ``shardings`` unless every leaf is a ``jax.sharding.Sharding``."""
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    for path, leaf in jax.tree_util.tree_leaves_with_path(shardings, is_leaf=is_sharding):
        if not is_sharding(leaf):
            raise TypeError(
                f"shardings{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; shardings must be a pytree of "
                "jax.sharding.Sharding shaped like the state (leanstep.step.state_sharding.state_shardings), "
                "one Sharding for every leaf, or None"
            )


def make_in_one_program(make: Callable[[Any], Any], model_state: Any, shardings: Any) -> Any:
    """``make(model_state)`` as one ``jax.jit`` program, its outputs laid out by ``shardings`` (None: jit's default).

    ``model_state`` is the program's argument, not a constant folded into it.
    """
    if shardings is None:
        return jax.jit(make)(model_state)
    return jax.jit(make, out_shardings=shardings)(model_state)
