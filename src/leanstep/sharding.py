"""Shardings for data-parallel and fully sharded (FSDP) training on a ``jax.sharding.Mesh``.

leanstep builds no distribution of its own: it names where each array lives
(:class:`jax.sharding.NamedSharding`) and XLA's SPMD partitioner inserts the collectives.

* The batch is split by rows along the mesh's data axis (:func:`batch_sharding`).
* Data parallel: parameters and optimizer state are replicated; XLA all-reduces the gradient.
* FSDP (ZeRO-3 style): every parameter and optimizer-state leaf is split along its largest
  dimension divisible by the data-axis size (leaves with no such dimension, scalars and the
  rest of the state are replicated). The state is sharded at rest and in the optimizer update;
  the step all-gathers the compute-dtype parameters once for the forward and backward pass
  (so a whole copy of them is alive during the step) and XLA reduces the gradient to each
  device's shard (on CPU as an all-reduce followed by a local slice).
* With microbatches, XLA reduces each microbatch's gradient inside the scan (one fused
  all-reduce per microbatch, not one per step): GSPMD keeps the loss function's global
  semantics (it sees the whole microbatch, whatever it computes across rows), and a per-device
  accumulation with one reduction per step would need ``shard_map`` and a loss that is a
  mean over rows.
* Microbatches under sharding are *strided* (:func:`split_strided_microbatches`): microbatch
  ``j`` takes rows ``j, j+M, j+2M, ...``, so each device's share of every microbatch is made of
  its own rows and no row ever moves between devices.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.accumulation import _check_num_microbatches, split_microbatches

__all__ = [
    "batch_sharding",
    "data_mesh",
    "fsdp_partition_spec",
    "shard_batch",
    "shard_train_state",
    "split_strided_microbatches",
    "state_shardings",
]

Tree = TypeVar("Tree")


def _check_mesh(mesh: Any, data_axis: Any) -> int:
    """Validates ``mesh`` and ``data_axis``; returns the data axis's size."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(data_axis, str) or data_axis not in mesh.axis_names:
        raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
    return int(mesh.shape[data_axis])


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


