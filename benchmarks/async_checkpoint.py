r"""What a checkpoint costs the step loop: a synchronous save against orbax writing in the background.

.. code-block:: text

    the state of leanstep train's default run (TrainState after init: params, AdamW, loss scale),
    one Checkpointer, saves alternating (--rounds of each):
        synchronous    save(step, state)                      the loop waits for the write, the
                                                              manifest and the commit
        background     save(step, state, wait=False)          blocks: the previous write's wait
                       ... the write goes on, as steps do ... (done by then) and the copy to host
                       poll() once written                    blocks: the manifest and the commit
    blocking per background save = save(wait=False) + the poll that commits it
    ratio = median(blocking) / median(synchronous)

The issue's bound: the blocking part at most 10% of a synchronous save, or 50 ms, whichever is
larger. Run it from the repository root as ``python -m benchmarks.async_checkpoint`` (``--json F``
writes the result; ``--dir D`` puts the checkpoints on D's disk, default a temporary folder).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import jax

from benchmarks import print_result
from leanstep.checkpoints import Checkpointer
from leanstep.training import RunConfig, build_run

__all__ = ["main", "measure"]


def measure(config: RunConfig, directory: str, *, rounds: int = 5) -> dict[str, Any]:
    """Median milliseconds of a synchronous save and of a background save's blocking parts.

    Example:
      >>> import tempfile
      >>> result = measure(RunConfig(size="tiny", batch_size=4, seq_len=8, steps=2), tempfile.mkdtemp(), rounds=1)
      >>> sorted(result)
      ['background_blocking_ms', 'background_commit_ms', 'background_save_ms', 'bound_ms', 'ratio', 'state_mb', 'synchronous_ms']
    """
    state = build_run(config).init_state()
    jax.block_until_ready(state)
    state_mb = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20
    times: dict[str, list[float]] = {"synchronous": [], "save": [], "commit": []}
    with Checkpointer(directory, max_to_keep=2) as checkpointer:
        step = 0
        checkpointer.save(step, state)  # orbax's first save sets things up: not timed
        for _ in range(rounds):
            step += 1
            start = time.perf_counter()
            checkpointer.save(step, state)
            times["synchronous"].append(time.perf_counter() - start)

            step += 1
            start = time.perf_counter()
            checkpointer.save(step, state, wait=False)
            times["save"].append(time.perf_counter() - start)
            while True:  # the loop's steps run meanwhile; each polls, which costs nothing until written
                start = time.perf_counter()
                committed = checkpointer.poll()
                if committed:
                    times["commit"].append(time.perf_counter() - start)
                    break
                time.sleep(0.002)
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    blocking = 1e3 * statistics.median(s + c for s, c in zip(times["save"], times["commit"]))
    return {
        "state_mb": state_mb,
        "synchronous_ms": ms["synchronous"],
        "background_save_ms": ms["save"],
        "background_commit_ms": ms["commit"],
        "background_blocking_ms": blocking,
        "ratio": blocking / ms["synchronous"],
        "bound_ms": max(0.1 * ms["synchronous"], 50.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        result = measure(RunConfig(steps=1000), directory, rounds=args.rounds)
    return print_result(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
