"""What the microbatch loop costs a convolutional network: ``python -m benchmarks.cnn``.

The Flax NNX CNN of the framework's MNIST tutorial, with BatchNorm and Dropout, on random
28x28 images, float32, timed interleaved (A B C A B C ...) against its own training loop
(``nnx.Optimizer``, ``nnx.value_and_grad``, ``nnx.jit``): leanstep's step with one microbatch
(no loop), with four microbatches in a ``lax.scan`` and with the four unrolled
(``unroll=True``), each with its compiled temporary memory. XLA:CPU runs a convolution inside
a loop several times slower than outside one (jax-ml/jax#12868), which is the cost measured
here. Needs flax (``pip install -e ".[test]"``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from leanstep.bench.timing import summarize_times, time_interleaved
from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.loss_contract import LossContract
from leanstep.frameworks import nnx as leanstep_nnx
from leanstep.step.spec import StepSpec
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step

__all__ = ["CNN", "run_cnn_benchmark"]


class CNN(nnx.Module):
    """The Flax NNX MNIST tutorial's CNN, with BatchNorm after each convolution and Dropout."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        pool = lambda h: nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.bn1(self.conv1(x))))
        x = pool(nnx.relu(self.bn2(self.conv2(x))))
        x = self.dropout(x.reshape(x.shape[0], -1))
        return self.linear2(nnx.relu(self.linear1(x)))


def _loss(model: CNN, batch: dict[str, jax.Array]) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def _own_loop(batch: dict[str, jax.Array], tx: optax.GradientTransformation) -> tuple[Callable[[], Any], int | None]:
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model: CNN, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    jax.block_until_ready(train_step(model, optimizer, batch))
    return lambda: jax.block_until_ready(train_step(model, optimizer, batch)), None


def _leanstep(
    batch: dict[str, jax.Array], tx: optax.GradientTransformation, accumulation: Accumulation | None = None
) -> tuple[Callable[[], Any], int | None]:
    graphdef, params, model_state = leanstep_nnx.split(CNN(rngs=nnx.Rngs(0)))
    spec = StepSpec(loss=LossContract(has_state=True), accumulation=accumulation or Accumulation())
    state = TrainState.create(params, tx, spec, model_state=model_state)
    compiled = make_train_step(leanstep_nnx.loss(graphdef, _loss), spec).lower(state, batch).compile()
    holder = [state]

    def step() -> None:
        holder[0], metrics = compiled(holder[0], batch)
        jax.block_until_ready(metrics.loss)

    step()
    memory = compiled.memory_analysis()
    if memory is None:  # JAX allows it; the table's temporaries come from it
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis of the compiled step")
    return step, memory.temp_size_in_bytes


def run_cnn_benchmark(*, batch_size: int = 32, repeats: int = 15, microbatches: int = 4) -> dict[str, Any]:
    """Times the CNN's own loop and leanstep's step (see the module doc); returns the numbers.

    Returns:
      ``{"rows": {name: {"step_ms_median", "step_ms_min", ..., "temp_mib"}}, "ratios":
      {name: median / own loop's median}, "config", "backend"}``.
    """
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(batch_size, 28, 28, 1)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32),
    }
    tx = optax.adamw(1e-3)
    contenders = {
        "own loop (nnx.Optimizer)": _own_loop(batch, tx),
        "leanstep, 1 microbatch": _leanstep(batch, tx),
        f"leanstep, {microbatches} microbatches (scan)": _leanstep(batch, tx, Accumulation(microbatches)),
        f"leanstep, {microbatches} microbatches (unroll=True)": _leanstep(
            batch, tx, Accumulation(microbatches, unroll=True)
        ),
    }
    times = time_interleaved({name: run for name, (run, _) in contenders.items()}, repeats=repeats)
    rows: dict[str, dict[str, Any]] = {
        name: {**summarize_times(times[name]), "temp_mib": None if temp is None else temp / 2**20}
        for name, (_, temp) in contenders.items()
    }
    base = rows["own loop (nnx.Optimizer)"]["step_ms_median"]
    return {
        "rows": rows,
        "ratios": {name: row["step_ms_median"] / base for name, row in rows.items()},
        "config": {"batch_size": batch_size, "repeats": repeats, "microbatches": microbatches, "dtype": "float32"},
        "backend": jax.default_backend(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cnn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = run_cnn_benchmark(repeats=args.repeats)
    for name, row in result["rows"].items():
        temp = "-" if row["temp_mib"] is None else f"{row['temp_mib']:.1f} MiB"
        print(
            f"{name:42s} median {row['step_ms_median']:7.1f} ms  min {row['step_ms_min']:7.1f} ms  "
            f"x{result['ratios'][name]:.2f}  temp {temp}"
        )
    print(f"({result['backend']}, batch {result['config']['batch_size']}, {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
