r"""Quality of lean optimizer state on the byte-level LM: 8-bit moments and bfloat16 masters.

``leanstep train``'s default transformer and data, one loop for every state format (the step,
the schedule, the batches of step ``t`` and the held-out set exactly as ``leanstep train`` makes
them), trained for ``--steps`` and evaluated on the held-out bytes at the end:

.. code-block:: text

    float32           float32 masters, float32 AdamW moments      (the reference)
    int8 moments      float32 masters, 8-bit block moments         (compress_moments)
    bf16-sr masters   bfloat16 masters, stochastic rounding        (float32 moments)
    bf16-sr + int8    both: 4 bytes a parameter
    bf16-nearest      bfloat16 masters rounded to nearest: the control (test-only path;
                      TrainState.create refuses it otherwise)

Run it from the repository root as ``python -m benchmarks.lean_state --steps 1500 --seeds 0 1 2``
(``--json F`` writes the result); docs/lean-state.md has the measured table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

import jax
import numpy as np

from leanstep.blocks.masters import ROUND_TO_NEAREST_CONTROL
from leanstep.step.state import TrainState
from leanstep.training import RunConfig, build_run
from leanstep.training.data import BatchSampler, heldout_batches, load_corpus

__all__ = ["FORMATS", "main", "train_one"]

#: name -> (master, moments).
FORMATS: dict[str, tuple[Any, str]] = {
    "float32": ("float32", "float32"),
    "int8 moments": ("float32", "int8"),
    "bf16-sr masters": ("bfloat16-sr", "float32"),
    "bf16-sr + int8": ("bfloat16-sr", "int8"),
    "bf16-nearest (control)": (ROUND_TO_NEAREST_CONTROL, "float32"),
}


def train_one(config: RunConfig, master: Any, moments: str) -> dict[str, Any]:
    """Trains ``config`` with its state kept as ``master`` / ``moments``; returns its held-out loss.

    Example:
      >>> config = RunConfig(size="tiny", batch_size=4, seq_len=8, steps=3, eval_batches=1)
      >>> sorted(train_one(config, "bfloat16-sr", "int8"))
      ['heldout_bits_per_byte', 'seconds', 'train_loss']
    """
    run = build_run(config)
    config = run.config  # --size and --precision auto resolved
    state = TrainState.create(run.init_params(), run.optimizer, run.step.replace(master=master, moments=moments),
                              seed=config.seed)  # fmt: skip
    corpus = load_corpus(config.data, seq_len=config.seq_len)
    sampler = BatchSampler(corpus.train, config.batch_size, config.seq_len, config.seed)
    step = run.make_step()
    start, losses = time.perf_counter(), []
    for t in range(config.steps or 0):
        state, metrics = step(state, sampler.batch_at(t))
        losses.append(metrics.loss)
    evaluate = jax.jit(lambda params, batch: run.model.loss(run.precision.cast_to_compute(params), batch))
    held = heldout_batches(corpus.heldout, config.batch_size, config.seq_len, config.eval_batches)
    loss = float(np.mean([float(evaluate(state.params, b)) for b in held]))
    return {
        "heldout_bits_per_byte": loss / math.log(2),
        "train_loss": float(np.mean([float(x) for x in losses[-50:]])),
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lean_state", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--lr", type=float, default=RunConfig.lr, help="peak learning rate (leanstep train's --lr)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    base = RunConfig(steps=args.steps, time_budget=None, lr=args.lr)
    rows: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        for name in args.formats:
            master, moments = FORMATS[name]
            result = train_one(dataclasses.replace(base, seed=seed), master, moments)
            rows.setdefault(name, {})[str(seed)] = result
            print(f"seed {seed}  {name:24s} {result['heldout_bits_per_byte']:.4f} bits/byte  {result['seconds']:.0f} s")
            if args.json:
                with open(args.json, "w", encoding="utf-8") as file:
                    json.dump(rows, file, indent=2)
    reference = rows.get("float32", {})
    for name, by_seed in rows.items():
        gaps = [
            r["heldout_bits_per_byte"] - reference[s]["heldout_bits_per_byte"]
            for s, r in by_seed.items()
            if s in reference
        ]
        mean = np.mean([r["heldout_bits_per_byte"] for r in by_seed.values()])
        print(
            f"{name:24s} mean {mean:.4f}  gap to float32: mean {np.mean(gaps):+.4f}, largest {max(gaps, key=abs):+.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
