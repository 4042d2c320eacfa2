"""What a train step is, as one value: :class:`StepSpec`, checked in one place and written to and
read from JSON, so that ``config.json``, ``leanstep plan``, ``verify`` and ``train`` read and
write the same value.

.. code-block:: text

    field          what                                              read by
    precision      params / compute / output dtypes                  make_train_step
    loss           what the loss takes and returns                   make_train_step
    accumulation   microbatches, split, unroll                       make_train_step
    max_grad_norm  clip the accumulated gradient (None: no clipping) make_train_step
    loss_scale     none, dynamic or static (a LossScaleSpec)         TrainState.create
    fp8            the model's FP8 recipe, or None                   the model's builder (build_run)
    int8           the model's int8 recipe, or None (not with fp8)   the model's builder (build_run)
    master         how the masters are kept                          TrainState.create
    moments        how the optimizer's moments are kept              TrainState.create
    update_chunk   the update's largest chunk                        make_train_step
    spike_guard    a SpikeGuard, or None                             TrainState.create
    cast_batch     the batch's floats cast to the compute dtype      make_train_step
    donate         the state's buffers donated to the step           make_train_step
    sharding       a MeshLayout (None: the mesh's defaults)          make_train_step, given a mesh
    update_in_backward  each layer updated inside the backward pass     make_train_step

Remat is not here: it is the model's (the loss takes the policy; :func:`leanstep.blocks.remat` wraps a
block), and so are the partition rules (``ShardingLayer(mesh, rules=model.rules)``). The FP8
recipe is here because it is part of what a run's step computes; the step itself reads the FP8
state from the parameters, so it is the model's builder that takes ``spec.fp8``; likewise
``spec.int8``, whose scales are the tensors' own (no state at all).

Size: the fields, their short forms, their JSON and their refusals are one value's, checked in one
place (:func:`_checked`); parts with forms of their own, and their JSON, are spec_parts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.int8 import Int8Recipe
from leanstep.blocks.loss_contract import LossContract, loss_contract_of
from leanstep.blocks.masters import check_master
from leanstep.blocks.moments import MOMENT_DTYPES
from leanstep.blocks.precision import Precision, check_train_precision
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.common.checks import check_bool, check_keywords, check_positive
from leanstep.step.spec_parts import JSON_PARTS, LossScaleSpec, MeshLayout, check_update_chunk, read_json_part

__all__ = ["SHORT_KEYWORDS", "LossScaleSpec", "MeshLayout", "StepSpec", "refuse_on_mesh"]

# The defaults (values: frozen, shared).
_FLOAT32 = Precision.from_string("float32")
_PLAIN_LOSS = LossContract()
_ONE_MICROBATCH = Accumulation()
_NO_LOSS_SCALE = LossScaleSpec()

#: The loss contract's flags among the short keywords (:meth:`StepSpec.from_keywords`).
_CONTRACT_FLAGS = ("has_aux", "token_weighted", "uses_rng", "has_state")


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Every setting of a train step, as one value (see the module doc for who reads which field).

    Each field also takes its short form, made into the value here: ``precision`` a string
    (``"compute=bfloat16"``), ``loss_scale`` ``"none"``/``"dynamic"``/a number/a loss scale,
    ``fp8`` and ``spike_guard`` their flag strings (``"delayed"``, ``"on"``; ``"none"``: None),
    ``sharding`` a :class:`MeshLayout`. :meth:`from_keywords` builds one from
    :func:`leanstep.make_train_step`'s keywords.

    Attributes:
      precision: a :class:`leanstep.Precision` whose params dtype is float32 (the masters are);
        with ``strict`` the loss runs under :func:`leanstep.blocks.strict_precision`.
      loss: what the loss takes and returns (:class:`leanstep.LossContract`); with ``uses_rng``
        microbatch ``j`` of step ``t`` gets ``fold_in(fold_in(state.rng, t), j)``.
      accumulation: how the batch is walked (:class:`leanstep.Accumulation`): the static number
        of equal microbatches, the split, and the scan's ``unroll`` (one microbatch never runs in a scan).
      max_grad_norm: clip the accumulated, unscaled gradient to this global norm; None: no clipping.
      loss_scale: the scale the state starts from (:class:`LossScaleSpec`).
      fp8: the recipe of the model's FP8 matmuls (:class:`leanstep.Fp8Recipe`), or None.
      master: ``"float32"`` masters, or bfloat16 ones with stochastic rounding, ``"bfloat16-sr"``
        or ``"bfloat16-sr-kahan"`` (round-to-nearest bfloat16 is refused: why, and what works).
      moments: the optimizer's moments as ``"float32"``, ``"bfloat16"`` or ``"int8"``.
      update_chunk: apply the optimizer in chunks of at most this many entries, one chunk's
        float32 widening live at once; ``"auto"``: ``2**22`` for a lean state where the optimizer
        allows it; None: the whole tree. Each entry is computed with the whole tree's operations
        (a transformation that mixes parameters is refused, one that draws noise or reads an
        entry's position keeps its leaves whole), but XLA compiles the two programs apart and may
        round an entry otherwise in its last bits: a division by a scalar taken as a product with
        its reciprocal in one, a product and a sum fused into one multiply-add in the other (on a
        mesh too). Bit for bit where neither happens (docs/lean-state.md says where that was tested).
      spike_guard: a :class:`leanstep.SpikeGuard` skipping a finite step whose loss (or norms) leaps
        past its window, or None; the state carries the guard and its window.
      cast_batch: cast the batch's floating leaves to the compute dtype (integer leaves such as
        token ids are left alone); without it a float32 input silently promotes a bfloat16 matmul.
      donate: donate the state's buffers to the jitted step.
      sharding: a :class:`MeshLayout`, how the step is laid out on the mesh it is given, or None
        (the layer's defaults).
      int8: the recipe of the model's int8 matmuls (:class:`leanstep.blocks.int8.Int8Recipe`, or
        its string ``"on"``), or None; not beside ``fp8``.
      update_in_backward: update each layer of a :class:`leanstep.LayerStack` loss as the backward
        pass reaches it, so that no whole-model gradient is ever live (:mod:`leanstep.step.layerwise`:
        two backward passes, exact clipping and skipping); not yet with a spike guard watching
        ``"update_norm"``, or a loss with aux, model state or a PRNG key.

    Raises:
      TypeError: a field of the wrong type, named, with the form expected.
      ValueError: a field outside its form, or two that cannot work together (a presplit batch on
        a mesh; a model state reduced once per step), named.

    Example:
      >>> spec = StepSpec("compute=bfloat16", accumulation=Accumulation(2), max_grad_norm=1.0, loss_scale="dynamic")
      >>> StepSpec.from_json(spec.to_json()) == spec
      True
      >>> spec == StepSpec.from_keywords(precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0,
      ...                                loss_scale="dynamic")
      True
      >>> StepSpec(moments="int4")
      Traceback (most recent call last):
      ...
      ValueError: moments must be one of ('float32', 'bfloat16', 'int8'), got 'int4'
    """

    precision: Precision = _FLOAT32
    loss: LossContract = _PLAIN_LOSS
    accumulation: Accumulation = _ONE_MICROBATCH
    max_grad_norm: float | None = None
    loss_scale: LossScaleSpec = _NO_LOSS_SCALE
    fp8: Fp8Recipe | None = None
    master: Any = "float32"
    moments: str = "float32"
    update_chunk: int | str | None = "auto"
    spike_guard: SpikeGuard | None = None
    cast_batch: bool = True
    donate: bool = True
    sharding: MeshLayout | None = None
    int8: Int8Recipe | None = None
    update_in_backward: bool = False

    def __post_init__(self) -> None:
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> StepSpec:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_keywords(cls, *, mesh: Any = None, **short: Any) -> StepSpec:
        """The spec of :func:`leanstep.make_train_step`'s short keywords (and
        :meth:`leanstep.TrainState.create`'s): each setting once, as a value or its short form.

        The keywords (:data:`SHORT_KEYWORDS`) are the fields (``precision`` ... ``update_in_backward``,
        each in any form the constructor takes) and the short forms of two of them:
        ``num_microbatches``, ``split`` and ``unroll`` make the accumulation (``split`` None:
        ``"contiguous"``, or ``"strided"`` on a mesh, so that no row moves between devices);
        ``has_aux``, ``token_weighted``, ``uses_rng`` and ``has_state`` the loss contract. The
        library itself builds a :class:`StepSpec`; this is the user's one-line form.

        Args:
          mesh: the ``Mesh`` or :class:`leanstep.step.ShardingLayer` the step will run on: the spec
            takes its layout (in place of ``sharding``).
          **short: the keywords above.

        Raises:
          ValueError: a value beside its short keywords; any refusal of :class:`StepSpec`.
          TypeError: an unknown keyword (the nearest named); ``loss`` or ``accumulation`` not their
            value types; ``sharding`` and ``mesh`` both given.
        """
        check_keywords("StepSpec.from_keywords", short, SHORT_KEYWORDS)
        flags = {name: short.pop(name) for name in _CONTRACT_FLAGS if name in short}
        contract = loss_contract_of(short.pop("loss", None), {name: on for name, on in flags.items() if on})
        sharding = short.pop("sharding", None)
        if mesh is not None:
            if sharding is not None:
                raise TypeError("give the layout once: sharding=MeshLayout(...) or mesh=, not both")
            sharding = MeshLayout.of(mesh, has_state=contract.has_state)
        walk = (short.pop("num_microbatches", 1), short.pop("split", None), short.pop("unroll", 1))
        accumulation = short.pop("accumulation", None)
        if accumulation is None:
            default = "contiguous" if sharding is None else "strided"
            accumulation = Accumulation(walk[0], default if walk[1] is None else walk[1], walk[2])
        elif not isinstance(accumulation, Accumulation):
            raise TypeError(f"accumulation must be a leanstep.Accumulation, got {type(accumulation).__name__}")
        elif walk != (1, None, 1):
            raise ValueError(
                "give num_microbatches, split and unroll inside accumulation=Accumulation(...), not beside it"
            )
        return cls(loss=contract, accumulation=accumulation, sharding=sharding, **short)

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-ready dict, read back by :meth:`from_json` to an equal spec.

        Raises:
          TypeError: a field with no JSON form: a splitter function, a test-only master format.
        """
        if not isinstance(self.accumulation.split, str):
            raise TypeError(f"accumulation.split {self.accumulation.split!r} (a function) has no JSON form")
        if not isinstance(self.master, str):
            raise TypeError(f"master {self.master!r} has no JSON form")
        guard = self.spike_guard
        return {
            "precision": str(self.precision),
            "loss": dataclasses.asdict(self.loss),
            "accumulation": {
                "num_microbatches": self.accumulation.num_microbatches,
                "split": self.accumulation.split,
                "unroll": self.accumulation.unroll,
            },
            "max_grad_norm": self.max_grad_norm,
            "loss_scale": self.loss_scale.to_json(),
            "fp8": None if self.fp8 is None else self.fp8.to_string(),
            "master": self.master,
            "moments": self.moments,
            "update_chunk": self.update_chunk,
            "spike_guard": None if guard is None else {**dataclasses.asdict(guard), "watch": list(guard.watch)},
            "cast_batch": self.cast_batch,
            "donate": self.donate,
            "sharding": None if self.sharding is None else self.sharding.to_json(),
            "int8": None if self.int8 is None else self.int8.to_string(),
            "update_in_backward": self.update_in_backward,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> StepSpec:
        """The spec of :meth:`to_json`'s dict (or its JSON text); a field left out takes its default.

        A part (``loss``, ``accumulation``, ``loss_scale``, ``spike_guard``, ``sharding``) is an
        object of its fields, as :meth:`to_json` writes it, or one of the short forms the
        constructor takes (``"spike_guard": "on"``, ``"loss_scale": 1024``).

        Raises:
          TypeError: a part of another JSON type, naming the field and its forms.
          ValueError: a key that is not a field, or not a field of its part; any refusal of :class:`StepSpec`.

        Example:
          >>> StepSpec.from_json({"spike_guard": "on"}) == StepSpec(spike_guard="on")
          True
          >>> StepSpec.from_json({"accumulation": 2})
          Traceback (most recent call last):
          ...
          TypeError: step spec field 'accumulation' must be an object of the fields num_microbatches, split, ...
        """
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, Mapping):
            raise TypeError(f"a step spec's JSON is an object, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"unknown step spec field(s) {unknown}; expected some of {names}")
        fields = dict(data)
        for name in JSON_PARTS:
            if name in fields:
                fields[name] = read_json_part(name, fields[name])
        return cls(**fields)


#: The short keywords of :meth:`StepSpec.from_keywords` (``mesh`` aside): the fields, and the short
#: forms of the accumulation and the loss contract.
SHORT_KEYWORDS = (
    "precision", "num_microbatches", "max_grad_norm", *_CONTRACT_FLAGS, "split", "unroll", "cast_batch", "donate",
    "loss", "accumulation", "spike_guard", "update_chunk", "loss_scale", "fp8", "master", "moments", "sharding",
    "int8", "update_in_backward",
)  # fmt: skip


def _checked(spec: StepSpec) -> dict[str, Any]:
    """Every field of ``spec`` in its value form, each checked and every combination that cannot work
    refused: the one place (the mesh's own refusals follow in :func:`leanstep.step.settings.step_settings`)."""
    fields = {
        "precision": check_train_precision(spec.precision),
        "loss": spec.loss,
        "accumulation": spec.accumulation,
        "max_grad_norm": check_positive("max_grad_norm", spec.max_grad_norm, optional=True),
        "loss_scale": LossScaleSpec.of(spec.loss_scale),
        "fp8": _parsed(spec.fp8, Fp8Recipe, "fp8", "delayed"),
        "master": check_master(spec.master),
        "moments": spec.moments,
        "update_chunk": check_update_chunk(spec.update_chunk),
        "spike_guard": _parsed(spec.spike_guard, SpikeGuard, "spike_guard", "on"),
        "cast_batch": check_bool("cast_batch", spec.cast_batch),
        "donate": check_bool("donate", spec.donate),
        "sharding": spec.sharding,
        "int8": _parsed(spec.int8, Int8Recipe, "int8", "on"),
        "update_in_backward": check_bool("update_in_backward", spec.update_in_backward),
    }
    if fields["update_in_backward"]:
        _refuse_in_backward(spec, fields["spike_guard"])
    if fields["fp8"] is not None and fields["int8"] is not None:
        raise ValueError("fp8 and int8 are two recipes for the same matmuls: give one (the other None)")
    if not isinstance(spec.loss, LossContract):
        raise TypeError(f"loss must be a leanstep.LossContract, got {type(spec.loss).__name__}")
    if not isinstance(spec.accumulation, Accumulation):
        raise TypeError(f"accumulation must be a leanstep.Accumulation, got {type(spec.accumulation).__name__}")
    if not spec.accumulation.divide:
        raise ValueError(
            "Accumulation(divide=False) hands on sums for a caller that reduces them itself; make_train_step "
            "divides (and, token-weighted on a mesh, sums across devices first): leave divide=True"
        )
    if spec.moments not in MOMENT_DTYPES:
        raise ValueError(f"moments must be one of {MOMENT_DTYPES}, got {spec.moments!r}")
    layout = spec.sharding
    if layout is None:
        return fields
    if not isinstance(layout, MeshLayout):
        raise TypeError(f"sharding must be a leanstep.step.MeshLayout or None, got {type(layout).__name__}")
    refuse_on_mesh(spec, layout.reduce, layout.data_axis, replica=False)  # the mesh's replica axes: unknown yet
    return fields


def refuse_on_mesh(spec: StepSpec, reduce: str, data_axis: str, *, replica: bool) -> None:
    """The settings a mesh refuses, in their one place: a model state whose gradient is reduced once
    per step (or, ``replica``: the mesh has replica axes, by ``reduce="auto"``), so that devices'
    batch statistics would differ; and presplit microbatches (the layer splits the batch itself).
    The spec checks its own layout (the mesh not known yet), :func:`leanstep.step.settings.step_settings`
    the layer on the mesh given.

    Raises:
      ValueError: either, naming the setting and what would be right.
    """
    if spec.loss.has_state and (reduce == "step" or (reduce == "auto" and replica)):
        raise ValueError(
            f"has_state=True with reduce={reduce!r}: a model state (batch statistics) computed per "
            "device would differ between devices that reduce their gradient once per step; use "
            "reduce='microbatch' (the default with has_state)"
        )
    if spec.accumulation.split == "presplit":
        raise ValueError(
            "split='presplit' is not supported with a mesh: pass the whole batch, rows split over "
            f"{data_axis!r}, and the sharding layer splits it into strided microbatches"
        )


def _refuse_in_backward(spec: StepSpec, guard: SpikeGuard | None) -> None:
    """What the update inside the backward pass does not take yet, named (``guard``: the spec's, parsed)."""
    contract = spec.loss
    for refused, what in (
        (
            guard is not None and "update_norm" in guard.watch,
            "a spike guard watching 'update_norm' (known only after the update)",
        ),
        (contract.has_aux, "a loss with aux (has_aux)"),
        (contract.has_state, "a model state (has_state)"),
        (contract.uses_rng, "a loss that takes a PRNG key (uses_rng)"),
    ):
        if refused:
            raise ValueError(f"update_in_backward=True does not yet take {what}; the standard step does")


def _parsed(value: Any, kind: type, field: str, example: str) -> Any:
    """``value`` as an instance of ``kind`` (an Fp8Recipe or SpikeGuard), its string form, or None."""
    if value is None or isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind.from_string(value)  # type: ignore[attr-defined]
        except ValueError as error:
            raise ValueError(f"{field}: {error}") from None
    raise TypeError(
        f"{field} must be a leanstep.{kind.__name__}, its string form (e.g. {example!r}) or None, got {value!r}"
    )
