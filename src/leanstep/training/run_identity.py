"""What identifies a run: the fields a resume must match, and the hash its checkpoints hold.

A resumed run must equal its saved config in every field but :data:`RESUMABLE_FIELDS`, and each
checkpoint holds :func:`config_hash` of those fields. A setting string (``--fp8``,
``--spike-guard``, ``--spike-rollback``) counts by what it means (:func:`setting_meaning`): ``--fp8
DELAYED`` and ``--fp8 delayed,history=1024`` are the same run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any, Protocol

from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.int8 import Int8Recipe
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.training.rollback import SpikeRollback

__all__ = ["ADDED_FIELDS", "CHANGED_DEFAULTS", "RESUMABLE_FIELDS", "config_hash", "config_hashes", "setting_meaning"]


class _RunConfig(Protocol):
    """What the hashes read of a :class:`leanstep.training.RunConfig` (a dataclass), named here
    without importing it: the config module imports this one."""

    def to_json(self) -> dict[str, Any]: ...


#: Fields that may change between a run and its resumption; every other field must match.
#: (Changing ``steps`` changes the learning-rate schedule, so such a run is an extension, not a
#: replay; a run sized by ``time_budget`` records the steps it chose, and resumes with them;
#: ``devices`` and ``fsdp`` only lay the same state out differently: a checkpoint restores into
#: whatever layout the resumed run asks for.)
RESUMABLE_FIELDS = frozenset(
    {
        "steps",
        "time_budget",
        "stop_at",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "out",
        "max_consecutive_skips",
        "progress",
        "chart",
        "devices",
        "fsdp",
        "mesh",
        "reduce",
        "budget",  # what it chose (microbatches, remat, the mesh) is the run's
        "accelerator",
    }
)

#: Fields added since runs were first saved, with the value a saved run without them had.
ADDED_FIELDS: dict[str, Any] = {
    "fp8": "none",
    "int8": "none",
    "master": "float32",
    "moments": "float32",
    "spike_guard": "none",
    "spike_rollback": "none",
    "optimizer": "adamw",
    "update_in_backward": "off",
}

#: Defaults that changed since runs were first saved (in 0.12), with the old default: a run that
#: took the old one resumes from its command line, the saved value taken for a flag not given
#: (:func:`leanstep.training.run_dir.with_saved_defaults`).
CHANGED_DEFAULTS: dict[str, Any] = {"batch_size": 64, "seq_len": 32, "eval_batches": 16, "optimizer": "adamw"}

#: The fields that hold a setting string, and how each is read.
_SETTING_FIELDS: dict[str, Callable[[str], Any]] = {
    "fp8": Fp8Recipe.from_string,
    "int8": Int8Recipe.from_string,
    "spike_guard": SpikeGuard.from_string,
    "spike_rollback": SpikeRollback.from_string,
}


def setting_meaning(name: str, value: Any) -> Any:
    """What field ``name``'s ``value`` means: a setting string (``--fp8``, ``--spike-guard``,
    ``--spike-rollback``) as its settings that differ from their defaults (``"none"`` for none),
    so that the case, the order and the defaults written out do not count; any other value, or
    one that does not parse, as it is.

    Example:
      >>> setting_meaning("fp8", "DELAYED,history=1024"), setting_meaning("fp8", "delayed,margin=1")
      ('Fp8Recipe()', 'Fp8Recipe(margin=1.0)')
      >>> setting_meaning("spike_guard", "k=6,window=100,warmup=100,watch=loss"), setting_meaning("spike_guard", "None")
      ('SpikeGuard()', 'none')
    """
    parse = _SETTING_FIELDS.get(name)
    if parse is None:
        return value
    try:
        parsed = parse(value)
    except (TypeError, ValueError):
        return value  # refused by validate(); compared as written meanwhile
    if parsed is None:
        return "none"
    default = type(parsed)()
    changed = [
        f"{f.name}={getattr(parsed, f.name)!r}"
        for f in dataclasses.fields(parsed)
        if getattr(parsed, f.name) != getattr(default, f.name)
    ]
    return f"{type(parsed).__name__}({', '.join(changed)})"


def config_hash(config: _RunConfig, *, as_written: bool = False) -> str:
    """sha256 of the fields that identify a run (all but :data:`RESUMABLE_FIELDS`), its setting
    strings by what they mean (:func:`setting_meaning`); ``as_written``: by their text, as
    leanstep 0.11 and before hashed them (the checkpoints of those runs hold that hash)."""
    identity = {k: v for k, v in config.to_json().items() if k not in RESUMABLE_FIELDS}
    if not as_written:
        identity = {k: setting_meaning(k, v) for k, v in identity.items()}
    for name, default in ADDED_FIELDS.items():  # a run saved before the field keeps its hash
        if identity.get(name) == default:
            identity.pop(name)
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def config_hashes(config: _RunConfig, saved: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The hashes a checkpoint of ``config``'s run may hold: :func:`config_hash`'s, and 0.11's (the
    setting strings as written) of ``config`` and, where ``saved`` (the run's ``config.json``
    fields, which mean what ``config`` means) is given, of the setting strings written there."""
    hashes = [config_hash(config), config_hash(config, as_written=True)]
    if saved is not None:
        written = {k: saved[k] for k in _SETTING_FIELDS if isinstance(saved.get(k), str)}
        hashes.append(config_hash(dataclasses.replace(config, **written), as_written=True))  # type: ignore[type-var]
    return tuple(hashes)
