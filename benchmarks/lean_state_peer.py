r"""leanstep's 8-bit AdamW beside bitsandbytes' on one small problem: state bytes and loss curves.

The problem: a two-layer tanh MLP (256 -> 1024 -> 256) fit to a fixed random teacher, the same
initial weights and the same batches (NumPy) in JAX and in PyTorch, AdamW (lr 1e-3, weight decay
0.01) for ``--steps`` steps:

.. code-block:: text

    leanstep float32     make_train_step, TrainState.create(moments="float32")
    leanstep int8        TrainState.create(moments="int8"): 8-bit blocks of 256, float32 scales
    torch float32        torch.optim.AdamW
    bitsandbytes int8    bnb.optim.AdamW8bit (blockwise, 256 a block on CPU), min_8bit_size=0

State bytes: leanstep's from XLA's memory analysis of the optimizer state (arguments of a
compiled identity), PyTorch's the ``nbytes`` of every tensor in the optimizer's state. The two
float32 rows check that the problem is the same one in both frameworks. Needs the ``bench``
extra and ``bitsandbytes``; run it as ``python -m benchmarks.lean_state_peer``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import leanstep
from benchmarks import print_result

__all__ = ["main", "measure"]

D_IN, D_HIDDEN, D_OUT, BATCH = 256, 1024, 256, 64


def _problem(steps: int) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.normal(size=(D_IN, D_HIDDEN)) / np.sqrt(D_IN)).astype(np.float32),
        "w2": (rng.normal(size=(D_HIDDEN, D_OUT)) / np.sqrt(D_HIDDEN)).astype(np.float32),
    }
    teacher = rng.normal(size=(D_IN, D_OUT)).astype(np.float32) / np.sqrt(D_IN)
    batches = []
    for _ in range(steps):
        x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
        batches.append({"x": x, "y": np.tanh(x @ teacher).astype(np.float32)})
    return params, batches


def _leanstep(params: dict, batches: list, moments: str) -> tuple[list[float], int]:
    def loss(p: Any, b: Any) -> jax.Array:
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    spec = leanstep.StepSpec(moments=moments)
    state = leanstep.TrainState.create(params, optax.adamw(1e-3, weight_decay=0.01), spec)
    analysis = jax.jit(lambda s: s).lower(state.opt_state).compile().memory_analysis()
    state_bytes = 0 if analysis is None else analysis.argument_size_in_bytes
    step = leanstep.make_train_step(loss, spec)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    return losses, int(state_bytes)


def _torch(params: dict, batches: list, eight_bit: bool) -> tuple[list[float], int]:
    import torch

    w1, w2 = (torch.nn.Parameter(torch.from_numpy(params[k].copy())) for k in ("w1", "w2"))
    optimizer: Any
    if eight_bit:
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit([w1, w2], lr=1e-3, weight_decay=0.01, min_8bit_size=0)
    else:
        optimizer = torch.optim.AdamW([w1, w2], lr=1e-3, weight_decay=0.01)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])
        loss = torch.mean((torch.tanh(x @ w1) @ w2 - y) ** 2)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses, int(sum(t.nbytes for t in state))


def measure(steps: int = 300) -> dict[str, Any]:
    """The four rows' loss curves and state bytes (``tests/test_lean_state.py`` runs it where
    PyTorch and bitsandbytes are installed)."""
    params, batches = _problem(steps)
    rows = {
        "leanstep float32": _leanstep(params, batches, "float32"),
        "leanstep int8": _leanstep(params, batches, "int8"),
        "torch float32": _torch(params, batches, eight_bit=False),
        "bitsandbytes int8": _torch(params, batches, eight_bit=True),
    }
    count = sum(p.size for p in params.values())
    marks = sorted({0, steps // 10, steps // 4, steps // 2, steps - 1})
    return {
        "parameters": int(count),
        "steps": steps,
        "rows": {
            name: {
                "state_bytes": state_bytes,
                "bytes_per_parameter": state_bytes / count,
                "final_loss": float(np.mean(losses[-10:])),
                "curve": {str(t): losses[t] for t in marks},
            }
            for name, (losses, state_bytes) in rows.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lean_state_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(args.steps)
    return print_result(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
