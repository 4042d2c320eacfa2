"""What a model does to be lean when sharded: gather each layer just before use, pin activations.

Two calls, both the identity outside a sharded step (one device, plain ``jax.jit``), so a
model that makes them runs unchanged everywhere:

* :func:`gathered` ``(layer_params, path)``: the parameters at ``path`` whole over the FSDP
  axis (still split over the tensor axis). Called on one layer's slice *inside* the layer
  scan and inside the rematerialized block, it makes FSDP ZeRO-3: XLA all-gathers that
  layer just before its forward and again in its backward (the gathered copy is never
  saved as a residual), and reduce-scatters its gradient. Leaves a model never gathers are
  gathered whole once per step by the sharding layer.
* :func:`constrain` ``(x, "batch", None)``: an activation's layout by role, one per
  dimension: ``"batch"`` (rows over the batch axes), ``"tensor"`` (over the tensor axis) or
  ``None``. Without it XLA may split a matmul by weight columns and move batch rows instead
  of gathering weights.

The sharding layer (:class:`leanstep.step.ShardingLayer`) sets the context these read while it
traces the step; a hand-written step can set it with :func:`sharding_context`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from leanstep.sharding.partition_rules import MeshAxes, make_spec, param_path

__all__ = ["constrain", "gathered", "sharding_active", "sharding_context"]


@dataclasses.dataclass
class _Context:
    axes: MeshAxes
    specs: dict[str, tuple[int, PartitionSpec]]  # parameter path -> (rank, spec) of the whole parameter
    manual: frozenset[str]  # axes of an enclosing shard_map (already local: never named in a constraint)
    record: set[str] = dataclasses.field(default_factory=set)


_CONTEXT: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("leanstep_model_sharding", default=None)


@contextlib.contextmanager
def sharding_context(axes: MeshAxes, specs: Any, params: Any, *, manual: Any = ()) -> Iterator[set[str]]:
    """Makes :func:`gathered` and :func:`constrain` act while a step is traced inside it.

    Args:
      axes: the mesh's roles (:class:`leanstep.sharding.MeshAxes`).
      specs: the ``PartitionSpec`` of every parameter (:func:`leanstep.sharding.param_specs`).
      params: the parameters (or their shapes), for the ranks.
      manual: mesh axes that are manual here (inside a ``shard_map`` over them).

    Yields:
      The set of parameter paths the model gathered, filled as it is traced.
    """
    ranks = {param_path(path): len(jax.numpy.shape(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    flat = {
        param_path(path): (ranks[param_path(path)], spec)
        for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    }
    context = _Context(axes, flat, frozenset(manual))
    token = _CONTEXT.set(context)
    try:
        yield context.record
    finally:
        _CONTEXT.reset(token)


def constrain_spec(x: Any, mesh: Any, entries: Any, manual: Any = ()) -> Any:
    """``x`` constrained to ``entries`` on ``mesh`` (manual axes dropped: inside a ``shard_map``
    over them the context mesh marks them, and a bare spec refers to it)."""
    spec = make_spec(entries, drop=set(manual))
    return jax.lax.with_sharding_constraint(x, spec if manual else NamedSharding(mesh, spec))


def sharding_active() -> bool:
    """Whether a sharded step is being traced (:func:`sharding_context` is in effect)."""
    return _CONTEXT.get() is not None


def gathered(tree: Any, path: str = "") -> Any:
    """``tree`` (parameters found at ``path`` in the params, or one layer of them) whole over FSDP.

    Args:
      tree: a parameter leaf or subtree, in the compute dtype; a leaf may be one layer
        (rank one less) of a parameter stacked over layers.
      path: where ``tree`` sits in the whole parameter tree, keys joined by ``/``
        (``"blocks"`` for the slice a layer scan hands its body).

    Returns:
      ``tree`` constrained to its partition spec without the FSDP axis; outside a sharded
      step, ``tree`` itself.

    Raises:
      ValueError: ``path`` names no parameter, or a leaf's rank fits neither the parameter
        nor one layer of it.

    Example:
      >>> gathered({"w": jax.numpy.ones(2)}, "blocks")  # not sharded: the identity
      {'w': Array([1., 1.], dtype=float32)}
    """
    context = _CONTEXT.get()
    if context is None:
        return tree
    fsdp = context.axes.fsdp

    def one(subpath: Any, leaf: Any) -> Any:
        name = "/".join(p for p in (path.strip("/"), param_path(subpath)) if p)
        if name not in context.specs:
            known = ", ".join(sorted(context.specs)[:6])
            raise ValueError(
                f"gathered(..., path={path!r}): {name!r} is not a parameter path (paths are keys "
                f"joined by '/', e.g. {known})"
            )
        rank, spec = context.specs[name]
        entries = tuple(spec) + (None,) * (rank - len(spec))
        if leaf.ndim == rank - 1:
            entries = entries[1:]  # one layer of a parameter stacked over layers
        elif leaf.ndim != rank:
            raise ValueError(
                f"gathered: {name!r} has rank {rank} but the value given has shape {leaf.shape}: pass "
                "the parameter or one layer of it"
            )
        context.record.add(name)
        return constrain_spec(leaf, context.axes.mesh, make_spec(entries, drop={fsdp}), context.manual)

    return jax.tree_util.tree_map_with_path(one, tree)


def constrain(x: Any, *roles: str | None) -> Any:
    """``x`` laid out by role per dimension: ``"batch"``, ``"tensor"`` or None (whole).

    Raises:
      ValueError: not one role per dimension, or an unknown role.

    Example:
      >>> constrain(jax.numpy.ones((2, 3)), "batch", None).shape  # not sharded: the identity
      (2, 3)
    """
    if len(roles) != jax.numpy.ndim(x):
        raise ValueError(f"constrain needs one role per dimension of x (shape {jax.numpy.shape(x)}), got {roles}")
    for role in roles:
        if role not in ("batch", "tensor", None):
            raise ValueError(f"constrain: role {role!r} is not 'batch', 'tensor' or None")
    context = _CONTEXT.get()
    if context is None:
        return x
    axes = context.axes
    tensor = axes.axis_of("tensor")
    entries = tuple(axes.batch if role == "batch" else tensor if role == "tensor" else None for role in roles)
    return constrain_spec(x, axes.mesh, entries, context.manual)
