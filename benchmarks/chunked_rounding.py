"""How far the chunked update rounds from the whole-tree one, per optimizer and shapes (docs/lean-state.md).

For each case, one leanstep step (clip 1.0, float32 state) with ``update_chunk=None`` and with the
case's chunk, from the same parameters: the parameters that differ, the largest difference in units
of the last place of the entry's change plus one of the parameter's own (the rounding of an update
and of its sum with the parameter), and the optimizer state's entries that differ. XLA's flags decide the figures (``XLA_FLAGS=--xla_cpu_max_isa=AVX`` turns LLVM's fused
multiply-adds off on a CPU).

    python benchmarks/chunked_rounding.py                  # every case
    python benchmarks/chunked_rounding.py --cases adam     # the cases whose name holds "adam"
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import leanstep

STACK = {"w": (4, 32, 16), "b": (4, 16), "e": (64, 8)}
MIXED = {"a": (16, 8), "b": (8,), "c": (4, 16, 4), "d": (3, 4)}

#: name -> (optimizer, shapes, update_chunk)
CASES: dict[str, tuple[Callable[[], optax.GradientTransformation], dict[str, tuple[int, ...]], int]] = {
    "noisy_sgd, a stack": (lambda: optax.noisy_sgd(0.1, eta=0.1, key=0), STACK, 64),
    "add_noise + sgd, a stack": (lambda: optax.chain(optax.add_noise(0.1, 0.55, key=0), optax.sgd(0.1)), STACK, 64),
    "schedule_free_adamw, a stack": (lambda: optax.contrib.schedule_free_adamw(1e-2), STACK, 64),
    "schedule_free_sgd, a stack": (lambda: optax.contrib.schedule_free_sgd(1e-2), STACK, 64),
    "adam, (1, 16, 4) beside (3, 4)": (lambda: optax.adam(1e-2), {"x": (1, 16, 4), "y": (3, 4)}, 8),
    "adam, 40 two-entry leaves": (lambda: optax.adam(1e-2), {f"l{i:02d}": (2,) for i in range(40)}, 3),
    "adam, a one-layer stack": (lambda: optax.adam(1e-2), {"w": (1, 32, 16), "b": (1, 16), "e": (64, 8)}, 300),
    "adam, a stack": (lambda: optax.adam(1e-2), STACK, 64),
    "multi_transform adam + sgd momentum": (
        lambda: optax.multi_transform(
            {"a": optax.adam(1e-2), "s": optax.sgd(1e-2, momentum=0.9)}, {"a": "a", "b": "s", "c": "a", "d": "s"}
        ),
        MIXED,
        64,
    ),
    "multi_transform two adams, a stack": (
        lambda: optax.multi_transform({"a": optax.adam(1e-2), "s": optax.adam(1e-3)}, {"w": "a", "b": "s", "e": "a"}),
        STACK,
        64,
    ),
}


def _loss(params, batch):
    return sum(jnp.sum(jnp.tanh(p * batch["s"][0]) ** 2) for p in jax.tree.leaves(params))


def _step(tx, params, update_chunk):
    spec = leanstep.StepSpec(max_grad_norm=1.0, update_chunk=update_chunk)
    state = leanstep.TrainState.create(params, tx, spec)
    step = leanstep.make_train_step(_loss, spec)
    return step(state, {"s": jnp.asarray([1.0])})[0]


def _data(tree) -> list[np.ndarray]:
    key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    return [np.asarray(jax.random.key_data(x) if key(x) else x) for x in jax.tree.leaves(tree)]


def measure(name: str) -> dict:
    """One case's figures: ``{"differ", "entries", "ulp", "state_differ"}``."""
    make, shapes, chunk = CASES[name]
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    whole, chunked = _step(make(), params, None), _step(make(), params, chunk)
    differ, ulp = 0, 0.0
    for key, before in params.items():
        a, b = np.asarray(whole.params[key], np.float64), np.asarray(chunked.params[key], np.float64)
        change = np.abs(a - np.asarray(before, np.float64))  # the whole step's update of each entry
        unit = np.finfo(np.float32).eps * change + np.spacing(np.abs(a).astype(np.float32)).astype(np.float64)
        units = np.abs(a - b) / unit
        differ += int(np.sum(a != b))
        ulp = max(ulp, float(np.max(units, initial=0.0)))
    state = sum(int(np.sum(x != y)) for x, y in zip(_data(whole.opt_state), _data(chunked.opt_state)))
    entries = sum(int(np.prod(shape)) for shape in shapes.values())
    return {"differ": differ, "entries": entries, "ulp": round(ulp, 2), "state_differ": state}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="only the cases whose name holds this text")
    args = parser.parse_args(argv)
    rows = []
    for name in CASES:
        if args.cases in name:
            row = {"case": name, **measure(name)}
            print(
                f"{name:40s} {row['differ']:5d} of {row['entries']:5d} differ, "
                f"{row['ulp']:6.2f} units of rounding, state entries differing {row['state_differ']}"
            )
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
