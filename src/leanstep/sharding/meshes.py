"""Where every leaf lives on a ``jax.sharding.Mesh``: the roles of its axes, the state, the batch.

leanstep builds no distribution of its own: it names where each array lives
(:class:`jax.sharding.NamedSharding`); XLA's SPMD partitioner and ``jax.shard_map`` (in
:mod:`leanstep.step.sharding_layer`) do the rest.

* The mesh's axes have roles by name (:func:`mesh_axes`): an ``"fsdp"`` axis splits the
  parameters and the batch rows, a ``"tensor"`` axis splits the parameters only, every other
  axis is data parallel (the batch rows split, the parameters replicated).
* The batch is split by rows over every axis but the tensor axis (:func:`batch_sharding`,
  :func:`shard_batch`).
* Parameters and the optimizer-state leaves that mirror them follow the partition rules
  (:mod:`leanstep.sharding.partition_rules`), with the largest dimension divisible by the FSDP axis as
  the fallback (:func:`fsdp_partition_spec`); a train state's leaves are laid out by
  :mod:`leanstep.step.state_sharding`, which knows the state.
* In a multi-process run each process builds only its own shards from the same host value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.common.checks import check_bool
from leanstep.sharding.partition_rules import MeshAxes, fallback_spec

__all__ = [
    "batch_sharding",
    "check_mesh",
    "data_mesh",
    "fsdp_partition_spec",
    "mesh_axes",
    "place_global",
    "shard_batch",
]

Tree = TypeVar("Tree")


def check_mesh(mesh: Any, data_axis: Any) -> int:
    """Validates ``mesh`` and ``data_axis``; returns the data axis's size."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(data_axis, str) or data_axis not in mesh.axis_names:
        raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
    return int(mesh.shape[data_axis])


def check_auto_axes(mesh: Mesh) -> None:
    """Refuses a mesh with Explicit (or Manual) axes: the step lays values out with sharding
    constraints, which JAX allows only over Auto axes (``jax.make_mesh`` makes Explicit ones)."""
    types = getattr(mesh, "axis_types", None) or ()
    auto = getattr(jax.sharding.AxisType, "Auto", None)
    other = tuple(name for name, kind in zip(mesh.axis_names, types) if kind != auto)
    if other:
        n = len(mesh.axis_names)
        raise ValueError(
            f"mesh axes {other} are not Auto axes (jax.make_mesh makes Explicit ones): leanstep lays the "
            f"step out with sharding constraints, which need Auto axes; build the mesh with "
            f"axis_types=(jax.sharding.AxisType.Auto,) * {n}, e.g. jax.make_mesh(shape, names, "
            f"axis_types=(jax.sharding.AxisType.Auto,) * {n}), or use leanstep.sharding.data_mesh()"
        )


def mesh_axes(
    mesh: Any, data_axis: str = "data", *, fsdp: bool = False, fsdp_axis: str = "fsdp", tensor_axis: str = "tensor"
) -> MeshAxes:
    """The roles of ``mesh``'s axes, by name.

    An axis named ``fsdp_axis`` splits the parameters (and batch rows), one named
    ``tensor_axis`` is tensor parallel, and every other axis is data parallel (a replica
    axis). ``fsdp=True`` on a mesh without an FSDP axis makes ``data_axis`` the FSDP axis
    (the one-axis FSDP of ``make_train_step(mesh=data_mesh(), fsdp=True)``).

    Raises:
      TypeError: ``mesh`` is not a Mesh or ``fsdp`` not a bool.
      ValueError: the mesh has Explicit axes (name ``axis_types``); ``fsdp=True`` on a mesh with
        neither an FSDP axis nor ``data_axis``; ``data_axis`` other than ``"data"`` and not an axis.
        Otherwise the data axes may have any names: every axis but the FSDP and tensor axes is one.

    Example:
      >>> axes = mesh_axes(data_mesh(jax.devices()[:1]), fsdp=True)
      >>> axes.replica, axes.fsdp, axes.tensor, axes.batch
      ((), 'data', None, ('data',))
    """
    check_bool("fsdp", fsdp)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    check_auto_axes(mesh)
    names = mesh.axis_names
    if fsdp and fsdp_axis not in names:
        check_mesh(mesh, data_axis)  # the axis the state is split over: it must exist
    elif data_axis != "data" and data_axis not in names:  # a name the caller chose must be an axis
        check_mesh(mesh, data_axis)
    fsdp_name = fsdp_axis if fsdp_axis in names else (data_axis if fsdp else None)
    tensor = tensor_axis if tensor_axis in names else None
    replica = tuple(a for a in names if a not in (fsdp_name, tensor))
    return MeshAxes(mesh, replica, fsdp_name, tensor)


