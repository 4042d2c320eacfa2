"""``--data`` read on a thread, so that a new run whose corpus is slow to read compiles its step meanwhile.

On one TPU v5e, the sized default run (``--data @python``: 137 MB of source in 9,911 files) spent
7.8 s reading its corpus with the files in the page cache (walking the folders alone took 6.3 s
cold), and then 20.5 s compiling its step, one after the other, inside its 180-s budget. XLA
compiles without holding the GIL and reading files is mostly system calls, so the two overlap.

:func:`leanstep.training.train` starts a :class:`CorpusLoad` where it used to read the corpus, and
waits up to :data:`QUICK_S` for it. A corpus read by then (the standard library's default corpus
takes 0.04 s on the 2-core CPU) starts the run exactly as before. A slower one, for a new run of
one process into a directory that does not exist yet, lets the step and the evaluation compile
first (:func:`compile_early`); only then is the corpus waited for, its errors raised, and the run
directory made, so a run refused for its data still writes nothing. A resumed run compares its
data with the saved run's before anything else, so it waits for the corpus as before.

Measured on that TPU v5e, one machine, the compile cache off and the files in the page cache for
both: the run planned its steps at 37.9 s instead of 45.2 and took 943 steps instead of 890.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh

from leanstep.sharding.meshes import shard_batch
from leanstep.step.state import TrainState
from leanstep.step.train_step import JittedTrainStep
from leanstep.training.config import RunConfig
from leanstep.training.data import Corpus, load_corpus
from leanstep.training.step_loop import compile_eval, compile_program, in_background, place_eval_batch

__all__ = ["QUICK_S", "CorpusLoad", "EarlyStep", "compile_early"]

#: Seconds :func:`leanstep.training.train` waits for the corpus before it compiles the step meanwhile:
#: 25 times the default corpus's 0.04 s on an idle 2-core CPU, an eighth of the 7.8 s the TPU host took
#: to read ``@python`` from its page cache.
QUICK_S = 1.0


class CorpusLoad:
    """``load_corpus(data, seq_len=seq_len)`` and its ``describe()``, on a thread started now.

    Example:
      >>> loading = CorpusLoad(None, 16)  # the standard library's default corpus
      >>> corpus, described = loading.result()
      >>> described["split"], described["train_bytes"] == corpus.train.size > 0
      ('files', True)
    """

    def __init__(self, data: str | None, seq_len: int) -> None:
        self._outcome: tuple[Corpus, dict[str, Any]] | Exception | None = None
        # A daemon: a run stopped (a signal, an error) while the corpus is still being read does
        # not wait for it at exit. The thread only reads files and concatenates bytes: no XLA.
        self._thread = threading.Thread(target=self._load, args=(data, seq_len), name="leanstep-corpus", daemon=True)
        self._thread.start()

    def _load(self, data: str | None, seq_len: int) -> None:
        try:
            corpus = load_corpus(data, seq_len=seq_len)
            self._outcome = (corpus, corpus.describe())
        except Exception as error:  # noqa: BLE001 - raised again, in the caller's thread, by result()
            self._outcome = error

    def done_within(self, seconds: float) -> bool:
        """Whether the corpus is read (or failed) within ``seconds`` from now."""
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def result(self) -> tuple[Corpus, dict[str, Any]]:
        """The corpus and its description, once read; the error that reading it raised, if any."""
        self._thread.join()
        outcome = self._outcome
        if isinstance(outcome, Exception):
            raise outcome
        if outcome is None:  # the thread ended without a result (an exception that is not an Exception)
            raise RuntimeError(f"reading --data ended without a corpus or an error (thread {self._thread.name})")
        return outcome


class EarlyStep(NamedTuple):
    """A step compiled before the corpus was read: what :func:`leanstep.training.train` then uses."""

    template: TrainState  # the initial state, placed (the step was compiled for it)
    step_fn: JittedTrainStep  # the step, its executable in ``jit``'s cache
    eval_fn: Any  # the evaluation, compiled (on a thread) for a held-out batch of the usual shape
    compiled: dict[str, Any]  # compile_program's record, for config.json and the budget's plan


def compile_early(
    template: TrainState, step_fn: JittedTrainStep, eval_fn: Any, config: RunConfig, mesh: Mesh | None
) -> EarlyStep:
    """``step_fn`` compiled for ``template`` and a batch of the run's shape, placed as the run's batches
    are; ``eval_fn`` compiled beside it, on a thread (:func:`leanstep.training.step_loop.in_background`).

    The stand-in batch has the shape, dtype and placement of :meth:`BatchSampler.batch_at`'s, so the
    run's first step finds this executable in ``jit``'s cache. The evaluation's stand-in is a full
    held-out batch (``batch_size`` rows, placed as :func:`leanstep.training.step_loop.place_eval_batch`
    places one): a held-out part shorter than one batch makes a smaller one, compiled when the
    evaluation warms up, as it would have been.
    """
    batch = {"tokens": np.zeros((config.batch_size, config.seq_len + 1), np.int32)}
    held_out = batch if mesh is None else place_eval_batch(batch, mesh)
    in_background(functools.partial(compile_eval, eval_fn, template.params, held_out, mesh))  # joined at exit
    placed = batch if mesh is None else shard_batch(batch, mesh)
    return EarlyStep(template, step_fn, eval_fn, compile_program(step_fn, template, placed))
