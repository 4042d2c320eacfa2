"""Checkpoints of the whole train state: orbax writes them, a checksum manifest vouches for them.

Layout of a checkpoint directory::

    <directory>/<step>/state/...                  the state pytree (orbax, OCDBT)
    <directory>/<step>/extra/metadata             the ``extra`` dict (orbax, JSON)
    <directory>/<step>/leanstep_manifest.json     size + sha256 of every other file
    <directory>/<step>.orbax-checkpoint-tmp/      a save in progress (or interrupted)

Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` only when
complete, so an interrupted save is never listed. The manifest (:mod:`leanstep.checkpoint_manifest`)
is written after the rename (temporary file + ``os.replace``); a step without a valid manifest,
or whose files do not match it, is never restored, and :meth:`Checkpointer.restore` falls back
to the newest step that passes. Old steps are deleted only after the newer step's manifest is on disk.
"""

from __future__ import annotations

import logging
import operator
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from leanstep._checks import is_int
from leanstep.checkpoint_manifest import (
    MANIFEST_NAME,
    RejectedStep,
    verify_manifest,
    write_manifest,
)

__all__ = ["CheckpointError", "Checkpointer", "RestoreResult", "MANIFEST_NAME"]

_TMP_SUFFIX = ".orbax-checkpoint-tmp"

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint could be restored."""


class RestoreResult(NamedTuple):
    """What :meth:`Checkpointer.restore` returns.

    Attributes:
      state: the restored state, in the structure, dtypes and shardings of the template.
      extra: the JSON dict saved with it.
      step: the step restored.
      skipped: one message per newer step that was rejected, saying why (empty if none).
    """

    state: Any
    extra: dict[str, Any]
    step: int
    skipped: tuple[str, ...]


def _leaf_specs(tree: Any, name: str, *, abstract_ok: bool) -> list[list[Any]]:
    """``[keypath, shape, dtype]`` per leaf; raises TypeError for a leaf that is not an array."""
    specs = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        is_abstract = isinstance(leaf, jax.ShapeDtypeStruct)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or (is_abstract and not abstract_ok):
            allowed = "jax.Array or np.ndarray" + (" or jax.ShapeDtypeStruct" if abstract_ok else "")
            raise TypeError(
                f"{name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; every leaf of "
                f"{name} must be a {allowed}"
            )
        specs.append([jax.tree_util.keystr(path), [int(d) for d in leaf.shape], str(leaf.dtype)])
    return specs


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    # A concrete jax.Array carries the sharding the restored array must have.
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))


def _check_step(step: Any) -> int:
    """Accepts any integer scalar (Python, NumPy, a jax scalar array), not a bool."""
    try:
        index = operator.index(step) if not isinstance(step, (bool, np.bool_)) else -1
    except TypeError:
        index = -1
    if index < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return index


def _check_json(value: Any, where: str) -> None:
    """Rejects what JSON would silently change (tuples, non-str keys) or cannot hold."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has key {key!r} of type {type(key).__name__}; JSON keys must be str"
                )
            _check_json(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
    elif value is not None and type(value) not in (bool, int, float, str):
        raise TypeError(
            f"{where} is a {type(value).__name__} ({value!r}); extra must hold only dict (str keys), "
            "list, str, int, float, bool and None (convert arrays with float()/int()/.tolist())"
        )


class Checkpointer:
    """Saves and restores a train-state pytree plus a JSON dict, keeping the newest ``max_to_keep``.

    Pseudocode of the guarantees::

        save(s):    refuse if a step >= s exists; orbax writes <s>.tmp, renames to <s>;
                    write <s>/manifest (sha256 of every file) atomically;
                    delete steps older than the newest max_to_keep steps with a manifest
        restore():  for s in steps, newest first:
                        manifest valid and files match and leaves match template
                        and orbax restores it  ->  return it
                        otherwise record why and try the next older step
                    none left -> CheckpointError listing every step and its reason

    Args:
      directory: where the step directories live; created if missing.
      max_to_keep: how many verified steps to keep, at least 1.

    Raises:
      ValueError: ``max_to_keep`` is not an int >= 1.
      CheckpointError: ``directory`` is a file, or cannot be created.

    Example:
      >>> import shutil, tempfile, jax.numpy as jnp, optax
      >>> params = {"w": jnp.arange(3.0)}
      >>> state = {"params": params, "opt": optax.adam(1e-3).init(params)}
      >>> directory = tempfile.mkdtemp()
      >>> with Checkpointer(directory, max_to_keep=2) as ckpt:
      ...     for step in (10, 20, 30):
      ...         ckpt.save(step, state, extra={"data_position": step})
      ...     result = ckpt.restore(state)
      ...     ckpt.all_steps()
      [20, 30]
      >>> result.step, result.extra, result.skipped
      (30, {'data_position': 30}, ())
      >>> type(result.state["opt"][0]).__name__, result.state["params"]["w"]
      ('ScaleByAdamState', Array([0., 1., 2.], dtype=float32))
      >>> shutil.rmtree(directory)
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> None:
        if not is_int(max_to_keep) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an int >= 1, got {max_to_keep!r}")
        path = Path(directory).expanduser().absolute()
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {path}: {e}") from e
        self.directory = path
        self.max_to_keep = max_to_keep
        self._pending: list[tuple[int, list[list[Any]]]] = []
        self._closed = False
        # Orbax keeps every step; we prune ourselves, and only after the newer manifest is written,
        # so a crash between orbax's rename and our manifest never leaves fewer verified steps.
        self._manager = ocp.CheckpointManager(
            path, options=ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=True)
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer for {self.directory} is closed")

    def _step_dirs(self) -> list[int]:
        """Finalized step directories on disk (orbax's own step naming: the bare number)."""
        try:
            entries = list(os.scandir(self.directory))
        except OSError as e:
            raise CheckpointError(f"cannot list checkpoint directory {self.directory}: {e}") from e
        names = [e.name for e in entries if e.name.isascii() and e.name.isdigit() and e.is_dir()]
        return sorted(int(n) for n in names if str(int(n)) == n)

    def all_steps(self) -> list[int]:
        """Steps orbax finished writing, ascending (their checksums are verified on restore)."""
        return self._step_dirs()

    def latest_step(self) -> int | None:
        """The newest step orbax finished writing, or None if there is none."""
        steps = self._step_dirs()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, *, extra: dict[str, Any] | None = None, wait: bool = True) -> None:
        """Saves ``state`` and ``extra`` as checkpoint ``step``.

        Args:
          step: a non-negative integer (a jax scalar such as ``state.step`` works), larger than
            every step already in the directory.
          state: a pytree of arrays (jax or NumPy); any registered pytree nodes.
          extra: a JSON-compatible dict (str keys; lists, not tuples) saved with it.
          wait: if False, return once the arrays are copied off the device (they may be donated
            afterwards); the write and the manifest finish at the next ``save``,
            ``wait_until_finished``, ``restore`` or ``close``.

        Raises:
          ValueError: ``step`` is not a non-negative integer.
          TypeError: a leaf of ``state`` is not a concrete array, or ``extra`` is not
            JSON-compatible.
          CheckpointError: a step >= ``step`` already exists (delete it first, e.g. with
            :meth:`delete_newer_than` after resuming from an older step), or writing failed
            (earlier checkpoints are untouched).
        """
        step = _check_step(step)
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
        _check_json(extra, "extra")
        specs = _leaf_specs(state, "state", abstract_ok=False)
        self._check_open()
        self.wait_until_finished()
        clashing = [s for s in self._step_dirs() if s >= step]
        if clashing:
            raise CheckpointError(
                f"cannot save step {step} to {self.directory}: it already holds step(s) {clashing}; "
                "steps must increase (after resuming from an older step, remove the newer ones "
                "with delete_newer_than)"
            )
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra))
        try:
            # force: orbax's own save-interval policy must never skip a save silently.
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            raise CheckpointError(
                f"saving step {step} to {self.directory} failed: {type(e).__name__}: {e}"
            ) from e
        self._pending.append((step, specs))
        if wait:
            self.wait_until_finished()

    def wait_until_finished(self) -> None:
        """Blocks until pending saves are written, then writes their manifests and prunes old steps.

        Raises:
          CheckpointError: a pending save failed (earlier checkpoints are untouched).
        """
        if self._closed:
            return
        pending, self._pending = self._pending, []
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            steps = [s for s, _ in pending]
            raise CheckpointError(
                f"saving step(s) {steps} to {self.directory} failed: {type(e).__name__}: {e}"
            ) from e
        # Multi-process: every process saves its own shards (orbax), but the manifest has one
        # writer, process 0; the others wait for it so that no process prunes or restores early.
        primary = jax.process_index() == 0
        for step, specs in pending:
            step_dir = self.directory / str(step)
            try:
                if primary:
                    write_manifest(step_dir, step, specs)
            except OSError as e:  # the step stays unverified, so restore never picks it
                raise CheckpointError(f"writing the manifest of {step_dir} failed: {e}") from e
        if pending:
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"leanstep manifest {self.directory} {pending[-1][0]}")
            self._prune()

    def _prune(self) -> None:
        steps = self._step_dirs()
        verified = [s for s in steps if (self.directory / str(s) / MANIFEST_NAME).is_file()]
        if len(verified) <= self.max_to_keep:
            return
        oldest_kept = verified[-self.max_to_keep]
        for step in steps:
            if step < oldest_kept:
                self._delete(step)

    def _delete(self, step: int) -> None:
        if step not in self._manager.all_steps():
            self._manager.reload()  # the directory changed behind orbax's cache
        self._manager.delete(step)

    def delete_newer_than(self, step: int) -> list[int]:
        """Deletes every step after ``step`` (a run resumed from ``step`` abandons them).

        Returns:
          The deleted steps, ascending.

        Raises:
          ValueError: ``step`` is not a non-negative integer.
        """
        step = _check_step(step)
        self._check_open()
        self.wait_until_finished()
        newer = [s for s in self._step_dirs() if s > step]
        for s in newer:
            self._delete(s)
        return newer

    def restore(self, template_state: Any, *, step: int | None = None) -> RestoreResult:
        """Restores the newest good checkpoint (or ``step``) into the structure of ``template_state``.

        Static fields of dataclass pytrees and NamedTuple types come from ``template_state``;
        array values come from disk, bit-exact, with the template's dtypes and shardings (a
        concrete template array lends its sharding; a ``jax.ShapeDtypeStruct`` its own).

        Args:
          template_state: a pytree like the saved state, e.g. a freshly initialized one or
            ``jax.eval_shape`` of its constructor.
          step: restore exactly this step (no fallback); None tries the newest step first.

        Returns:
          A :class:`RestoreResult` ``(state, extra, step, skipped)``; ``skipped`` says why each
          newer step was rejected (they are logged at WARNING too).

        Raises:
          ValueError: ``step`` is not None or a non-negative integer.
          TypeError: a leaf of ``template_state`` is not an array.
          CheckpointError: no checkpoint passed (each step's reason is listed), or ``step``
            does not exist or did not pass.
        """
        if step is not None:
            step = _check_step(step)
        specs = _leaf_specs(template_state, "template_state", abstract_ok=True)
        abstract = jax.tree.map(_abstract, template_state)
        self._check_open()
        self.wait_until_finished()
        steps = self._step_dirs()
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; found steps {steps}")
        skipped: list[str] = []
        for candidate in [step] if step is not None else reversed(steps):
            try:
                verify_manifest(self.directory / str(candidate), candidate, specs)
                try:
                    restored = self._manager.restore(
                        candidate,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()
                        ),
                    )
                except Exception as e:
                    raise RejectedStep(f"orbax could not restore it: {type(e).__name__}: {e}") from e
            except RejectedStep as e:
                skipped.append(f"step {candidate}: {e}")
                logger.warning("skipping checkpoint %s/%d: %s", self.directory, candidate, e)
                continue
            return RestoreResult(restored.state, dict(restored.extra), candidate, tuple(skipped))
        interrupted = sorted(e.name for e in os.scandir(self.directory) if _TMP_SUFFIX in e.name)
        found = "; ".join(skipped) if skipped else "no finished checkpoints"
        if interrupted:
            found += f"; unfinished saves (ignored): {interrupted}"
        raise CheckpointError(f"no checkpoint in {self.directory} could be restored: {found}")

    def close(self) -> None:
        """Finishes pending saves and releases orbax's threads; safe to call twice."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._manager.close()
