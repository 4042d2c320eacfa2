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
* Microbatches under sharding are *strided* (:func:`leanstep.split_strided_microbatches`):
  microbatch ``j`` takes rows ``j, j+M, j+2M, ...``, so each device's share of every
  microbatch is made of its own rows and no row ever moves between devices.

:class:`ShardingLayer` is the one place :func:`leanstep.make_train_step` learns about the mesh:
it wraps the composed step and constrains values at three boundaries only, the step's inputs
(state, batch), the model's inputs (compute-dtype params, microbatches) and the step's outputs
(state, metrics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep._checks import check_bool
from leanstep.microbatches import Splitter, get_splitter
from leanstep.state import StepMetrics, TrainState

__all__ = [
    "ShardingLayer",
    "batch_sharding",
    "check_mesh",
    "data_mesh",
    "fsdp_partition_spec",
    "shard_batch",
    "shard_train_state",
    "state_shardings",
]

Tree = TypeVar("Tree")


def check_mesh(mesh: Any, data_axis: Any) -> int:
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
    check_mesh(mesh, data_axis)
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
      >>> state = TrainState.create({"w": jnp.zeros((4, 8))}, optax.adam(1e-3))
      >>> mesh = data_mesh(jax.devices()[:1])
      >>> state_shardings(state, mesh, fsdp=True).params["w"].spec
      P()
    """
    num_shards = check_mesh(mesh, data_axis)
    replicated = NamedSharding(mesh, PartitionSpec())

    def split(leaf: Any) -> NamedSharding:
        return NamedSharding(mesh, fsdp_partition_spec(np.shape(leaf), num_shards, data_axis))

    def sharded(tree: Any) -> Any:
        return jax.tree.map(split if fsdp else (lambda _: replicated), tree)

    if not isinstance(state, TrainState):
        return sharded(state)
    everything = jax.tree.map(lambda _: replicated, state)
    return everything.replace(params=sharded(state.params), opt_state=sharded(state.opt_state))


def shard_train_state(state: Tree, mesh: Mesh, *, fsdp: bool = False, data_axis: str = "data") -> Tree:
    """Places ``state`` on ``mesh`` with :func:`state_shardings` (every process passes the same state).

    Args and Raises: as :func:`state_shardings`.

    Returns:
      The state as global ``jax.Array`` s; in a multi-process run each process holds its shards.

    Example:
      >>> import jax.numpy as jnp, optax
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
    num_shards = check_mesh(mesh, data_axis)
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


@dataclasses.dataclass(frozen=True)
class ShardingLayer:
    """The sharding layer around a composed train step: constraints at its boundaries only.

    .. code-block:: text

        step inputs    state -> state_shardings(state)     batch -> rows on data_axis
        model inputs   compute params -> replicated         microbatches -> (None, data_axis)
        step outputs   state -> state_shardings(state)     metrics -> replicated (aux as XLA likes)

    XLA's SPMD partitioner inserts every collective from these; nothing else in the step
    knows about the mesh.

    Attributes:
      mesh: the device mesh.
      data_axis: the mesh axis the batch rows (and, with ``fsdp``, the state) are split along.
      fsdp: shard parameters and optimizer state along ``data_axis`` instead of replicating them.

    Raises:
      TypeError: ``mesh`` is not a Mesh or ``fsdp`` not a bool.
      ValueError: ``data_axis`` is not one of the mesh's axes.

    Example:
      >>> layer = ShardingLayer(data_mesh(jax.devices()[:1]))
      >>> layer.num_shards, layer.split("strided") is not None
      (1, True)
    """

    mesh: Mesh
    data_axis: str = "data"
    fsdp: bool = False

    def __post_init__(self) -> None:
        check_mesh(self.mesh, self.data_axis)
        object.__setattr__(self, "fsdp", check_bool("fsdp", self.fsdp))

    @property
    def num_shards(self) -> int:
        """The size of the data axis."""
        return int(self.mesh.shape[self.data_axis])

    def _constrain(self, tree: Any, spec: PartitionSpec) -> Any:
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, spec))

    def split(self, split: str | Splitter) -> Splitter:
        """``split`` followed by the microbatch constraint: axis 1 (the rows) on the data axis."""
        splitter = get_splitter(split)
        return lambda batch, num_microbatches: self._constrain(splitter(batch, num_microbatches),
                                                              PartitionSpec(None, self.data_axis))

    def model_params(self, params: Any) -> Any:
        """Whole parameters for the forward and backward pass (FSDP gathers them here, once per step).

        Left to itself XLA may split the matmuls by weight columns instead and move activations,
        i.e. batch rows, between devices.
        """
        return self._constrain(params, PartitionSpec())

    def around(
        self, step: Callable[[TrainState, Any], tuple[TrainState, StepMetrics]], num_microbatches: int
    ) -> Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]:
        """``step`` with its inputs and outputs constrained; the batch must divide by ``M * D``.

        Raises (at trace time):
          ValueError: the batch size is not divisible by ``num_microbatches`` times the
            data-axis size.
        """
        def sharded(state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
            batch_size = jax.tree.leaves(batch)[0].shape[0]
            if batch_size % (num_microbatches * self.num_shards):
                raise ValueError(
                    f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches} times "
                    f"the {self.num_shards} devices of mesh axis {self.data_axis!r}"
                )
            shardings = state_shardings(state, self.mesh, fsdp=self.fsdp, data_axis=self.data_axis)
            state = jax.lax.with_sharding_constraint(state, shardings)
            new_state, metrics = step(state, self._constrain(batch, PartitionSpec(self.data_axis)))
            replicated = {name: self._constrain(getattr(metrics, name), PartitionSpec())
                          for name in StepMetrics._fields if name != "aux"}
            return jax.lax.with_sharding_constraint(new_state, shardings), metrics._replace(**replicated)

        return sharded
