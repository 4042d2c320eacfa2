"""How :meth:`leanstep.StepSpec.from_json` reads a part of the spec (``loss``, ``accumulation``,
``loss_scale``, ``spike_guard``, ``sharding``, and the strings ``precision`` and ``fp8``): an
object of its fields, as :meth:`~leanstep.StepSpec.to_json` writes it, or a short form the
constructor takes; any other JSON type is one ``TypeError`` naming the field and its forms."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.loss_contract import LossContract
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.step.spec_parts import LossScaleSpec, MeshLayout

__all__ = ["JSON_PARTS", "read_json_part"]

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
