"""The step-0 state made in one compiled program, from the model's initializer.

Made eagerly, ``TrainState.create(init(key), optimizer)`` holds the float32 parameters from
``init`` in the caller's variable beside the state: 4 bytes a parameter more than a state of
bfloat16 masters and 8-bit moments (about 4), so a model that trains in a chip's memory cannot be
made in it (1.31B parameters on a 16 GiB TPU v5e: out of memory at the first step).
:meth:`leanstep.TrainState.create_from` calls ``init`` and ``TrainState.create`` inside one
``jax.jit`` program, whose outputs are the state alone: the float32 parameters are temporaries of
that program, if XLA keeps them at all. The checks here are of ``init`` and what it returns; the
state's own checks are ``create``'s.

One program may hold every float32 parameter at once (XLA schedules ``init``'s random draws
before their casts), and at 2.5B parameters on a 16 GiB TPU v5e it did: 18.84 GB of temporaries
for a state of 10.2 GB, refused as it compiled. Where the one program does not fit the device
(refused by XLA, or larger than the device's free memory), the state is made in several
programs, each computing ``init`` and keeping only a group of the state's leaves of at most
:data:`STREAM_BYTES` of float32 parameters: XLA drops the rest of the work (the other
parameters' draws, where ``init`` draws them apart), so at most a group's float32 parameters
live beside the state made so far. Each leaf is computed by the same operations either way:
the same bits.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.step.param_checks import check_params

__all__ = [
    "STREAM_BYTES",
    "check_init",
    "check_shardings",
    "fits_on_device",
    "initial_params",
    "leaf_groups",
    "make_in_one_program",
]

#: A state made in groups (the module doc): each group at most this many bytes of float32
#: parameters (4 a state leaf's entry), or one leaf.
STREAM_BYTES = 1 << 30
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


def leaf_groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (a state leaf's entries) in groups of at most ``limit``
    float32 bytes each, or one leaf where a leaf alone is more.

    Example:
      >>> leaf_groups([10, 10, 30, 5], limit=80)
      [[0, 1], [2], [3]]
    """
    groups: list[list[int]] = []
    total = limit + 1
    for index, size in enumerate(sizes):
        if total + 4 * size > limit:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += 4 * size
    return groups


def fits_on_device(compiled: Any) -> bool:
    """Whether a compiled program's outputs and temporaries fit this process's first device's free memory
    (True where the device does not say: a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return True
    memory = compiled.memory_analysis()
    need = memory.output_size_in_bytes + memory.temp_size_in_bytes
    return bool(need <= stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def make_in_one_program(make: Callable[[Any], Any], model_state: Any, shardings: Any) -> Any:
    """``make(model_state)`` as one ``jax.jit`` program, its outputs laid out by ``shardings`` (None:
    jit's default); where that program does not fit the device, a program for each group of the
    state's leaves (the module doc). Inside a trace, the one program, traced.

    ``model_state`` is the program's argument, not a constant folded into it.
    """
    jitted = jax.jit(make) if shardings is None else jax.jit(make, out_shardings=shardings)
    if isinstance(jnp.zeros(()), jax.core.Tracer):  # under jit or eval_shape: nothing is run here
        return jitted(model_state)
    try:
        compiled = jitted.lower(model_state).compile()
    except Exception as error:  # XLA:TPU refuses a program past the chip's memory as it compiles
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return _made_in_groups(make, model_state, shardings)
    if not fits_on_device(compiled):
        return _made_in_groups(make, model_state, shardings)
    return compiled(model_state)


def _made_in_groups(make: Callable[[Any], Any], model_state: Any, shardings: Any) -> Any:
    shapes, treedef = jax.tree.flatten(jax.eval_shape(make, model_state))
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        layouts = [shardings] * len(shapes)
    else:
        layouts = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    leaves: list[Any] = []
    for group in leaf_groups([int(math.prod(leaf.shape)) for leaf in shapes], STREAM_BYTES):
        part = functools.partial(_kept, make, group)
        outs = [layouts[i] for i in group]
        made = jax.jit(part)(model_state) if shardings is None else jax.jit(part, out_shardings=outs)(model_state)
        leaves.extend(made)
    return jax.tree.unflatten(treedef, leaves)


def _kept(make: Callable[[Any], Any], group: list[int], model_state: Any) -> list[Any]:
    """The leaves ``group`` of ``make(model_state)``: what one program of a state made in groups returns."""
    leaves = jax.tree.leaves(make(model_state))
    return [leaves[i] for i in group]
