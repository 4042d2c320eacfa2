r"""Recovery from a burst of bad batches: rollback against skip-only and no guard, on the byte-LM.

``leanstep train``'s default run (the byte-level transformer and data, its schedule planned for
``--steps``), with a burst of corrupted but finite batches at data positions ``--burst`` (16
moderately bad steps: every byte of a sequence shifted by its own random offset, mod 256 -- the
text's structure with the wrong bytes), then trained to ``--after`` steps after the burst (200: the
schedule's end) and evaluated there. The evaluation is at the end of the schedule because
mid-schedule a run's held-out loss moves by about 0.02 bits per byte from perturbations at the
last bit: the same run with the guard compiled in but never triggering (``k=1000``) ends step 900
0.018 from the run without it (seed 0); docs/reliability.md has the table at step 1,500.

.. code-block:: text

    clean        no burst, no guard                                     the reference
    no guard     the burst, applied
    skip-only    the burst, --spike-guard k=6,window=100,warmup=100       MaxText's / OLMo-core's rule
    rollback     the burst, the same guard, --spike-rollback on           (after=3,within=50,lr=0.5,for=100)

Each arm is a real ``leanstep.training.train`` run (checkpoints every 100 steps, the rollback
restoring one); the corrupted batches come from a wrapped ``BatchSampler.batch_at``, so a skipped
position is never taken. Run it from the repository root as ``python -m benchmarks.spike_recovery
--seeds 0 1 2`` (``--json F`` writes the result; each finished run is printed as it ends).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import print_result
from leanstep.training import RunConfig, RunStopped, train
from leanstep.training.data import BatchSampler
from leanstep.training.rollback import read_rollbacks

__all__ = ["ARMS", "main", "run_arm"]

#: arm -> (burst injected, --spike-guard, --spike-rollback)
ARMS: dict[str, tuple[bool, str, str]] = {
    "clean": (False, "none", "none"),
    "no guard": (True, "none", "none"),
    "skip-only": (True, "on", "none"),
    "rollback": (True, "on", "on"),
}


@contextlib.contextmanager
def corrupted(positions: range, seed: int) -> Iterator[None]:
    """Batches at ``positions`` with each sequence's bytes shifted by its own offset (mod 256)."""
    real = BatchSampler.batch_at

    def batch_at(self: BatchSampler, step: int) -> dict[str, np.ndarray]:  # step: the data position
        batch = real(self, step)
        if step not in positions:
            return batch
        rng = np.random.default_rng([seed, step, 7])
        offsets = rng.integers(1, 256, size=(batch["tokens"].shape[0], 1))
        return {"tokens": ((batch["tokens"] + offsets) % 256).astype(batch["tokens"].dtype)}

    BatchSampler.batch_at = batch_at  # type: ignore[method-assign]
    try:
        yield
    finally:
        BatchSampler.batch_at = real  # type: ignore[method-assign]


def run_arm(arm: str, config: RunConfig, burst: range, until: int) -> dict[str, Any]:
    """One arm's run to step ``until``; its held-out bits per byte there, its spikes and rollbacks.

    Example:
      >>> import tempfile
      >>> config = RunConfig(size="tiny", batch_size=4, seq_len=8, steps=20, eval_batches=1,
      ...     eval_every=10, checkpoint_every=5, progress=False, out=tempfile.mkdtemp())
      >>> result = run_arm("rollback", config, range(12, 14), until=20)
      >>> sorted(result)
      ['heldout_bits_per_byte', 'rollbacks', 'seconds', 'spiked_steps']
    """
    injected, guard, rollback = ARMS[arm]
    config = dataclasses.replace(config, spike_guard=guard, spike_rollback=rollback, stop_at=until)
    start = time.perf_counter()
    with corrupted(burst if injected else range(0), config.seed):
        try:
            train(config)
        except RunStopped as stopped:  # --stop-at: exit code 0, the step saved
            if stopped.exit_code != 0:
                raise
    seconds = time.perf_counter() - start
    lines = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
    evals = {line["step"]: line["heldout_bits_per_byte"] for line in lines if line["kind"] == "eval"}
    abandoned = Path(config.out) / "rolled_back.jsonl"
    spiked = [line["step"] for line in lines if line.get("spiked")]
    if abandoned.exists():
        spiked += [json.loads(line)["step"] for line in abandoned.read_text().splitlines() if '"spiked": true' in line]
    return {
        "heldout_bits_per_byte": evals[until],
        "spiked_steps": sorted(spiked),
        "rollbacks": [r.to_json() for r in read_rollbacks(Path(config.out))],
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spike_recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500, help="the schedule's length")
    parser.add_argument("--burst", type=int, nargs=2, default=[1284, 1300], help="first and end data position")
    parser.add_argument("--after", type=int, default=200, help="steps after the burst to evaluate at")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    burst = range(args.burst[0], args.burst[1])
    until = burst.stop + args.after
    results: dict[str, dict[int, Any]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            with tempfile.TemporaryDirectory() as out:
                config = RunConfig(
                    steps=args.steps, seed=seed, eval_every=100, checkpoint_every=100, progress=False, out=out
                )
                results[arm][seed] = run_arm(arm, config, burst, until)
            print(json.dumps({"arm": arm, "seed": seed, **results[arm][seed]}), flush=True)
    clean = results.get("clean", {})
    table = {
        arm: {
            "bits_per_byte": {seed: r["heldout_bits_per_byte"] for seed, r in by_seed.items()},
            "mean": statistics.mean(r["heldout_bits_per_byte"] for r in by_seed.values()),
            "largest_gap_to_clean": max(
                (
                    r["heldout_bits_per_byte"] - clean[s]["heldout_bits_per_byte"]
                    for s, r in by_seed.items()
                    if s in clean
                ),
                default=None,
            ),
        }
        for arm, by_seed in results.items()
    }
    return print_result(
        {"burst": [burst.start, burst.stop], "evaluated_at": until, "arms": table, "runs": results}, args.json, indent=1
    )


if __name__ == "__main__":
    sys.exit(main())
