"""Trials of two writers on one run directory and of signals during saves, in one process.

Run by tests/test_reliability_concurrency.py as ``python helpers/concurrency_worker.py MODE TRIALS SEED ROOT
CORPUS``; prints one JSON line: the outcome of every trial. Every trial ends with ``--resume`` run to
the last step, and its final checkpoint and ``metrics.jsonl`` are compared, bit for bit, with an
uninterrupted run of the same config (the reference), here, in the worker.

- ``writers``: two ``train`` calls on one ``--out`` (threads: ``flock`` locks belong to open file
  descriptions, so two threads conflict exactly as two processes do), the second started at a
  random offset, as a new run or as ``--resume``, both asked to stop at step 2.
- ``signals``: ``train`` in the main thread; at a random checkpoint save, a thread sends two or three
  SIGTERM/SIGINT (random mix) to this process at random times inside the save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import leanstep.checkpoints.checkpointer
import leanstep.training.curves
from leanstep.checkpoints.checkpointer import MANIFEST_NAME, Checkpointer
from leanstep.checkpoints.layout import committed_steps
from leanstep.compilation.cache import enable_compile_cache
from leanstep.training import RunConfig, RunStopped, build, train

STEPS = 4
TIMING = ("tokens_per_sec", "elapsed_s")


def config(root: Path, corpus: str, name: str, **fields: Any) -> RunConfig:
    return RunConfig(
        model="mlp",
        size="tiny",
        batch_size=4,
        seq_len=8,
        microbatches=2,
        steps=STEPS,
        eval_every=2,
        eval_batches=1,
        checkpoint_every=1,
        keep_checkpoints=2 * STEPS,
        progress=False,
        data=corpus,
        out=str(root / name),
        **fields,
    )


def final_bits(run: Path, cfg: RunConfig) -> tuple[list[bytes], list[dict[str, Any]]]:
    template = build.build_run(cfg).init_state()
    with Checkpointer(run / "checkpoints") as ckpt:
        restored = ckpt.restore(template, step=STEPS)
    leaves = [np.asarray(x).tobytes() for x in __import__("jax").tree.leaves(restored.state)]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return leaves, [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def every_step_has_its_manifest(run: Path) -> bool:
    directory = run / "checkpoints"
    return not directory.exists() or all(
        (directory / str(s) / MANIFEST_NAME).is_file() for s in committed_steps(directory)
    )


def writers(rng: random.Random, root: Path, corpus: str, trial: int) -> dict[str, Any]:
    name = f"writers-{trial}"
    second_resumes = rng.random() < 0.5
    offset = rng.uniform(0.0, 1.0)
    outcomes: list[str] = ["", ""]

    def write(index: int, delay: float, resume: bool) -> None:
        time.sleep(delay)
        try:
            train(config(root, corpus, name, stop_at=2), resume=resume)
            outcomes[index] = "finished"
        except RunStopped as stopped:
            outcomes[index] = f"stopped({stopped.exit_code})"
        except ValueError as error:
            text = str(error)
            kind = (
                "in use"
                if "is in use by another leanstep train (pid" in text
                # The holder took the lock and has not written its pid yet: refused all the same.
                else "in use, holder unnamed"
                if "is in use by another leanstep train (a process that has not said who it is yet)" in text
                else "holds a run"
                if "already holds a run" in text
                else "no run"
                if "holds no run" in text
                else f"refused: {text}"
            )
            outcomes[index] = kind
        except BaseException as error:  # noqa: BLE001 - reported, the test fails on it
            outcomes[index] = f"unexpected {type(error).__name__}: {error}"

    threads = [
        threading.Thread(target=write, args=(0, 0.0, False)),
        threading.Thread(target=write, args=(1, offset, second_resumes)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    consistent = every_step_has_its_manifest(root / name)
    train(config(root, corpus, name), resume=True)
    return {
        "offset": round(offset, 3),
        "second_resumes": second_resumes,
        "outcomes": outcomes,
        "consistent": consistent,
        "run": name,
    }


def signals(rng: random.Random, root: Path, corpus: str, trial: int) -> dict[str, Any]:
    name = f"signals-{trial}"
    at_save = rng.randint(1, STEPS - 1)
    kinds = [rng.choice((signal.SIGTERM, signal.SIGINT)) for _ in range(rng.choice((2, 3)))]
    delays = sorted(rng.uniform(0.0, 0.08) for _ in kinds)
    real_save, saves = Checkpointer.save, [0]

    def save(self: Checkpointer, step: int, state: Any, **kwargs: Any) -> None:
        saves[0] += 1
        if saves[0] != at_save:
            return real_save(self, step, state, **kwargs)

        def send() -> None:
            start = time.monotonic()
            for delay, sig in zip(delays, kinds):
                time.sleep(max(0.0, start + delay - time.monotonic()))
                os.kill(os.getpid(), sig)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            return real_save(self, step, state, **kwargs)
        finally:
            sender.join()  # every signal lands while the save is on (the trainer defers them)
            time.sleep(0.01)

    Checkpointer.save = save
    # The caller's handlers: train() delivers the signal that stopped it to them once it is saved.
    delivered: list[str] = []
    previous = {sig: signal.signal(sig, lambda s, f: delivered.append(signal.Signals(s).name)) for sig in set(kinds)}
    try:
        try:
            train(config(root, corpus, name))
            outcome = "finished"
        except RunStopped as stopped:
            outcome = f"stopped({stopped.exit_code}) {stopped}"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
    finally:
        Checkpointer.save = real_save
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    consistent = every_step_has_its_manifest(root / name)
    steps = committed_steps(root / name / "checkpoints")
    train(config(root, corpus, name), resume=True)
    return {
        "at_save": at_save,
        "signals": [signal.Signals(k).name for k in kinds],
        "delays": delays,
        "outcome": outcome,
        "delivered": delivered,
        "consistent": consistent,
        "committed": steps,
        "run": name,
    }


def main() -> None:
    enable_compile_cache()  # the suite's folder ($LEANSTEP_COMPILE_CACHE): every trial builds the same step
    mode, trials, seed, root, corpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    leanstep.training.curves.plot_curves = lambda *args, **kwargs: root / "no-chart.png"  # the chart is not tested here
    reference = config(root, corpus, f"reference-{mode}")
    train(reference)
    expected = final_bits(Path(reference.out), reference)
    rng = random.Random(seed)
    results = []
    for trial in range(trials):
        result = (writers if mode == "writers" else signals)(rng, root, corpus, trial)
        cfg = dataclasses.replace(reference, out=str(root / result["run"]))
        result["identical"] = final_bits(Path(cfg.out), cfg) == expected
        results.append(result)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
