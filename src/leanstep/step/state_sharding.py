"""Where a train state lives on a mesh: parameters and their optimizer moments by the partition
rules, everything else (step counter, loss scale, PRNG key, model state, FP8 state) replicated.

The mesh roles and the rules are :mod:`leanstep.sharding`'s; this module applies them to a
:class:`leanstep.TrainState`, which the sharding package does not know.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.blocks.fp8_state import merge_fp8, split_fp8
from leanstep.blocks.moments import QuantizedArray
from leanstep.common.checks import same_treedef
from leanstep.sharding.meshes import mesh_axes, place_global
from leanstep.sharding.partition_rules import make_spec, param_specs
from leanstep.step.state import TrainState

__all__ = ["params_specs", "scales_sharding", "shard_train_state", "state_shardings"]

Tree = TypeVar("Tree")


def params_specs(params: Any, axes: Any, rules: Any = None) -> Any:
    """:func:`leanstep.sharding.param_specs` of the parameters, and ``P()`` for their FP8 state
    (:mod:`leanstep.blocks.fp8_state`: scales and amax histories are replicated, never split).

    Example:
      >>> import jax.numpy as jnp, leanstep
      >>> from leanstep.blocks.fp8_state import Fp8Collection
      >>> axes = leanstep.sharding.mesh_axes(leanstep.sharding.data_mesh(jax.devices()[:1]), fsdp=True)
      >>> params_specs({"w": jnp.zeros((4, 8)), "fp8": Fp8Collection(jnp.zeros(8))}, axes)["fp8"]
      Fp8Collection(tree=P())
    """
    trainable, fp8 = split_fp8(params)
    replicated = jax.tree.map(lambda _: PartitionSpec(), fp8)
    return merge_fp8(param_specs(trainable, axes, rules), replicated)


def state_shardings(
    state: Tree,
    mesh: Mesh,
    *,
    fsdp: bool = False,
    data_axis: str = "data",
    rules: Any = None,
    fsdp_axis: str = "fsdp",
    tensor_axis: str = "tensor",
) -> Tree:
    """The :class:`NamedSharding` of every leaf of a train state (concrete or abstract).

    The leaves of ``state.params`` and ``state.opt_state`` (every leaf, for a state that is
    not a :class:`leanstep.TrainState`) follow :func:`leanstep.sharding.param_specs` for the mesh's
    roles (:func:`leanstep.sharding.mesh_axes`): split over the FSDP and tensor axes by ``rules``, the
    largest divisible dimension over the FSDP axis otherwise, replicated over data-parallel
    axes. The step counter, loss scale, PRNG key and model state are replicated. An
    optimizer-state leaf shaped like no parameter (a count, a scalar) is replicated too.

    Args:
      state: a :class:`leanstep.TrainState`, any pytree of arrays, or of ``jax.ShapeDtypeStruct``.
      mesh: the device mesh.
      fsdp: on a mesh without an FSDP axis, make ``data_axis`` the FSDP axis.
      data_axis: the data-parallel axis of a one-axis mesh.
      rules: partition rules (:mod:`leanstep.sharding.partition_rules`); None: the fallback only.
      fsdp_axis: the name of the FSDP axis, if the mesh has one.
      tensor_axis: the name of the tensor axis, if the mesh has one.

    Returns:
      A pytree of the structure of ``state`` with a ``NamedSharding`` per leaf.

    Raises:
      TypeError: ``mesh`` is not a Mesh.
      ValueError: ``data_axis`` is not one of its axes, or a rule does not fit a parameter.

    Example:
      >>> import jax.numpy as jnp, optax, leanstep
      >>> state = TrainState.create({"w": jnp.zeros((4, 8))}, optax.adam(1e-3))
      >>> mesh = leanstep.sharding.data_mesh(jax.devices()[:1])
      >>> state_shardings(state, mesh, fsdp=True).params["w"].spec
      P()
    """
    axes = mesh_axes(mesh, data_axis, fsdp=fsdp, fsdp_axis=fsdp_axis, tensor_axis=tensor_axis)
    replicated = NamedSharding(mesh, PartitionSpec())
    named = lambda spec: NamedSharding(mesh, spec)
    if not isinstance(state, TrainState):
        return jax.tree.map(named, param_specs(state, axes, rules), is_leaf=lambda x: isinstance(x, PartitionSpec))
    params = jax.tree.map(
        named, params_specs(state.params, axes, rules), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    fallback = lambda leaf: named(param_specs(leaf, axes))
    # The optimizer's state is of the trainable parameters only (TrainState.create).
    trainable, trainable_shardings = split_fp8(state.params)[0], split_fp8(params)[0]
    error = None if state.master_error is None else trainable_shardings  # the Kahan buffer: like its masters
    return jax.tree.map(lambda _: replicated, state).replace(
        params=params,
        opt_state=_like_params(state.opt_state, trainable, trainable_shardings, fallback),
        master_error=error,
    )


def _like_params(opt_state: Any, params: Any, shardings: Any, fallback: Callable[[Any], NamedSharding]) -> Any:
    """Optimizer-state subtrees shaped like the params (Adam's mu, nu) laid out like them, and so
    are compressed ones (:func:`leanstep.blocks.compress_moments`: codes like the parameter, block scales
    by :func:`scales_sharding`); other leaves (counts, factored statistics) by the fallback."""
    structure, shapes = jax.tree.structure(params), [np.shape(p) for p in jax.tree.leaves(params)]
    quantized = lambda x: isinstance(x, QuantizedArray)

    def is_params_like(node: Any) -> bool:
        leaves = jax.tree.leaves(node, is_leaf=quantized)
        return (
            same_treedef(jax.tree.structure(node, is_leaf=quantized), structure)
            and [x.shape if quantized(x) else np.shape(x) for x in leaves] == shapes
        )

    def place(node: Any) -> Any:
        if not is_params_like(node):
            return jax.tree.map(fallback, node)
        laid = [
            QuantizedArray(s, scales_sharding(s, x.shape, x.block_size), x.signed, x.block_size) if quantized(x) else s
            for x, s in zip(jax.tree.leaves(node, is_leaf=quantized), jax.tree.leaves(shardings))
        ]
        return jax.tree.unflatten(jax.tree.structure(node, is_leaf=quantized), laid)

    return jax.tree.map(place, opt_state, is_leaf=is_params_like)


def scales_sharding(sharding: NamedSharding, shape: tuple[int, ...], block_size: int) -> NamedSharding:
    """The layout of the block scales of a parameter of ``shape`` laid out by ``sharding``.

    The scales have the parameter's dimensions, the last in blocks of ``block_size``
    (:class:`leanstep.blocks.QuantizedArray`). Each dimension but the last is split as the parameter's.
    The last is split as the parameter's where each device's part of it is whole blocks (then
    each device's scales are those of its own blocks); otherwise a block straddles devices, the
    number of blocks need not divide over them, and the scales are kept whole along it.

    Example:
      >>> columns = NamedSharding(jax.make_mesh((1,), ("fsdp",)), PartitionSpec(None, "fsdp"))
      >>> scales_sharding(columns, (2, 512), 256).spec, scales_sharding(columns, (2, 64), 256).spec
      (P(None, 'fsdp'), P())
    """
    entries = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    if not shape or entries[-1] is None:
        return sharding
    names = entries[-1] if isinstance(entries[-1], tuple) else (entries[-1],)
    devices = int(np.prod([sharding.mesh.shape[name] for name in names]))
    if (shape[-1] // devices) % block_size == 0:
        return sharding
    return NamedSharding(sharding.mesh, make_spec(entries[:-1]))


def shard_train_state(
    state: Tree,
    mesh: Mesh,
    *,
    fsdp: bool = False,
    data_axis: str = "data",
    rules: Any = None,
    fsdp_axis: str = "fsdp",
    tensor_axis: str = "tensor",
) -> Tree:
    """Places ``state`` on ``mesh`` with :func:`state_shardings` (every process passes the same state).

    Args and Raises: as :func:`state_shardings`.

    Returns:
      The state as global ``jax.Array`` s; in a multi-process run each process holds its shards.

    Example:
      >>> import jax.numpy as jnp, optax, leanstep
      >>> state = TrainState.create({"w": jnp.zeros((4, 8))}, optax.sgd(0.1))
      >>> shard_train_state(state, leanstep.sharding.data_mesh()).params["w"].sharding.is_fully_replicated
      True
    """
    shardings = state_shardings(
        state, mesh, fsdp=fsdp, data_axis=data_axis, rules=rules, fsdp_axis=fsdp_axis, tensor_axis=tensor_axis
    )
    return jax.tree.map(place_global, state, shardings)
