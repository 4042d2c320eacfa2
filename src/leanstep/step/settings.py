"""A :class:`leanstep.StepSpec` placed on its mesh: the values :func:`leanstep.make_train_step` composes.

.. code-block:: text

    StepSpec        every setting, checked once                 (leanstep.step.spec)
    ShardingLayer   the spec's layout on the mesh given         (leanstep.step.sharding_layer)

:func:`step_settings` adds what only the mesh can tell: a model state whose reduction would let it
differ between devices (``reduce="auto"`` over replica axes), written once with the spec's own mesh
refusals (:func:`leanstep.step.spec.refuse_on_mesh`). Every other refusal is the spec's.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from leanstep.blocks.accumulation import Accumulation
from leanstep.step.sharding_layer import ShardingLayer
from leanstep.step.spec import MeshLayout, StepSpec, refuse_on_mesh
from leanstep.step.spec_parts import axes_text

__all__ = ["StepSettings", "step_settings"]


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What :func:`leanstep.make_train_step` composes, checked together.

    Attributes:
      spec: the step's settings.
      layer: the sharding layer, or None on one device.
    """

    spec: StepSpec
    layer: ShardingLayer | None

    @property
    def stage_accumulation(self) -> Accumulation:
        """The accumulation the gradient stage runs: on a mesh, its microbatches constrained by the layer."""
        accumulation = self.spec.accumulation
        if self.layer is None:
            return accumulation
        # Token-weighted over manual axes, each device hands on its sums (a device without tokens: 0, not 0/0).
        sums = self.spec.loss.token_weighted and bool(self.layer.manual_axes)
        return accumulation.replace(split=self.layer.split(accumulation.splitter), divide=not sums)


def step_settings(spec: StepSpec, mesh: Mesh | ShardingLayer | None) -> StepSettings:
    """``spec`` on ``mesh`` (None: one device), with the refusals only the mesh can tell.

    Args:
      spec: the step's settings.
      mesh: a ``Mesh`` (laid out by ``spec.sharding``, or the defaults: once per microbatch with a
        model state), a :class:`ShardingLayer` (taken as it is), or None.

    Raises:
      TypeError: ``mesh`` neither a Mesh nor a layer.
      ValueError: a mesh whose axes, or a layer whose layout, differ from ``spec.sharding``; a model
        state with a reduction that would let it differ between devices.
    """
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec must be a leanstep.StepSpec, got {type(spec).__name__}")
    if mesh is None:
        return StepSettings(spec, None)
    has_state = spec.loss.has_state
    layout = spec.sharding
    if layout is None:
        layer = mesh if isinstance(mesh, ShardingLayer) else _layer(MeshLayout.of(mesh, has_state=has_state), mesh)
    else:
        layer = _layer(layout, mesh)
    refuse_on_mesh(spec, layer.reduce, layer.data_axis, replica=bool(layer.axes.replica))
    return StepSettings(spec, layer)


def _layer(layout: MeshLayout, mesh: Mesh | ShardingLayer) -> ShardingLayer:
    """The sharding layer of ``layout`` on ``mesh`` (a layer given is taken as it is, if its layout is this one).

    Raises:
      ValueError: the mesh's axes, or the layer's layout, differ from ``layout``.
    """
    given = mesh if isinstance(mesh, ShardingLayer) else None
    if isinstance(mesh, ShardingLayer):
        layer = mesh
    else:
        layer = ShardingLayer(mesh, data_axis=layout.data_axis, fsdp=layout.fsdp, reduce=layout.reduce)
    found = MeshLayout.of(layer)
    if layout.axes is not None and found.axes != layout.axes:
        raise ValueError(f"sharding.axes is {axes_text(layout.axes)} but the mesh given has {axes_text(found.axes)}")
    if given is not None and dataclasses.replace(found, axes=layout.axes) != layout:
        raise ValueError(
            f"the ShardingLayer given lays the step out as {found}, the spec as {layout}: give the layout once "
            "(a plain Mesh with the spec's sharding, or the layer with the spec's sharding=None)"
        )
    return layer
