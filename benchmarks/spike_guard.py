r"""What the spike guard costs a step: ``leanstep train``'s default step with and without it.

.. code-block:: text

    the default run's step (transformer mini, batch 64 x 32, 2 microbatches), two states:
        without            TrainState.create(...)                     make_train_step(...)
        with               TrainState.create(..., spike_guard=on)     make_train_step(..., spike_guard=on)
    timed round-robin (leanstep.bench.timing.time_interleaved), best of --rounds rounds
    ratio = median(with) / median(without)

Both steps get the same batches; the guard's window fills as they run. Run it from the repository
root as ``python -m benchmarks.spike_guard`` (``--json F`` writes the result).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from typing import Any

import jax

from benchmarks import print_result
from leanstep.bench.timing import time_interleaved
from leanstep.training import RunConfig, build_run
from leanstep.training.data import BatchSampler, load_corpus

__all__ = ["main", "measure"]


def measure(config: RunConfig, *, repeats: int = 40, rounds: int = 3) -> dict[str, Any]:
    """Median milliseconds a step with and without the guard, and their ratio (best round).

    Example:
      >>> result = measure(RunConfig(size="tiny", batch_size=4, seq_len=8, steps=2), repeats=2, rounds=1)
      >>> sorted(result)
      ['ratio', 'spikes', 'step_ms']
    """
    config = build_run(config).config  # --size and --precision auto resolved, as the run resolves them
    corpus = load_corpus(config.data, seq_len=config.seq_len)
    sampler = BatchSampler(corpus.train, config.batch_size, config.seq_len, config.seed)
    calls: dict[str, Any] = {}
    holders: dict[str, dict[str, Any]] = {}
    for name, guard in (("without", "none"), ("with", "on")):
        run = build_run(dataclasses.replace(config, spike_guard=guard))
        step, holder = run.make_step(), {"state": run.init_state(), "t": 0}

        def call(step: Any = step, holder: dict = holder) -> None:
            holder["state"], metrics = step(holder["state"], sampler.batch_at(holder["t"]))
            holder["t"] += 1
            jax.block_until_ready(metrics.loss)

        calls[name], holders[name] = call, holder
    medians: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, seconds in time_interleaved(calls, repeats=repeats, warmup=2).items():
            medians[name].append(1e3 * statistics.median(seconds))
    ms = {name: min(values) for name, values in medians.items()}
    spikes = int(holders["with"]["state"].spike.spikes)
    return {"step_ms": ms, "ratio": ms["with"] / ms["without"], "spikes": spikes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spike_guard", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(RunConfig(steps=1000), repeats=args.repeats, rounds=args.rounds)
    return print_result(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
