"""The run directory (``--out``): checked before anything is written, written atomically.

.. code-block:: text

    <out>/config.json       the run's config, corpus split and model sizes (written first)
    <out>/metrics.jsonl     one record per line (see leanstep.training.metrics_log)
    <out>/checkpoints/      orbax checkpoints with sha256 manifests (leanstep.checkpoints.Checkpointer)
    <out>/summary.json      the summary, at the end
    <out>/curves.png        the chart, at the end
    <out>/run.lock          held by the run writing the directory (leanstep.training.run_lock)
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from leanstep.common.files import read_regular_file
from leanstep.common.outputs import write_bytes_atomic
from leanstep.training.config import RunConfig
from leanstep.training.config_checks import flag_of
from leanstep.training.run_identity import ADDED_FIELDS, CHANGED_DEFAULTS

__all__ = [
    "check_out",
    "check_run",
    "fresh_start",
    "holds_run",
    "saved_run",
    "with_saved_defaults",
    "with_saved_plan",
    "write_json_atomic",
]


def write_json_atomic(path: Path, value: Any) -> None:
    """Writes ``value`` as indented JSON to ``path``, whole or not at all (temporary file, fsync, rename)."""
    write_bytes_atomic(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def check_out(out: Path) -> None:
    """``--out`` must be a directory, or creatable as one, whose run files are files.

    Raises:
      ValueError: naming ``--out`` and what is in the way, or a name that is not UTF-8
        (orbax, which writes the checkpoints, takes paths as UTF-8 strings: refused here,
        before anything is written, rather than at the first save).
    """
    try:
        os.fsdecode(os.fspath(out)).encode("utf-8")
    except UnicodeError:
        raise ValueError(
            f"--out {os.fsdecode(os.fspath(out))!r} is not a UTF-8 name, which the checkpoints need; choose another --out"
        ) from None
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


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds any of a run's files (a run stopped before it wrote them holds none).

    ``--resume`` on a directory that holds only ``run.lock`` (a run stopped before it wrote
    them, e.g. preempted while it compiled) starts the run afresh (:func:`leanstep.training.train`).
    """
    return any((out / name).exists() for name in ("config.json", "metrics.jsonl", "checkpoints"))


def fresh_start(out: Path, lock_existed: bool) -> str | None:
    """The note for ``--resume`` on a directory a run started in (``lock_existed``: its run.lock
    was there) but stopped before it wrote a file of the run; None where that is not the case."""
    if not lock_existed or holds_run(out):
        return None
    return f"--resume: {str(out)!r} holds no checkpoint yet (its run stopped before the first); starting the run afresh"


def saved_run(config: RunConfig, config_path: Path) -> dict[str, Any]:
    """The ``config.json`` of the run to resume.

    Raises:
      ValueError: there is none, it is not the JSON object ``leanstep train`` writes, or it
        belongs to a config that differs in a field that is not resumable.
    """
    out = str(config_path.parent)
    if not config_path.exists():
        raise ValueError(f"--resume: {out!r} holds no run (no config.json); start it without --resume")
    # A regular file, size-limited: its own message otherwise (a FIFO, a directory, too big).
    text = read_regular_file(config_path, what=f"--resume: {str(config_path)!r}", limit=64 << 20)
    try:
        saved = json.loads(text)
    except (ValueError, RecursionError) as error:  # JSON, UTF-8 or nesting
        raise ValueError(
            f"--resume: {str(config_path)!r} is not readable JSON ({error}); expected the "
            "config.json that leanstep train writes"
        ) from None
    run = saved.get("run", saved) if isinstance(saved, dict) else None
    if not isinstance(run, dict):
        raise ValueError(  # noqa: TRY004 - the file's content is bad data (ValueError, as documented), not a bad call
            f"--resume: {str(config_path)!r} holds {type(saved).__name__}; expected the JSON "
            "object that leanstep train writes"
        )
    different = config.mismatches(run)
    if different:
        then = {**ADDED_FIELDS, **run}  # a field newer than the run: the value it ran with
        details = ", ".join(f"{flag_of(k)} {then.get(k)!r} (now {getattr(config, k)!r})" for k in different)
        raise ValueError(
            f"--resume: {out!r} belongs to a different config: {details}; give the run's own values to resume it "
            "(a default may have changed since it started)"
        )
    return saved


def _saved_fields(config: RunConfig) -> dict[str, Any] | None:
    """The ``run`` fields of ``config.out``'s ``config.json``, or None where it cannot be read
    (:func:`check_run` then says what is wrong)."""
    path = Path(config.out) / "config.json"
    try:
        run = json.loads(read_regular_file(path, what=str(path), limit=64 << 20)).get("run", {})
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return run if isinstance(run, dict) else None