def data_mesh(devices: Sequence[jax.Device] | None = None, data_axis: str = "data") -> Mesh:
    """A one-dimensional mesh over ``devices`` (default: every device of every process).

    Args:
      devices: the devices, in order; None: ``jax.devices()``.
      data_axis: the name of the mesh's one axis.

    Returns:
      ``Mesh(devices, (data_axis,))``.

    Raises:
      ValueError: ``devices`` is empty or ``data_axis`` not a non-empty string.

    Example:
      >>> mesh = data_mesh()
      >>> mesh.axis_names, mesh.shape["data"] == len(jax.devices())
      (('data',), True)
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must name at least one device, got an empty sequence")
    if not isinstance(data_axis, str) or not data_axis:
        raise ValueError(f"data_axis must be a non-empty string, got {data_axis!r}")
    return Mesh(np.array(devices), (data_axis,))


def batch_sharding(mesh: Mesh, data_axis: str = "data", *, tensor_axis: str = "tensor") -> NamedSharding:
    """Rows split contiguously over every batch axis (all but the tensor axis); other dimensions whole.

    Device ``d`` of the ``D`` devices along the batch axes holds rows ``[d B/D, (d+1) B/D)``
    of a batch of ``B`` rows (one :class:`NamedSharding` serves every leaf of a batch pytree).

    Raises:
      TypeError: ``mesh`` is not a Mesh.
      ValueError: ``data_axis`` is not one of its axes (on a mesh without an FSDP axis).

    Example:
      >>> batch_sharding(data_mesh()).spec
      P('data',)
    """
    return NamedSharding(mesh, mesh_axes(mesh, data_axis, tensor_axis=tensor_axis).rows())


def fsdp_partition_spec(shape: Sequence[int], num_shards: int, data_axis: str = "data") -> PartitionSpec:
    """The fallback FSDP split of one array: its largest dimension divisible by ``num_shards``.

    Ties go to the earliest such dimension; an array with none (or a scalar) is replicated.
    Partition rules (:mod:`leanstep.sharding.partition_rules`) decide before it.

    Example:
      >>> fsdp_partition_spec((3, 16, 16), 8), fsdp_partition_spec((6,), 4)
      (P(None, 'data'), P())
    """
    # No trailing Nones: XLA hands outputs back in that canonical form, and a spec that differs
    # only in them would make the next step's inputs look resharded (and recompile).
    return PartitionSpec(*fallback_spec(tuple(shape), data_axis, num_shards))


def place_global(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` as a global array with ``sharding``: each process builds only its own shards."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)  # already global: let JAX reshard it
    host = np.asarray(value)
    # Every process builds only its own shards from the same host value; device_put of a
    # host array onto devices of other processes is not allowed in a multi-process run.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_batch(batch: Tree, mesh: Mesh, data_axis: str = "data", *, tensor_axis: str = "tensor") -> Tree:
    """Places a whole batch (the same on every process) on ``mesh``, rows split over the batch axes.

    The batch axes are every axis but the tensor axis (:func:`batch_sharding`). Each process
    copies only the rows its own devices hold, so a multi-process run feeds the global
    batch without any cross-process transfer.

    Args:
      batch: a pytree of host arrays sharing a leading batch axis.
      mesh: the device mesh.
      data_axis: the data axis of a one-axis mesh (checked).
      tensor_axis: the tensor axis, if the mesh has one (rows are whole along it).

    Returns:
      ``batch`` as global ``jax.Array`` s with :func:`batch_sharding`.

    Raises:
      ValueError: the batch size is not divisible by the devices along the batch axes (or a
        leaf is a scalar).

    Example:
      >>> import numpy as np
      >>> batch = shard_batch({"x": np.zeros((8, 3), np.float32)}, data_mesh(jax.devices()[:1]))
      >>> batch["x"].shape, batch["x"].sharding.spec
      ((8, 3), P('data',))
    """
    axes = mesh_axes(mesh, data_axis, tensor_axis=tensor_axis)
    num_shards = axes.size(axes.batch)
    sharding = NamedSharding(mesh, axes.rows())

    def place(path: Any, leaf: Any) -> jax.Array:
        shape = np.shape(leaf)
        if not shape or shape[0] % num_shards:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has shape {shape}; its leading (batch) size must be "
                f"divisible by the {num_shards} devices of mesh axes {axes.batch}"
            )
        return place_global(leaf, sharding)

    return jax.tree_util.tree_map_with_path(place, batch)
