"""The flags that size a run default to the machine's choice: none given, an accelerator's run is
sized for it (:mod:`leanstep.training.machine_size`), a CPU's takes ``RunConfig``'s defaults."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from leanstep.training.machine_size import SIZED_FIELDS
from leanstep.training.run_identity import CHANGED_DEFAULTS

__all__ = ["given_fields", "size_flags_by_default", "sized_for_the_machine"]


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
            action.help = (action.help + "; " if action.help else "") + (
                f"default: {action.default} on a CPU; on an accelerator, {rule}"
            )
            action.default = None


def given_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RunConfig`` fields of the parsed flags, less the sized ones left unset (their
    ``RunConfig`` defaults stand until :func:`sized_for_the_machine` replaces them) and those whose
    default has changed left unset (``--resume`` may take the run's own,
    :mod:`leanstep.cli.resume_defaults`)."""
    from leanstep.training import RunConfig

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unset = {
        name for name in (*(name for _, name in SIZED_FIELDS), *CHANGED_DEFAULTS) if getattr(args, name, None) is None
    }
    return {k: v for k, v in vars(args).items() if k in fields and k not in unset}


def sized_for_the_machine(config: Any, args: argparse.Namespace, console: Any) -> Any:
    """``config`` with the model, batch and data :func:`leanstep.training.machine_size.size_for_machine`
    chose for an accelerator, when no flag sizes the run, the model is the transformer and no mesh,
    memory budget or second process is asked for."""
    if any(getattr(args, name) is not None for _, name in SIZED_FIELDS) or (
        args.mesh is not None or args.devices is not None or args.budget is not None or args.coordinator is not None
    ):
        return config
    if config.model != "transformer":  # the rule's shapes are the transformer's
        return config
    import jax
    from rich.text import Text

    from leanstep.training.config import DEFAULT_TIME_BUDGET_S
    from leanstep.training.machine_size import size_for_machine

    device = jax.devices()[0]
    try:  # a backend without memory statistics: the device kind's preset, or 16 GiB
        memory = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    except (AttributeError, RuntimeError, NotImplementedError):
        memory = None
    budget = DEFAULT_TIME_BUDGET_S if config.time_budget is None else config.time_budget
    sized = size_for_machine(device.platform, device.device_kind, memory, budget)
    if sized is None:
        return config
    console.print(Text(f"leanstep train: {sized.reason}"), soft_wrap=True)
    return dataclasses.replace(config, **sized.fields)
