"""Checkpoints of the whole train state: orbax writes them, a checksum manifest vouches for them.

Layout of a checkpoint directory (:mod:`leanstep.checkpoints.layout`)::

    <directory>/<step>/state/...                  the state pytree (orbax, OCDBT)
    <directory>/<step>/extra/metadata             the ``extra`` dict (orbax, JSON)
    <directory>/<step>/leanstep_manifest.json     size + sha256 of every other file
    <directory>/.staging/<step>/                  a save in progress (or interrupted)

Orbax writes a step under ``.staging``; the manifest (:mod:`leanstep.checkpoints.manifest`) is
written there last, and only then is the step renamed to its final name. A step and its
manifest are committed as one: a directory ``<step>`` without its manifest never exists, an
interrupted save is never listed, and a step whose files do not match its manifest is never
restored (:meth:`Checkpointer.restore` falls back to the newest step that passes). Old steps
are deleted only after the newer step is committed, and are renamed away before they are removed.
Zero-size leaves hold no data; orbax refuses them, so they are saved as a placeholder and
restored from the template's shape and dtype (the manifest records their true shape).

Size: one class; a step's states (staging, committed, failed, pruned) are read and changed
together. The layout, the manifest and the tree helpers are modules of their own.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from leanstep.checkpoints.errors import CheckpointError, write_failure
from leanstep.checkpoints.layout import (
    STAGING,
    commit_step,
    committed_steps,
    retire_step,
    staging_path,
    unfinished_saves,
)
from leanstep.checkpoints.manifest import (
    MANIFEST_NAME,
    RejectedStep,
    verify_manifest,
    write_manifest,
)
from leanstep.checkpoints.trees import (
    abstract_leaf,
    check_json,
    check_step,
    leaf_specs,
    with_placeholders,
    zero_size_from_template,
)
from leanstep.common.checks import is_int

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["MANIFEST_NAME", "CheckpointError", "Checkpointer", "RestoreResult"]

logger = logging.getLogger(__name__)


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


class Checkpointer:
    """Saves and restores a train-state pytree plus a JSON dict, keeping the newest ``max_to_keep``.

    Pseudocode of the guarantees::

        save(s):    wait for the save in flight (and commit it);
                    refuse if a step >= s exists; orbax writes .staging/<s>
                    (in the background with wait=False: the arrays are on the host first);
                    write .staging/<s>/manifest (sha256 of every file), fsync;
                    rename .staging/<s> to <s> (the commit), fsync the directory;
                    delete steps older than the newest max_to_keep (renamed away, then removed)
                    (with wait=False these three at the first poll() after orbax's write,
                    or at the next save, wait_until_finished, restore or close)
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
        self._failed: list[int] = []  # steps whose save failed: their staging goes again at close
        self._closed = False
        # Set by orbax's background thread once the save in flight is written and finalized
        # (its files are all there; orbax then only renames its temporary folder).
        self._written = threading.Event()
        # Orbax writes each step into staging; committing, pruning and listing are ours.
        self._orbax = ocp.AsyncCheckpointer(
            ocp.CompositeCheckpointHandler(),
            async_options=ocp.AsyncOptions(post_finalization_callback=self._written.set),
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer for {self.directory} is closed")

    def _step_dirs(self) -> list[int]:
        """Finalized step directories on disk (orbax's own step naming: the bare number)."""
        try:
            return committed_steps(self.directory)
        except OSError as e:
            raise CheckpointError(f"cannot list checkpoint directory {self.directory}: {e}") from e

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (their checksums are verified on restore)."""
        return self._step_dirs()

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
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
            afterwards); orbax writes the step in the background, and the manifest and the
            commit follow at the first :meth:`poll` after the write, or at the next ``save``,
            ``wait_until_finished``, ``restore`` or ``close``.

        Raises:
          ValueError: ``step`` is not a non-negative integer.
          TypeError: a leaf of ``state`` is not a concrete array, or ``extra`` is not
            JSON-compatible.
          CheckpointError: a step >= ``step`` already exists (delete it first, e.g. with
            :meth:`delete_newer_than` after resuming from an older step), or writing failed
            (earlier checkpoints are untouched).
        """
        step = check_step(step)
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
        check_json(extra, "extra")
        specs = leaf_specs(state, "state", abstract_ok=False)
        self._check_open()
        self.wait_until_finished()
        clashing = [s for s in self._step_dirs() if s >= step]
        if clashing:
            raise CheckpointError(
                f"cannot save step {step} to {self.directory}: it already holds step(s) {clashing}; "
                "steps must increase (after resuming from an older step, remove the newer ones "
                "with delete_newer_than)"
            )
        args = ocp.args.Composite(state=ocp.args.StandardSave(with_placeholders(state)), extra=ocp.args.JsonSave(extra))
        self._written.clear()
        try:
            self._orbax.save(staging_path(self.directory, step), args=args, force=True)
        except Exception as e:
            raise CheckpointError(f"saving step {step} to {self.directory} failed: {write_failure(e)}") from e
        self._pending.append((step, specs))
        if wait:
            self.wait_until_finished()

    def saving(self) -> list[int]:
        """The steps saved with ``wait=False`` and not committed yet (at most one: a save waits for the last)."""
        return [step for step, _ in self._pending]

    def poll(self) -> list[int]:
        """Commits the save in flight if orbax has written it; never waits for a write.

        Call it between steps of a loop that saves with ``wait=False``: a write that finished is
        committed now (its manifest, the rename, pruning; milliseconds), not at the next save,
        and one that failed is reported now. Single-process only: in a multi-process run the
        processes must commit at the same point of the program (use :meth:`wait_until_finished`).

        Returns:
          The steps committed by this call (empty while the write goes on).

        Raises:
          CheckpointError: the save in flight failed (earlier checkpoints are untouched).
        """
        if self._closed or not self._pending:
            return []
        try:
            self._orbax.check_for_errors()  # the background thread's failure, once it has one
        except Exception as e:
            pending, self._pending = self._pending, []
            self._orbax.wait_until_finished()  # the failed thread has ended: this joins it
            raise self._failed_save(pending, e) from e
        if not self._written.is_set():
            return []
        steps = self.saving()
        self.wait_until_finished()
        return steps

    def _failed_save(self, pending: list[tuple[int, list[list[Any]]]], error: Exception) -> CheckpointError:
        """The error for failed pending saves, once what they left in staging is gone."""
        steps = [s for s, _ in pending]
        self._failed += steps
        if jax.process_index() == 0:  # what the failed writes left in staging goes now
            for step in steps:
                staging_path(self.directory, step)  # removes what is there for the step
        return CheckpointError(f"saving step(s) {steps} to {self.directory} failed: {write_failure(error)}")

    def wait_until_finished(self) -> None:
        """Blocks until pending saves are written, then writes their manifests and prunes old steps.

        Raises:
          CheckpointError: a pending save failed (earlier checkpoints are untouched).
        """
        if self._closed:
            return
        pending, self._pending = self._pending, []
        try:
            self._orbax.wait_until_finished()
        except Exception as e:
            raise self._failed_save(pending, e) from e
        # Multi-process: every process saves its own shards (orbax), but the manifest and the
        # commit have one writer, process 0; the others wait for it so that none prunes or
        # restores early.
        for step, specs in pending:
            staged = self.directory / STAGING / str(step)
            try:
                if jax.process_index() == 0:
                    write_manifest(staged, step, specs)
                    commit_step(self.directory, step)
            except OSError as e:  # the step stays in staging, so it is never listed or restored
                raise CheckpointError(f"committing step {step} in {self.directory} failed: {e}") from e
        if pending:
            self._sync(f"commit {pending[-1][0]}")
            self._prune()

    def _sync(self, what: str) -> None:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"leanstep {what} {self.directory}")

    def _prune(self) -> None:
        steps = self._step_dirs()
        # Steps with a manifest count (a step of leanstep < 0.5 may lack one after a crash).
        verified = [s for s in steps if (self.directory / str(s) / MANIFEST_NAME).is_file()]
        if len(verified) > self.max_to_keep:
            for step in [s for s in steps if s < verified[-self.max_to_keep]]:
                self._delete(step)

    def _delete(self, step: int) -> None:
        if jax.process_index() == 0:
            try:
                retire_step(self.directory, step)
            except OSError as e:
                raise CheckpointError(f"deleting step {step} from {self.directory} failed: {e}") from e

    def delete_newer_than(self, step: int) -> list[int]:
        """Deletes every step after ``step`` (a run resumed from ``step`` abandons them).

        Returns:
          The deleted steps, ascending.

        Raises:
          ValueError: ``step`` is not a non-negative integer.
        """
        step = check_step(step)
        self._check_open()
        self.wait_until_finished()
        newer = [s for s in self._step_dirs() if s > step]
        for s in newer:
            self._delete(s)
        if newer:
            self._sync(f"deleted after {step}")
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
            step = check_step(step)
        specs = leaf_specs(template_state, "template_state", abstract_ok=True)
        abstract = jax.tree.map(abstract_leaf, template_state)
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
                    restored = self._orbax.restore(
                        self.directory / str(candidate),
                        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()),
                    )
                except Exception as e:
                    raise RejectedStep(f"orbax could not restore it: {type(e).__name__}: {e}") from e
            except RejectedStep as e:
                skipped.append(f"step {candidate}: {e}")
                logger.warning("skipping checkpoint %s/%d: %s", self.directory, candidate, e)
                continue
            state = zero_size_from_template(template_state, restored.state)
            return RestoreResult(state, dict(restored.extra), candidate, tuple(skipped))
        interrupted = unfinished_saves(self.directory)
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
            self._orbax.close()
            # Orbax's writer threads may still create a failed step's temporary folder after the
            # failure is raised (seen under load); with the threads joined, it goes for good.
            if jax.process_index() == 0:
                for step in self._failed:
                    staging_path(self.directory, step)
