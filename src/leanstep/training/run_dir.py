"""The run directory (``--out``): checked before anything is written, written atomically.

.. code-block:: text

    <out>/config.json       the run's config, corpus split and model sizes (written first)
    <out>/metrics.jsonl     one record per line (see leanstep.training.metrics_log)
    <out>/checkpoints/      orbax checkpoints with sha256 manifests (leanstep.Checkpointer)
    <out>/summary.json      the summary, at the end
    <out>/curves.png        the chart, at the end
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from leanstep.training.config import RunConfig

__all__ = ["UNFINISHED_SAVE", "check_out", "remove_unfinished_saves", "saved_run", "write_json_atomic"]

#: orbax's suffix for a step directory still being written.
UNFINISHED_SAVE = ".orbax-checkpoint-tmp"


def write_json_atomic(path: Path, value: Any) -> None:
    """Writes ``value`` as indented JSON to ``path`` through a temporary file and ``os.replace``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def check_out(out: Path) -> None:
    """``--out`` must be a directory, or creatable as one, whose run files are files.

    Raises:
      ValueError: naming ``--out`` and what is in the way.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    ancestor = out
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"--out {str(out)!r} cannot be created: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise ValueError(f"--out {str(out)!r} cannot be created: {str(ancestor)!r} is not writable")
    for name in ("config.json", "metrics.jsonl"):
        if (out / name).exists() and not (out / name).is_file():
            raise ValueError(f"--out {str(out)!r} holds {name} that is not a regular file")


def saved_run(config: RunConfig, config_path: Path) -> dict[str, Any]:
    """The ``config.json`` of the run to resume.

    Raises:
      ValueError: there is none, it is not the JSON object ``leanstep train`` writes, or it
        belongs to a config that differs in a field that is not resumable.
    """
    out = str(config_path.parent)
    if not config_path.exists():
        raise ValueError(f"--resume: {out!r} holds no run (no config.json); start it without --resume")
    try:
        saved = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"--resume: {str(config_path)!r} is not readable JSON ({error}); expected the "
                         "config.json that leanstep train writes") from None
    run = saved.get("run", saved) if isinstance(saved, dict) else None
    if not isinstance(run, dict):
        raise ValueError(f"--resume: {str(config_path)!r} holds {type(saved).__name__}; expected the JSON "
                         "object that leanstep train writes")
    different = config.mismatches(run)
    if different:
        details = ", ".join(f"{k}={run.get(k)!r} (now {getattr(config, k)!r})" for k in different)
        raise ValueError(f"--resume: {out!r} belongs to a different config: {details}")
    return saved


def remove_unfinished_saves(directory: Path) -> list[str]:
    """Deletes the temporary directories of checkpoint writes a killed run left behind; says what went."""
    if not directory.is_dir():
        return []
    unfinished = sorted(p for p in directory.iterdir() if UNFINISHED_SAVE in p.name)
    for path in unfinished:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [f"removed an unfinished checkpoint write: {p.name}" for p in unfinished]
