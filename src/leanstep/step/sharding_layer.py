r"""The sharding layer around a composed train step: where each value lives, and where gradients reduce.

The mesh's axes have roles (:func:`leanstep.sharding.mesh_axes`): **replica** (data-parallel) axes
and an **fsdp** axis split the batch rows; the fsdp axis and a **tensor** axis split the
parameters by partition rules (:mod:`leanstep.sharding.partition_rules`). Where the gradient is
reduced is the named option ``reduce``:

.. code-block:: text

    reduce        replica axes                      fsdp axis
    "auto"        once per step, after the scan     per layer and microbatch (ZeRO-3)
    "step"        once per step                     once per step (the whole model gathered once)
    "microbatch"  by XLA, every microbatch          per layer and microbatch (ZeRO-3)

A "once per step" axis is *manual*: the gradient stage runs under ``jax.shard_map`` over
it, each device accumulates the gradient of its own rows in float32 over every microbatch
and layer, and one ``psum`` (``psum_scatter`` over the fsdp axis) follows the scan. The loss
function then sees each device's rows: a mean over rows (or ``(loss_sum, count)``,
``token_weighted``) is the same loss, a loss that mixes rows (contrastive, batch
statistics) is per device; ``"microbatch"`` keeps the whole-microbatch semantics, and a
model state (``has_state``) always runs that way under ``"auto"``. Every other axis is left
to XLA's SPMD partitioner, which inserts collectives from the constraints set here at the
step's inputs and outputs, the microbatches and the compute-dtype parameters, and from the
model's own :func:`leanstep.sharding.gathered` and :func:`leanstep.sharding.constrain` calls.

Microbatches under sharding are *strided* (:func:`leanstep.blocks.split_strided_microbatches`):
microbatch ``j`` takes rows ``j, j+M, j+2M, ...``, so each device's share of every
microbatch is made of its own rows and no row moves between devices.

Size: one class, where each value of the step lives and where its gradients reduce, with the
reasons beside each choice; the state's shardings are state_sharding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.blocks.fp8_state import fp8_mask, has_fp8
from leanstep.blocks.microbatches import Splitter, get_splitter
from leanstep.common.checks import check_bool
from leanstep.sharding.meshes import mesh_axes
from leanstep.sharding.model_sharding import constrain_spec, sharding_context
from leanstep.sharding.partition_rules import (
    MeshAxes,
    check_rules,
    make_spec,
    param_path,
)
from leanstep.step.gradients import Gradients
from leanstep.step.spec_parts import REDUCTIONS  # the values of ``reduce`` (see the module doc)
from leanstep.step.state import StepMetrics, TrainState
from leanstep.step.state_sharding import params_specs, state_shardings

__all__ = ["REDUCTIONS", "ShardingLayer"]


def _map_specs(fn: Callable[..., Any], params: Any, specs: Any) -> Any:
    """``fn(path, leaf, spec)`` over the parameter leaves and their specs."""
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree.unflatten(treedef, [fn(path, leaf, spec) for (path, leaf), spec in zip(paths_leaves, spec_leaves)])


def manual_constraint_error(error: Exception) -> ValueError | None:
    """For JAX's error on a model's own ``with_sharding_constraint`` over an axis the step
    reduces once per step (a manual ``shard_map`` axis; JAX raises it when the step is
    lowered), an error that names both fixes; None for any other error."""
    text = str(error)
    if not isinstance(error, ValueError) or "contains a manual axes" not in text:
        return None
    return ValueError(
        "the loss calls jax.lax.with_sharding_constraint with a spec naming a mesh axis the step "
        "reduces once per step (reduce='auto' or 'step' runs the gradient stage under jax.shard_map "
        "over the data axes, and each device sees only its own rows there). Either use "
        "leanstep.sharding.constrain(x, 'batch', None, ...) (one role per dimension) in the model, which lays x out "
        "over the mesh's batch axes under every reduction and is the identity outside a step, or pass "
        "mesh=leanstep.step.ShardingLayer(mesh, reduce='microbatch') to leave the reduction to XLA (once per "
        f"microbatch; with num_microbatches=1, once per step). JAX said: {text.splitlines()[0]}"
    )


def _dim_of(spec: PartitionSpec, axis: str) -> int | None:
    for dim, entry in enumerate(spec):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return dim
    return None


@dataclasses.dataclass(frozen=True)
class ShardingLayer:
    """Constraints at the step's boundaries, and the gradient reduction, for one mesh.

    .. code-block:: text

        step inputs    state -> state_shardings(state)         batch -> rows over the batch axes
        model inputs   compute params -> rules (ZeRO-3: split)  microbatches -> (None, batch axes)
        gradients      manual axes: local accumulation, one psum / psum_scatter after the scan
        step outputs   state -> state_shardings(state)         metrics -> replicated

    Attributes:
      mesh: the device mesh.
      data_axis: the data axis of a one-axis mesh (with ``fsdp``, the axis the state is split over).
      fsdp: on a mesh without an axis named ``fsdp_axis``, split the state over ``data_axis``.
      rules: partition rules (:mod:`leanstep.sharding.partition_rules`); None: the largest divisible
        dimension over the FSDP axis.
      reduce: ``"auto"``, ``"step"`` or ``"microbatch"`` (see the module doc).
      fsdp_axis, tensor_axis: the names of the FSDP and tensor axes, if the mesh has them.

    Raises:
      TypeError: ``mesh`` is not a Mesh or ``fsdp`` not a bool.
      ValueError: ``data_axis`` is not one of the mesh's axes (on a mesh without an FSDP
        axis), malformed ``rules``, or an unknown ``reduce``.

    Example:
      >>> from leanstep.sharding.meshes import data_mesh
      >>> layer = ShardingLayer(data_mesh(jax.devices()[:1]))
      >>> layer.num_shards, layer.manual_axes  # one device: nothing to reduce
      (1, ())
    """

    mesh: Mesh
    data_axis: str = "data"
    fsdp: bool = False
    rules: Any = None
    reduce: str = "auto"
    fsdp_axis: str = "fsdp"
    tensor_axis: str = "tensor"
    #: The roles of the mesh's axes (:func:`leanstep.sharding.mesh_axes`), derived from the fields above.
    axes: MeshAxes = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fsdp", check_bool("fsdp", self.fsdp))
        object.__setattr__(self, "rules", check_rules(self.rules))
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {self.reduce!r}")
        object.__setattr__(
            self,
            "axes",
            mesh_axes(
                self.mesh, self.data_axis, fsdp=self.fsdp, fsdp_axis=self.fsdp_axis, tensor_axis=self.tensor_axis
            ),
        )

    @property
    def num_shards(self) -> int:
        """The number of devices along the batch axes (the batch must divide by it times ``M``)."""
        return self.axes.size(self.axes.batch)

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes whose gradient is reduced once per step (the ``shard_map`` axes), in mesh order.

        Axes of size 1 are left out: there is nothing to reduce over them (and XLA refuses a
        reduction over a manual axis of one device next to automatic ones)."""
        axes = self.axes
        manual = {"auto": axes.replica, "step": axes.batch, "microbatch": ()}[self.reduce]
        return tuple(a for a in self.mesh.axis_names if a in manual and self.mesh.shape[a] > 1)

    def state_shardings(self, state: Any) -> Any:
        """:func:`leanstep.step.state_shardings` for this mesh and these rules."""
        return state_shardings(
            state,
            self.mesh,
            fsdp=self.fsdp,
            data_axis=self.data_axis,
            rules=self.rules,
            fsdp_axis=self.fsdp_axis,
            tensor_axis=self.tensor_axis,
        )

    def param_specs(self, params: Any) -> Any:
        """The :class:`PartitionSpec` of every parameter (:func:`leanstep.sharding.param_specs`); ``P()``
        for FP8 state."""
        return params_specs(params, self.axes, self.rules)

    def _constrain(self, tree: Any, spec: PartitionSpec) -> Any:
        return constrain_spec(tree, self.mesh, spec, self.manual_axes)

    def split(self, split: str | Splitter) -> Splitter:
        """``split`` followed by the microbatch constraint: axis 1 (the rows) over the batch axes."""
        splitter = get_splitter(split)
        spec = self.axes.rows(1)
        return lambda tree, num_microbatches: self._constrain(splitter(tree, num_microbatches), spec)

    def model_params(self, params: Any, probe: Callable[[Any], Any] | None = None, *, specs: Any = None) -> Any:
        """The compute-dtype parameters as the model receives them.

        Over a manual FSDP axis (``reduce="step"``) they are all-gathered here, once per
        step. Otherwise they keep their partition specs, and leaves the model does not
        gather itself (:func:`leanstep.sharding.gathered`, found by tracing ``probe``, the loss on
        abstract values) are gathered whole over the FSDP axis here, once per step.

        ``specs``: the parameters' :meth:`param_specs`, told from their global shapes (inside the
        ``shard_map`` they have local shapes, from which the specs cannot be told); None: from ``params``.
        """
        axes, manual = self.axes, self.manual_axes
        specs = self.param_specs(params) if specs is None else specs
        fsdp = axes.axis_of("fsdp")
        if fsdp is not None and fsdp in manual:

            def gather(leaf: Any, spec: PartitionSpec) -> Any:
                dim = _dim_of(spec, fsdp)
                return leaf if dim is None else jax.lax.all_gather(leaf, fsdp, axis=dim, tiled=True)

            return _map_specs(lambda _, leaf, spec: gather(leaf, spec), params, specs)
        gathered_by_model: set[str] = set()
        if fsdp is not None and probe is not None:
            with sharding_context(axes, specs, params, manual=manual) as record:
                probe(params)
            gathered_by_model = set(record)

        def layout(path: Any, leaf: Any, spec: PartitionSpec) -> Any:
            keep_split = param_path(path) in gathered_by_model
            return self._constrain(leaf, spec if keep_split else make_spec(spec, drop={fsdp}))

        return _map_specs(layout, params, specs)

    def gradients(self, stage: Callable[..., Gradients], *, token_weighted: bool) -> Callable[..., Gradients]:
        """``stage`` (a :func:`leanstep.step.gradient_stage`) with the model's sharding context and,
        over the manual axes, local accumulation and one reduction after it. The stage is told
        where it runs through its arguments: ``params_layout`` (:meth:`model_params` with the
        parameters' specs, told from their global shapes) and ``data_shards`` (the devices that
        reduce once per step).

        Token-weighted over manual axes, ``stage`` must hand on its sums (its accumulation
        built with ``divide=False``, as :func:`leanstep.make_train_step` builds it): the layer
        adds them up and divides by the global token count, so a device whose rows hold no
        token adds 0 instead of 0/0."""
        manual = self.manual_axes
        axes = self.axes

        def traced(
            params: Any, batch: Any, loss_scale: Any, key: Any, model_state: Any, specs: Any, shards: int
        ) -> Gradients:
            # the parameters' specs and the devices that share the batch, handed to the stage as its arguments
            layout = functools.partial(self.model_params, specs=specs)
            with sharding_context(axes, specs, params, manual=manual):
                return stage(params, batch, loss_scale, key, model_state, params_layout=layout, data_shards=shards)

        if not manual:

            def placed(
                params: Any, batch: Any, loss_scale: Any = None, key: Any = None, model_state: Any = None
            ) -> Gradients:
                return traced(params, batch, loss_scale, key, model_state, self.param_specs(params), 1)

            return placed
        batch_manual = tuple(a for a in axes.batch if a in manual)
        devices = axes.size(manual)

        def reduced(
            params: Any, batch: Any, loss_scale: Any = None, key: Any = None, model_state: Any = None
        ) -> Gradients:
            if model_state is not None:  # make_train_step refuses this combination; a direct caller learns here
                raise ValueError(
                    "a model state (has_state=True) would differ between devices that reduce their "
                    "gradient once per step: use reduce='microbatch'"
                )
            specs = self.param_specs(params)  # from the global shapes, outside the shard_map
            in_params = jax.tree.map(
                lambda s: make_spec(s, keep=set(manual)), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
            )

            def local(params: Any, batch: Any, loss_scale: Any, key: Any) -> Gradients:
                if key is not None and devices > 1:  # each device draws its own randomness for its rows
                    key = jax.random.fold_in(key, jax.lax.axis_index(manual))
                # a mean loss with FP8 state is seeded with this device's share (data_shards)
                out = traced(params, batch, loss_scale, key, None, specs, devices)
                return self._reduced(out, specs, token_weighted=token_weighted)

            rows = make_spec([batch_manual])
            return jax.shard_map(
                local,
                mesh=self.mesh,
                axis_names=set(manual),
                check_vma=False,
                in_specs=(in_params, jax.tree.map(lambda _: rows, batch), PartitionSpec(), PartitionSpec()),
                out_specs=Gradients(
                    loss=PartitionSpec(),  # type: ignore[arg-type]  # the outputs' specs, in their structure
                    grads=in_params,
                    aux=PartitionSpec(),
                    model_state=None,
                    token_count=PartitionSpec(),  # type: ignore[arg-type]
                ),
            )(params, batch, loss_scale, key)

        return reduced

    def _reduced(self, out: Gradients, specs: Any, *, token_weighted: bool) -> Gradients:
        """One device's gradient stage output, reduced over the manual axes (inside ``shard_map``):
        ``psum`` (``psum_scatter`` over a manual FSDP axis), token-weighted by the devices' counts.
        FP8 state takes the ``pmax`` of its new values; with it, a mean loss's gradient comes
        already divided (the stage seeded each device's share, :func:`leanstep.step.gradient_stage`)."""
        manual, axes = self.manual_axes, self.axes
        seeded = has_fp8(out.grads) and not token_weighted
        # Token-weighted, the stage hands on sums (make_train_step builds it so: Accumulation.divide
        # False), and the global count divides them: a device whose rows hold no token adds 0.
        weight = out.token_count if token_weighted and out.token_count is not None else jnp.float32(1.0)
        total = jax.lax.psum(weight, manual)
        fsdp = axes.fsdp if axes.fsdp in manual else None

        def reduce_leaf(grad: Any, spec: PartitionSpec, fp8: bool) -> Any:
            if fp8:
                return jax.lax.pmax(grad, manual)
            dim = None if fsdp is None else _dim_of(spec, fsdp)
            rest = tuple(a for a in manual if a != fsdp or dim is None)
            if dim is not None:
                grad = jax.lax.psum_scatter(grad, fsdp, scatter_dimension=dim, tiled=True)
            grad = jax.lax.psum(grad, rest) if rest else grad
            return grad if seeded else grad / total

        mask = jax.tree.leaves(fp8_mask(out.grads))
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        leaves, treedef = jax.tree.flatten(out.grads)
        reduced = [reduce_leaf(g, s, m) for g, s, m in zip(leaves, spec_leaves, mask, strict=True)]
        grads = jax.tree.unflatten(treedef, reduced)
        loss = jax.lax.psum(out.loss if token_weighted else out.loss * weight, manual) / total
        mean = lambda tree: jax.tree.map(
            lambda a: jax.lax.pmean(a, manual) if jnp.issubdtype(a.dtype, jnp.floating) else jax.lax.psum(a, manual),
            tree,
        )
        if token_weighted and out.aux is not None:  # per-microbatch sums and counts: summed exactly
            sums, counts, user = out.aux
            aux = (jax.lax.psum(sums, manual), jax.lax.psum(counts, manual), mean(user))
        else:
            aux = mean(out.aux)
        return Gradients(loss=loss, grads=grads, aux=aux, model_state=None, token_count=total)

    def around(
        self, step: Callable[[TrainState, Any], tuple[TrainState, StepMetrics]], num_microbatches: int
    ) -> Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]:
        """``step`` with its inputs and outputs constrained; the batch must divide by ``M * D``.

        Raises (at trace time):
          ValueError: the batch size is not divisible by ``num_microbatches`` times the
            number of devices along the batch axes.
        """
        batch_axes = self.axes.batch
        batch_spec = self.axes.rows()

        def sharded(state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
            batch_size = jax.tree.leaves(batch)[0].shape[0]
            if batch_size % (num_microbatches * self.num_shards):
                where = f"mesh axis {batch_axes[0]!r}" if len(batch_axes) == 1 else f"mesh axes {batch_axes}"
                raise ValueError(
                    f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches} times "
                    f"the {self.num_shards} devices of {where}"
                )
            shardings = self.state_shardings(state)
            state = jax.lax.with_sharding_constraint(state, shardings)
            batch = jax.lax.with_sharding_constraint(batch, NamedSharding(self.mesh, batch_spec))
            new_state, metrics = step(state, batch)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            fixed = {
                name: jax.lax.with_sharding_constraint(getattr(metrics, name), replicated)
                for name in StepMetrics._fields
                if name != "aux"
            }
            return jax.lax.with_sharding_constraint(new_state, shardings), metrics._replace(**fixed)

        return sharded