def batch_sharding(mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """Rows split contiguously along ``data_axis``; every other dimension whole.

    Device ``d`` of ``D`` holds rows ``[d B/D, (d+1) B/D)`` of a batch of ``B`` rows (a
    single :class:`NamedSharding` is a valid sharding for every leaf of a batch pytree).

    Raises:
      TypeError: ``mesh`` is not a Mesh.
      ValueError: ``data_axis`` is not one of its axes.

    Example:
      >>> batch_sharding(data_mesh()).spec
      P('data',)
    """
    _check_mesh(mesh, data_axis)
    return NamedSharding(mesh, PartitionSpec(data_axis))


def fsdp_partition_spec(shape: Sequence[int], num_shards: int, data_axis: str = "data") -> PartitionSpec:
    """The FSDP split of one array: its largest dimension divisible by ``num_shards``.

    Ties go to the earliest such dimension; an array with none (or a scalar) is replicated.

    Example:
      >>> fsdp_partition_spec((3, 16, 16), 8), fsdp_partition_spec((6,), 4)
      (P(None, 'data'), P())
    """
    candidates = [(size, -axis) for axis, size in enumerate(shape) if size >= num_shards and size % num_shards == 0]
    if num_shards <= 1 or not candidates:
        return PartitionSpec()
    _, neg_axis = max(candidates)
    # No trailing Nones: XLA hands outputs back in that canonical form, and a spec that differs
    # only in them would make the next step's inputs look resharded (and recompile).
    return PartitionSpec(*([None] * -neg_axis), data_axis)


def state_shardings(state: Tree, mesh: Mesh, *, fsdp: bool = False, data_axis: str = "data") -> Tree:
    """The :class:`NamedSharding` of every leaf of a train state (concrete or abstract).

    Replicated everywhere for data parallelism. With ``fsdp``, the leaves of
    ``state.params`` and ``state.opt_state`` (every leaf, for a state that is not a
    :class:`leanstep.TrainState`) follow :func:`fsdp_partition_spec`; the step counter, loss
    scale and PRNG key stay replicated.

    Args:
      state: a :class:`leanstep.TrainState`, any pytree of arrays, or of ``jax.ShapeDtypeStruct``.
      mesh: the device mesh.
      fsdp: shard parameters and optimizer state instead of replicating them.
      data_axis: the mesh axis the batch (and, with ``fsdp``, the state) is split along.

    Returns:
      A pytree of the structure of ``state`` with a ``NamedSharding`` per leaf.

    Raises:
      TypeError: ``mesh`` is not a Mesh.
      ValueError: ``data_axis`` is not one of its axes.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from leanstep.step import TrainState
      >>> state = TrainState.create({"w": jnp.zeros((4, 8))}, optax.adam(1e-3))
      >>> mesh = data_mesh(jax.devices()[:1])
      >>> state_shardings(state, mesh, fsdp=True).params["w"].spec
      P()
    """
    num_shards = _check_mesh(mesh, data_axis)
    replicated = NamedSharding(mesh, PartitionSpec())

    def split(leaf: Any) -> NamedSharding:
        return NamedSharding(mesh, fsdp_partition_spec(np.shape(leaf), num_shards, data_axis))

    def sharded(tree: Any) -> Any:
        return jax.tree.map(split if fsdp else (lambda _: replicated), tree)

    from leanstep.step import TrainState  # step imports this module

    if not isinstance(state, TrainState):
        return sharded(state)
    everything = jax.tree.map(lambda _: replicated, state)
    return type(state)(**{
        **{name: getattr(everything, name) for name in ("step", "loss_scale", "rng", "consecutive_skips")},
        "params": sharded(state.params),
        "opt_state": sharded(state.opt_state),
    })


def shard_train_state(state: Tree, mesh: Mesh, *, fsdp: bool = False, data_axis: str = "data") -> Tree:
    """Places ``state`` on ``mesh`` with :func:`state_shardings` (every process passes the same state).

    Args and Raises: as :func:`state_shardings`.

    Returns:
      The state as global ``jax.Array`` s; in a multi-process run each process holds its shards.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from leanstep.step import TrainState
      >>> state = TrainState.create({"w": jnp.zeros((4, 8))}, optax.sgd(0.1))
      >>> shard_train_state(state, data_mesh()).params["w"].sharding.is_fully_replicated
      True
    """
    shardings = state_shardings(state, mesh, fsdp=fsdp, data_axis=data_axis)
    return jax.tree.map(_place, state, shardings)


def _place(value: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)  # already global: let JAX reshard it
    host = np.asarray(value)
    # Every process builds only its own shards from the same host value; device_put of a
    # host array onto devices of other processes is not allowed in a multi-process run.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_batch(batch: Tree, mesh: Mesh, data_axis: str = "data") -> Tree:
    """Places a whole batch (the same on every process) on ``mesh``, rows split along ``data_axis``.

    Each process copies only the rows its own devices hold, so a multi-process run feeds the
    global batch without any cross-process transfer.

    Args:
      batch: a pytree of host arrays sharing a leading batch axis.
      mesh: the device mesh.
      data_axis: the mesh axis the rows are split along.

    Returns:
      ``batch`` as global ``jax.Array`` s with :func:`batch_sharding`.

    Raises:
      ValueError: the batch size is not divisible by the data axis's size (or a leaf is a scalar).

    Example:
      >>> import numpy as np
      >>> batch = shard_batch({"x": np.zeros((8, 3), np.float32)}, data_mesh(jax.devices()[:1]))
      >>> batch["x"].shape, batch["x"].sharding.spec
      ((8, 3), P('data',))
    """
    num_shards = _check_mesh(mesh, data_axis)
    sharding = NamedSharding(mesh, PartitionSpec(data_axis))

    def place(path: Any, leaf: Any) -> jax.Array:
        shape = np.shape(leaf)
        if not shape or shape[0] % num_shards:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has shape {shape}; its leading (batch) size must be "
                f"divisible by the {num_shards} devices of mesh axis {data_axis!r}"
            )
        return _place(leaf, sharding)

    return jax.tree_util.tree_map_with_path(place, batch)


def split_strided_microbatches(batch: Tree, num_microbatches: int) -> Tree:
    r"""Reshapes every leaf from ``(B, ...)`` to ``(M, B/M, ...)`` with microbatch ``j`` = rows ``j, j+M, ...``.

    .. math::

        \text{out}[j, r] = \text{batch}[r M + j], \qquad 0 \le j < M,\; 0 \le r < B/M

    A reshape to ``(B/M, M, ...)`` then a swap of the first two axes. If the rows are split
    contiguously over ``D`` devices and ``D M`` divides ``B``, device ``d``'s rows
    ``[d B/D, (d+1) B/D)`` are exactly rows ``r`` in ``[d B/(DM), (d+1) B/(DM))`` of axis 1 for
    every ``j``: splitting axis 1 the same way keeps every row on its device. (The contiguous
    split, ``batch[j B/M + r]``, puts whole microbatches on a few devices, and XLA must move
    rows between devices to spread each one.) Microbatch composition does not depend on ``D``.

    Args:
      batch: a pytree of arrays sharing a leading batch axis.
      num_microbatches: a Python int >= 1 that divides the batch size.

    Returns:
      ``batch`` with every leaf of shape ``(num_microbatches, B / num_microbatches) + leaf.shape[1:]``.

    Raises:
      The errors of :func:`leanstep.split_microbatches`.

    Example:
      >>> import jax.numpy as jnp
      >>> split_strided_microbatches({"x": jnp.arange(6)}, 3)["x"]
      Array([[0, 3],
             [1, 4],
             [2, 5]], dtype=int32)
    """
    num_microbatches = _check_num_microbatches(num_microbatches)
    # Validates the tree (shared leading axis, divisibility) with the contiguous split's messages.
    shapes = jax.eval_shape(functools.partial(split_microbatches, num_microbatches=num_microbatches), batch)
    rows = jax.tree.leaves(shapes)[0].shape[1]
    return jax.tree.map(lambda leaf: jnp.swapaxes(leaf, 0, 1), split_microbatches(batch, rows))
