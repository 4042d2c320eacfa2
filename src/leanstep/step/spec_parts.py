"""Parts of a :class:`leanstep.StepSpec` that are settings, not state: the loss scale it starts
from (:class:`LossScaleSpec`) and the layout over a mesh (:class:`MeshLayout`), each a hashable
value with a JSON form; the ``update_chunk`` setting's forms (:func:`check_update_chunk`); and how
:meth:`leanstep.StepSpec.from_json` reads a part (``loss``, ``accumulation``, ``loss_scale``,
``spike_guard``, ``sharding``, and the strings ``precision`` and ``fp8``): an object of its fields,
as :meth:`~leanstep.StepSpec.to_json` writes it, or a short form the constructor takes; any other
JSON type is one ``TypeError`` naming the field and its forms (:func:`read_json_part`).

.. code-block:: text

    LossScaleSpec   "none" | "dynamic" | a number (static) | a LossScale  ->  make() -> LossScale
    MeshLayout      axes, data_axis, fsdp, reduce        ->  the ShardingLayer on a mesh (leanstep.step.settings)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.loss_contract import LossContract
from leanstep.blocks.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from leanstep.blocks.loss_scale_registry import LOSS_SCALES
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.common.checks import check_bool, check_positive, is_int, is_real
from leanstep.sharding.distributed import parse_mesh

__all__ = ["JSON_PARTS", "REDUCTIONS", "LossScaleSpec", "MeshLayout", "check_update_chunk", "read_json_part"]

#: Where gradients are reduced over a mesh (:class:`leanstep.step.ShardingLayer`'s ``reduce``).
REDUCTIONS = ("auto", "step", "microbatch")

#: :meth:`DynamicLossScale.create`'s settings and their defaults (a spec keeps only those that differ).
_DYNAMIC_DEFAULTS: dict[str, float] = {
    "growth_interval": 2000,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "min_loss_scale": 1.0,
    "max_loss_scale": 2.0**24,
    "hysteresis": 1,
}
_INITIAL_DYNAMIC = 2.0**15
_FORMS = "'none', 'dynamic', a number (a static scale) or a LossScale (e.g. leanstep.StaticLossScale.create(1024.0))"


@dataclasses.dataclass(frozen=True)
class LossScaleSpec:
    """The loss scale a state starts from, as a setting (the instance holds arrays; this does not).

    Attributes:
      kind: ``"none"``, ``"static"`` or ``"dynamic"``.
      scale: the static scale, or the dynamic one's initial scale (``2**15`` unless given); None for none.
      settings: the dynamic scale's settings that differ from :meth:`DynamicLossScale.create`'s
        defaults, as sorted ``(name, value)`` pairs.

    Example:
      >>> LossScaleSpec.of("dynamic").to_json(), LossScaleSpec.of(1024.0).to_json()
      ('dynamic', {'static': 1024.0})
    """

    kind: str = "none"
    scale: float | None = None
    settings: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LOSS_SCALES:
            raise ValueError(f"unknown loss scale spec {self.kind!r}; expected one of {_FORMS}")
        settings = dict(self.settings)
        if self.kind != "dynamic" and settings:
            raise ValueError(f"loss_scale settings {sorted(settings)} apply only to a dynamic scale, not {self.kind!r}")
        unknown = sorted(set(settings) - set(_DYNAMIC_DEFAULTS))
        if unknown:
            raise ValueError(
                f"loss_scale: unknown dynamic settings {unknown}; expected some of {list(_DYNAMIC_DEFAULTS)}"
            )
        kept = tuple(sorted((k, v) for k, v in settings.items() if v != _DYNAMIC_DEFAULTS[k]))
        object.__setattr__(self, "settings", kept)
        scale = self.scale
        if self.kind == "none" and scale not in (None, 1, 1.0):
            raise ValueError(f"loss_scale 'none' has no scale, got scale={scale!r}")
        if self.kind == "static" and scale is None:
            raise ValueError("loss_scale='static' needs its scale: give the number (loss_scale=1024.0)")
        scale = _INITIAL_DYNAMIC if self.kind == "dynamic" and scale is None else scale
        object.__setattr__(self, "scale", None if self.kind == "none" else check_positive("loss_scale", scale))
        self.make()  # the instance's own checks (a dynamic scale within its bounds, ...), here and once

    @classmethod
    def of(cls, value: Any) -> LossScaleSpec:
        """The spec of ``value``: ``"none"``, ``"dynamic"``, a number (a static scale), a
        :class:`LossScaleSpec`, or a built-in loss scale (its current scale and settings).

        Raises:
          TypeError: another type (a loss scale of your own class: give it to
            ``TrainState.create(loss_scale=...)``, which keeps it as it is).
          ValueError: ``"static"`` without its scale, an unknown name.
        """
        if isinstance(value, LossScaleSpec):
            return value
        if isinstance(value, str):
            name = value.strip().lower()
            if name == "static":
                raise ValueError(
                    "loss_scale='static' needs its scale: pass loss_scale=leanstep.StaticLossScale.create(S) "
                    "(e.g. S=1024.0), or to a StepSpec the number itself (loss_scale=1024.0)"
                )
            return cls(name if name in LOSS_SCALES else value)
        if is_real(value):
            return cls("static", float(value))
        if isinstance(value, NoOpLossScale):
            return cls("none")
        if isinstance(value, StaticLossScale):
            return cls("static", float(value.loss_scale))
        if isinstance(value, DynamicLossScale):
            settings = tuple((name, getattr(value, name)) for name in _DYNAMIC_DEFAULTS)
            return cls("dynamic", float(value.loss_scale), settings)
        what = "a loss scale of its own class" if isinstance(value, LossScale) else type(value).__name__
        raise TypeError(f"loss_scale must be {_FORMS}, got {what} {value!r}")

    def make(self) -> LossScale:
        """A fresh loss scale (counters at zero)."""
        if self.kind == "none":
            return NoOpLossScale()
        if self.kind == "static":
            return StaticLossScale.create(self.scale)  # type: ignore[arg-type]  # a float: checked
        return DynamicLossScale.create(self.scale, **dict(self.settings))  # type: ignore[arg-type]

    def to_json(self) -> Any:
        """``"none"``, ``"dynamic"`` (the defaults), ``{"static": S}`` or ``{"dynamic": S, setting: value, ...}``."""
        if self.kind == "none" or (self.kind == "dynamic" and self.scale == _INITIAL_DYNAMIC and not self.settings):
            return self.kind
        return {self.kind: self.scale, **dict(self.settings)}

    @classmethod
    def from_json(cls, data: Any) -> LossScaleSpec:
        """The spec :meth:`to_json` wrote."""
        if isinstance(data, str):
            return cls.of(data)
        if not isinstance(data, Mapping) or len([k for k in data if k in LOSS_SCALES]) != 1:
            raise ValueError(f"loss_scale: expected 'none', 'dynamic' or {{'static'|'dynamic': S, ...}}, got {data!r}")
        kind = next(k for k in data if k in LOSS_SCALES)
        return cls(kind, data[kind], tuple((k, v) for k, v in data.items() if k != kind))


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How a step is laid out over the mesh it is given (the mesh itself is built from devices at
    run time; this is data).

    Attributes:
      axes: the mesh's ``(name, size)`` pairs, in order, e.g. ``(("data", 2), ("fsdp", 2))``
        (also given as ``leanstep train --mesh``'s ``"data=2,fsdp=2"`` or a dict), checked
        against the mesh given; None: any mesh.
      data_axis, fsdp, reduce: as :class:`leanstep.step.ShardingLayer`'s.

    Example:
      >>> MeshLayout("data=2,fsdp=2").to_json()
      {'axes': {'data': 2, 'fsdp': 2}, 'data_axis': 'data', 'fsdp': False, 'reduce': 'auto'}
    """

    axes: tuple[tuple[str, int], ...] | None = None
    data_axis: str = "data"
    fsdp: bool = False
    reduce: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", _pairs(self.axes))
        if not isinstance(self.data_axis, str):
            raise TypeError(f"sharding.data_axis must be a str, got {self.data_axis!r}")
        object.__setattr__(self, "fsdp", check_bool("sharding.fsdp", self.fsdp))
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"sharding.reduce must be one of {REDUCTIONS}, got {self.reduce!r}")

    @classmethod
    def of(cls, mesh: Any, *, has_state: bool = False) -> MeshLayout:
        """The layout of a :class:`leanstep.step.ShardingLayer`, or of a plain ``Mesh`` under the layer's
        defaults (once per microbatch with a model state, whose batch statistics must see whole microbatches).

        Raises:
          TypeError: ``mesh`` neither.
        """
        if isinstance(mesh, Mesh):
            return cls(tuple(mesh.shape.items()), reduce="microbatch" if has_state else "auto")
        if not isinstance(getattr(mesh, "mesh", None), Mesh):  # a ShardingLayer, read without importing it
            raise TypeError(
                f"mesh must be a jax.sharding.Mesh or a leanstep.step.ShardingLayer, got {type(mesh).__name__}"
            )
        return cls(tuple(mesh.mesh.shape.items()), mesh.data_axis, mesh.fsdp, mesh.reduce)

    def to_json(self) -> dict[str, Any]:
        """The fields, ``axes`` as a ``{name: size}`` dict."""
        return {**dataclasses.asdict(self), "axes": None if self.axes is None else dict(self.axes)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MeshLayout:
        """The layout :meth:`to_json` wrote."""
        return cls(**data)


def _pairs(axes: Any) -> tuple[tuple[str, int], ...] | None:
    """``axes`` as ``(name, size)`` pairs (from ``"data=2,fsdp=2"``, a dict or pairs), checked."""
    if axes is None:
        return None
    given = axes
    if isinstance(axes, str):
        axes = parse_mesh(axes)
    pairs = tuple(tuple(pair) for pair in (axes.items() if isinstance(axes, Mapping) else axes))
    names = [p[0] for p in pairs if len(p) == 2 and isinstance(p[0], str) and is_int(p[1]) and p[1] >= 1]
    if len(names) != len(pairs) or len(set(names)) != len(names):
        raise ValueError(f"sharding.axes must be (name, size) pairs, each name once, got {given!r}")
    return tuple((str(name), int(size)) for name, size in pairs)


def axes_text(axes: Any) -> str:
    """``(("data", 2), ("fsdp", 2))`` as ``"data=2,fsdp=2"``."""
    return ",".join(f"{name}={size}" for name, size in axes)


def check_update_chunk(update_chunk: Any) -> int | str | None:
    """``update_chunk`` if it is ``"auto"``, None or a positive int.

    Raises:
      ValueError: another value, shown with the forms it may take.
    """
    if update_chunk is None or update_chunk == "auto" and isinstance(update_chunk, str):
        return update_chunk
    if is_int(update_chunk) and update_chunk > 0:
        return int(update_chunk)
    raise ValueError(
        f"update_chunk must be 'auto', a positive int (the most entries one chunk of the optimizer's "
        f"update widens to float32) or None (the whole tree at once), got {update_chunk!r}"
    )


#: Each part's JSON types and, in words, its forms.
JSON_PARTS: dict[str, tuple[tuple[type, ...], str]] = {
    "precision": ((str,), 'a string such as "compute=bfloat16" or "float32"'),
    "loss": (
        (Mapping,),
        'an object of the fields has_aux, token_weighted, uses_rng, has_state (e.g. {"has_aux": true})',
    ),
    "accumulation": (
        (Mapping,),
        'an object of the fields num_microbatches, split, unroll (e.g. {"num_microbatches": 2})',
    ),
    "loss_scale": (
        (str, int, float, Mapping),
        '"none", "dynamic", a number (a static scale) or an object such as {"dynamic": 32768.0}',
    ),
    "fp8": ((str, type(None)), 'null or a recipe string such as "delayed"'),
    "int8": ((str, type(None)), 'null or a recipe string such as "on"'),
    "spike_guard": (
        (str, Mapping, type(None)),
        'null, a string such as "on" or "k=6,window=100", or an object of the fields window, k, warmup, watch',
    ),
    "sharding": (
        (Mapping, type(None)),
        'null or an object of the fields axes, data_axis, fsdp, reduce (e.g. {"axes": "data=2"})',
    ),
}
#: The type an object form is read into, by its fields.
_PART_TYPES: dict[str, type] = {
    "loss": LossContract,
    "accumulation": Accumulation,
    "spike_guard": SpikeGuard,
    "sharding": MeshLayout,
}


def read_json_part(name: str, value: Any) -> Any:
    """Part ``name``'s JSON ``value``: an object read into its type; a string or number (a short
    form) as it is, for the :class:`~leanstep.StepSpec` constructor to read and check.

    Raises:
      TypeError: ``value`` of another JSON type, naming the field and its forms.
      ValueError: an object with a key that is not a field of the part, naming the part's fields.

    Example:
      >>> read_json_part("accumulation", {"num_microbatches": 2}).num_microbatches
      2
      >>> read_json_part("loss", None)
      Traceback (most recent call last):
      ...
      TypeError: step spec field 'loss' must be an object of the fields has_aux, token_weighted, ..., got NoneType None
    """
    types, forms = JSON_PARTS[name]
    if not isinstance(value, types) or isinstance(value, bool):
        raise TypeError(f"step spec field {name!r} must be {forms}, got {type(value).__name__} {value!r}")
    if not isinstance(value, Mapping):
        return value
    if name == "loss_scale":
        return LossScaleSpec.from_json(value)
    kind = _PART_TYPES[name]
    known = [f.name for f in dataclasses.fields(kind) if f.init]
    unknown = sorted(set(value) - set(known), key=str)
    if unknown:
        raise ValueError(f"step spec field {name!r}: unknown key(s) {unknown}; expected some of {known}")
    return kind(**value)
