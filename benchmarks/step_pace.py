"""leanstep's train step against the PyTorch peer's, side by side in one process.

The speedrun (:mod:`leanstep.bench.speedrun`) runs its two contenders one after the other, so a
machine whose speed drifts between them (a shared one does) moves the comparison. This runs
the two steps in turn, ``steps`` of one then ``steps`` of the other for ``rounds`` rounds,
from the same initial weights on the same batches, and reports each one's step times: both
see the same drift. It alternates in blocks, not call by call as
:func:`leanstep.bench.time_interleaved` does, because switching frameworks after every step
slows both (on the 2-core Xeon, one step each in turn took 45.0-47.4 ms and 34.5-35.8 ms
against 41.6-43.1 ms and 31.2-32.5 ms in blocks of 8): a training loop runs one framework's
steps back to back.

leanstep's step is the run's (:meth:`leanstep.training.build.Run.make_step`: loss scale,
microbatches, clipping, remat, the guarded AdamW update); the peer's is the speedrun peer's
(:func:`leanstep.bench.torch_step.make_torch_step`: microbatches by ``chunk``, ``clip_grad_norm_``,
fused AdamW), in float32. Each step is timed to its result on the host: leanstep's metrics
fetched, PyTorch's loss read.

.. code-block:: bash

    python -m benchmarks.step_pace               # the default run's step, 12 rounds of 8
    python -m benchmarks.step_pace --rounds 3 --size small --batch-size 16 --seq-len 128
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from typing import Any

import jax
import numpy as np

from leanstep.training.build import build_run
from leanstep.training.config import RunConfig
from leanstep.training.data import BatchSampler, load_corpus

__all__ = ["step_pace"]


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(times) * 1e3,
        "mean_ms": float(np.mean(times)) * 1e3,
        "p25_ms": float(np.percentile(times, 25)) * 1e3,
    }


def step_pace(config: RunConfig | None = None, *, rounds: int = 12, steps: int = 8) -> dict[str, Any]:
    """Step times of leanstep's train step and the PyTorch peer's, run in turn (see the module doc).

    Args:
      config: the run whose step is timed (default: ``RunConfig()``, what ``leanstep train``
        runs); its precision is float32 for both (the peer's only CPU dtype without bf16 units).
      rounds: rounds of ``steps`` steps of each.
      steps: steps of one before the other's.

    Returns:
      ``{"leanstep": {...}, "pytorch": {...}, "rounds", "steps"}``, each contender's
      ``median_ms``, ``mean_ms`` and ``p25_ms`` over its ``rounds * steps`` timed steps, and
      ``first_loss``: the loss of its untimed first step (which compiles), the same batch from
      the same weights for both.

    Raises:
      ValueError: ``rounds`` or ``steps`` below 1, an invalid config, or a model other than the
        transformer.
      ModuleNotFoundError: torch is not installed (it is the benchmark extra).
    """
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds={rounds}, steps={steps}: each must be at least 1")
    import torch

    from leanstep.bench.torch_step import (
        build_torch_model,
        load_jax_params,
        make_torch_step,
    )

    base = RunConfig() if config is None else config
    config = dataclasses.replace(base, steps=1, time_budget=None, precision="float32").validate()
    if config.model != "transformer":
        raise ValueError(f"--model {config.model}: the PyTorch peer is leanstep's transformer only")
    run = build_run(config)
    config = run.config  # --size auto resolved (on an accelerator: the machine's model, batch and data)
    sampler = BatchSampler(
        load_corpus(config.data, seq_len=config.seq_len).train, config.batch_size, config.seq_len, config.seed
    )
    step, state = run.make_step(), run.init_state()
    model = build_torch_model(run.model.config, remat=config.remat == "full", seed=config.seed)
    load_jax_params(model, jax.device_get(state.params))
    peer_step, _ = make_torch_step(
        model,
        bfloat16=False,
        num_microbatches=config.microbatches,
        max_grad_norm=math.inf if config.max_grad_norm is None else config.max_grad_norm,
        lr=config.lr,
        weight_decay=config.weight_decay,
    )

    def leanstep_step(index: int) -> float:
        nonlocal state
        state, metrics = step(state, sampler.batch_at(index))
        return float(jax.device_get(metrics).loss)

    def torch_step(index: int) -> float:
        return peer_step(torch.from_numpy(sampler.batch_at(index)["tokens"]).long())

    # One untimed step each (it compiles), on the same batch from the same weights: the same loss.
    first = {"leanstep": leanstep_step(0), "pytorch": torch_step(0)}
    times: dict[str, list[float]] = {"leanstep": [], "pytorch": []}
    for r in range(rounds):
        for name, one in (("leanstep", leanstep_step), ("pytorch", torch_step)):
            for i in range(steps):
                began = time.perf_counter()
                one(1 + r * steps + i)
                times[name].append(time.perf_counter() - began)
    return {name: {**_summary(seconds), "first_loss": first[name]} for name, seconds in times.items()} | {
        "rounds": rounds,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_pace", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", default="mini")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)
    result = step_pace(
        RunConfig(size=args.size, batch_size=args.batch_size, seq_len=args.seq_len),
        rounds=args.rounds,
        steps=args.steps,
    )
    for name in ("leanstep", "pytorch"):
        row = result[name]
        print(
            f"{name:9s} median {row['median_ms']:6.1f} ms   mean {row['mean_ms']:6.1f} ms   "
            f"p25 {row['p25_ms']:6.1f} ms   ({args.rounds} rounds of {args.steps} steps, in turn)"
        )


if __name__ == "__main__":
    main()
