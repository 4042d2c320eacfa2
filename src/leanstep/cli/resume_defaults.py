"""``leanstep train --resume`` of a run that took a default since changed: a flag not given takes
the run's own value (:func:`leanstep.training.run_dir.with_saved_defaults`), said on one line; a
flag given must match the run, as any flag."""

from __future__ import annotations

import argparse
from typing import Any

from leanstep.training.run_identity import CHANGED_DEFAULTS

__all__ = ["changed_flags_by_default", "with_run_defaults"]


def changed_flags_by_default(p: argparse.ArgumentParser) -> None:
    """Sets the default of each flag of ``p`` whose default has changed to None, its help saying
    what it is, so that a flag not given can be told from one given at its default."""
    for action in p._actions:
        if action.dest in CHANGED_DEFAULTS and action.default is not None:
            action.help = (action.help + "; " if action.help else "") + (
                f"default: {action.default} (--resume: the run's own, if it took {CHANGED_DEFAULTS[action.dest]}, "
                "the default before 0.12)"
            )
            action.default = None


def with_run_defaults(config: Any, args: argparse.Namespace, console: Any) -> Any:
    """``config`` (of ``args``) with the run's own values of the changed defaults not given, on
    ``--resume`` (a run made before the machine's sizing keeps its batch and window, so the library
    does not size it: :func:`leanstep.training.machine_size.choose_for_machine`)."""
    if not args.resume:
        return config
    from rich.text import Text

    from leanstep.training.run_dir import with_saved_defaults

    given = {name for name in CHANGED_DEFAULTS if getattr(args, name, None) is not None}
    resumed, note = with_saved_defaults(config, given)
    if note is not None:
        console.print(Text(f"leanstep train: {note}"), soft_wrap=True)
    return resumed
