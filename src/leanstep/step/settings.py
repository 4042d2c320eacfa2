"""A step's settings as three values, made and checked in one place.

.. code-block:: text

    LossContract    what the loss takes and returns           (leanstep.blocks.loss_contract)
    Accumulation    microbatches, split, unroll               (leanstep.blocks.accumulation)
    ShardingLayer   the mesh, its rules, where to reduce      (leanstep.step.sharding_layer)
    update_chunk    the update's largest chunk                (leanstep.step.update_chunks)

:func:`step_settings` turns the keywords of :func:`leanstep.make_train_step` into these values
and refuses every combination that cannot work, here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.loss_contract import LossContract, loss_contract_of
from leanstep.step.sharding_layer import ShardingLayer
from leanstep.step.update_chunk_plan import check_update_chunk

__all__ = ["StepSettings", "step_settings"]


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What :func:`leanstep.make_train_step` composes, checked together.

    Attributes:
      loss: what the loss takes and returns.
      accumulation: how the batch is walked; with a mesh, the split is strided unless given
        (the layer adds its constraint: :meth:`ShardingLayer.split`).
      layer: the sharding layer, or None on one device.
      update_chunk: the most entries one chunk of the optimizer's update widens at a time
        (:func:`leanstep.guarded_update`): ``"auto"``, a positive int, or None (the whole tree).
    """

    loss: LossContract
    accumulation: Accumulation
    layer: ShardingLayer | None
    update_chunk: int | str | None = "auto"

    @property
    def stage_accumulation(self) -> Accumulation:
        """The accumulation the gradient stage runs: on a mesh, its microbatches constrained by the layer."""
        if self.layer is None:
            return self.accumulation
        # Token-weighted over manual axes, each device hands on its sums (a device without tokens: 0, not 0/0).
        sums = self.loss.token_weighted and bool(self.layer.manual_axes)
        return self.accumulation.replace(split=self.layer.split(self.accumulation.splitter), divide=not sums)


def step_settings(
    loss: LossContract | None,
    accumulation: Accumulation | None,
    mesh: Mesh | ShardingLayer | None,
    *,
    short: dict[str, Any],
    update_chunk: Any = "auto",
) -> StepSettings:
    """The step's three values, every combination that cannot work refused (the one place).

    Args:
      loss: the loss contract, or None: made from ``short``.
      accumulation: the accumulation, or None: made from ``short``.
      mesh: a ``Mesh``, a :class:`ShardingLayer`, or None.
      short: the short-form keywords of :func:`leanstep.make_train_step` (``has_aux`` ...
        ``unroll``), as given; ``split`` None means not chosen (contiguous; strided on a mesh).
      update_chunk: ``"auto"``, a positive int or None (:func:`leanstep.guarded_update`).

    Raises:
      TypeError: a value of the wrong type.
      ValueError: a bad ``update_chunk``; a value beside its short-form keywords; a model state
        with a reduction that would let it differ between devices; a presplit batch on a mesh.
    """
    update_chunk = check_update_chunk(update_chunk)
    flags = {k: short[k] for k in ("has_aux", "token_weighted", "uses_rng", "has_state") if short[k]}
    loss = loss_contract_of(loss, flags)
    split = short["split"]
    split_given = split is not None or accumulation is not None
    if accumulation is None:
        accumulation = Accumulation(
            short["num_microbatches"], "contiguous" if split is None else split, short["unroll"]
        )
    elif not isinstance(accumulation, Accumulation):
        raise TypeError(f"accumulation must be a leanstep.Accumulation, got {type(accumulation).__name__}")
    elif (short["num_microbatches"], split, short["unroll"]) != (1, None, 1):
        raise ValueError("give num_microbatches, split and unroll inside accumulation=Accumulation(...), not beside it")
    if not accumulation.divide:
        raise ValueError(
            "Accumulation(divide=False) hands on sums for a caller that reduces them itself; make_train_step "
            "divides (and, token-weighted on a mesh, sums across devices first): leave divide=True"
        )
    layer = _layer(mesh, has_state=loss.has_state)
    if layer is None:
        return StepSettings(loss, accumulation, None, update_chunk)
    if loss.has_state and (layer.reduce == "step" or (layer.reduce == "auto" and layer.axes.replica)):
        raise ValueError(
            f"has_state=True with reduce={layer.reduce!r}: a model state (batch statistics) computed per "
            "device would differ between devices that reduce their gradient once per step; use "
            "reduce='microbatch' (the default with has_state)"
        )
    if accumulation.split == "presplit":
        raise ValueError(
            "split='presplit' is not supported with a mesh: pass the whole batch, rows split over "
            f"{layer.data_axis!r}, and the sharding layer splits it into strided microbatches"
        )
    return StepSettings(
        loss, accumulation if split_given else accumulation.replace(split="strided"), layer, update_chunk
    )


def _layer(mesh: Mesh | ShardingLayer | None, *, has_state: bool) -> ShardingLayer | None:
    if mesh is None or isinstance(mesh, ShardingLayer):
        return mesh
    # Batch statistics must see whole microbatches, as on one device.
    return ShardingLayer(mesh, reduce="microbatch" if has_state else "auto")
