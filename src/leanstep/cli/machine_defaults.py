"""The flags that size a run default to the machine's choice: none given, ``RunConfig``'s
``size="auto"`` stands, and the library sizes the run (:mod:`leanstep.training.machine_size`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from leanstep.training.config import UNSIZED
from leanstep.training.machine_size import SIZED_FIELDS
from leanstep.training.run_identity import CHANGED_DEFAULTS

__all__ = ["given_fields", "size_flags_by_default"]


def size_flags_by_default(p: argparse.ArgumentParser) -> None:
    """Sets the default of each of :data:`SIZED_FIELDS`' flags of ``p`` to None, its help saying so."""
    dests = {name for _, name in SIZED_FIELDS}
    for action in p._actions:
        if action.dest in dests and action.default is not None:
            rule = (
                "sized for the device and the budget when none of --size, --d-model, --layers, --heads, --d-ff, "
                "--batch-size, --seq-len, --microbatches or --data is given"
                if action.dest == "size"
                else "sized (see --size)"
            )
            default = UNSIZED if action.dest == "size" else action.default
            action.help = (action.help + "; " if action.help else "") + (
                f"default: {default} on a CPU; on an accelerator, {rule}"
            )
            action.default = None


def given_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RunConfig`` fields of the parsed flags, less the sized ones left unset (their
    ``RunConfig`` defaults stand: ``size="auto"``, which the library resolves) and those whose
    default has changed left unset (``--resume`` may take the run's own,
    :mod:`leanstep.cli.resume_defaults`). A sized flag given without ``--size`` names the size
    :data:`~leanstep.training.config.UNSIZED`: the run is sized by its flags, not the machine."""
    from leanstep.training import RunConfig

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    sized = [name for _, name in SIZED_FIELDS]
    unset = {name for name in (*sized, *CHANGED_DEFAULTS) if getattr(args, name, None) is None}
    given = {k: v for k, v in vars(args).items() if k in fields and k not in unset}
    if "size" not in given and any(name in given for name in sized):
        given["size"] = UNSIZED
    return given