def with_saved_defaults(config: RunConfig, given: Collection[str]) -> tuple[RunConfig, str | None]:
    """``config`` to resume, with the saved value of each field whose default has changed
    (:data:`~leanstep.training.run_identity.CHANGED_DEFAULTS`) where the run took the old default
    and the field is not in ``given`` (those set explicitly: they must match, as any field); and
    one line naming the flags taken, or None when none is.

    So a run 0.11 made with its defaults (64 windows of 32 bytes, AdamW), resumed by
    ``leanstep train --resume``, takes ``--batch-size 64``, ``--seq-len 32``, ``--eval-batches 16``
    and ``--optimizer adamw`` instead of being refused for today's defaults.
    """
    import dataclasses

    run = _saved_fields(config)
    if run is None:
        return config, None
    taken = {
        name: old
        for name, old in CHANGED_DEFAULTS.items()
        if name not in given and run.get(name, ADDED_FIELDS.get(name)) == old and getattr(config, name) != old
    }
    resumed = dataclasses.replace(config, **taken)
    if not taken or _resolved(with_saved_plan(resumed)).mismatches(run):  # refused by check_run, naming it
        return resumed, None
    flags = ", ".join(f"{flag_of(name)} {value}" for name, value in taken.items())
    now = ", ".join(str(getattr(config, name)) for name in taken)
    note = f"--resume: took the run's own {flags}, whose defaults have changed since it started (now {now})"
    return resumed, note


def _resolved(config: RunConfig) -> RunConfig:
    """``config`` as the run will be built (``--size auto`` resolved); as it is where it is invalid
    (refused later, naming the flag)."""
    from leanstep.training.machine_size import choose_for_machine

    try:
        return choose_for_machine(config).config
    except ValueError:
        return config


def with_saved_plan(config: RunConfig) -> RunConfig:
    """``config`` to resume, with what its run chose for itself: the steps a ``--time-budget``
    planned (when ``config.steps`` is None) and the policy ``--precision auto`` chose.

    A resumed run replays those choices rather than making them again: the machine may be
    faster or slower now, or another kind. Without a readable ``config.json`` the config is
    returned as is, and :func:`check_run` says what is wrong.
    """
    import dataclasses

    run = _saved_fields(config)
    if run is None:
        return config
    changes: dict[str, Any] = {}
    if config.steps is None and isinstance(run.get("steps"), int):
        changes["steps"] = run["steps"]
    if config.precision == "auto" and isinstance(run.get("precision"), str):
        changes["precision"] = run["precision"]
    return dataclasses.replace(config, **changes)


def check_run(config: RunConfig, resume: bool, corpus: dict[str, Any]) -> dict[str, Any] | None:
    """What ``--out`` holds fits the run: nothing (a new run) or this run (``--resume``).

    Args:
      config: the run.
      resume: whether it continues the run in ``config.out``.
      corpus: the corpus description (``Corpus.describe()``) of ``--data`` now.

    Returns:
      The saved ``config.json`` on resume, else None.

    Raises:
      ValueError: a new run in a directory that holds one; on resume, no run, another config,
        other data, or a run of leanstep < 0.3's transformer.
    """
    from leanstep.models.transformer import QKV_LAYOUT

    out = Path(config.out)
    config_path = out / "config.json"
    if not resume:
        if holds_run(out):
            raise ValueError(
                f"--out {str(out)!r} already holds a run; pass --resume to continue it or choose another --out"
            )
        return None
    saved = saved_run(config, config_path)
    saved_corpus = saved.get("corpus")
    saved_sha = saved_corpus.get("data_sha256") if isinstance(saved_corpus, dict) else None
    if saved_sha not in (None, corpus["data_sha256"]):
        raise ValueError(
            f"--resume: the data behind --data {config.data!r} changed since the run started "
            f"(sha256 {str(saved_sha)[:12]}… then, {corpus['data_sha256'][:12]}… now); "
            "resuming would not replay the run"
        )
    if config.model == "transformer" and saved.get("qkv_layout") != QKV_LAYOUT:
        raise ValueError(
            f"--resume: {str(out)!r} was written by leanstep < 0.3, whose transformer ordered the "
            "attention weights' columns q|k|v-major (now head-major, for tensor parallelism); its "
            "checkpoints would load into the wrong attention: continue it with leanstep 0.2"
        )
    return saved
