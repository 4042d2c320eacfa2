"""A skippable AdamW update three ways: a select on every leaf, one ``lax.cond``, and leanstep's
``guarded_update`` (which uses the conditional, :mod:`leanstep.step.update.kept`).

Each is jitted with its state donated and timed interleaved with the others (median of
``--calls``), beside its compiled temporaries, on float32 masters and moments. The forms must
agree bit for bit: the script says so.

    python -m benchmarks.update_skip --out skip.json        # 8 leaves of 1024 x 4096 (33.5M parameters)
    python -m benchmarks.update_skip --tiny                 # the CPU dry run the suite runs
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import leanstep
from leanstep.blocks.clipping import clip_leaves, norm_parts
from leanstep.step.update import guarded_update

_OPTIMIZER = optax.adamw(1e-3)


def _hand_written(form: str) -> Any:
    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        parts = norm_parts(grads)
        applied = parts.finite

        def apply(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
            updates, new = _OPTIMIZER.update(clip_leaves(grads, parts, 1.0), opt_state, params)
            return optax.apply_updates(params, updates), new

        if form == "cond":
            return jax.lax.cond(applied, apply, lambda p, s, g: (p, s), params, opt_state, grads)
        new_params, new_state = apply(params, opt_state, grads)
        pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)
        return pick(new_params, params), pick(new_state, opt_state)

    return jax.jit(update, donate_argnums=(0, 1))


def _leanstep() -> Any:
    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        state = leanstep.TrainState.create(params, _OPTIMIZER).replace(opt_state=opt_state)
        new, _ = guarded_update(state, grads, max_grad_norm=1.0, update_chunk=None)
        return new.params, new.opt_state

    return jax.jit(update, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2 leaves of 64 x 32")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    shapes = [(64, 32)] * 2 if args.tiny else [(1024, 4096)] * 8
    params = [jnp.ones(s, jnp.float32) for s in shapes]
    grads = [jnp.full(s, 0.5, jnp.float32) for s in shapes]
    forms = {"select": _hand_written("select"), "cond": _hand_written("cond"), "leanstep": _leanstep()}
    report: dict = {"device": jax.devices()[0].device_kind, "parameters": sum(int(p.size) for p in params), "forms": {}}
    states = {name: (jax.tree.map(jnp.copy, params), _OPTIMIZER.init(params)) for name in forms}
    for name, fn in forms.items():
        compiled = fn.lower(*states[name], grads).compile()
        report["forms"][name] = {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), "times": []}
    for _ in range(args.calls + 2):  # interleaved: each call of each form sees the same machine
        for name, fn in forms.items():
            start = time.perf_counter()
            states[name] = fn(*states[name], grads)
            jax.block_until_ready(states[name])
            report["forms"][name]["times"].append(time.perf_counter() - start)
    for row in report["forms"].values():
        row["ms"] = 1e3 * float(np.median(row.pop("times")[2:]))
    leaves = {name: jax.tree.leaves(state) for name, state in states.items()}
    report["same_bits"] = all(
        all(bool(jnp.array_equal(a, b)) for a, b in zip(leaves["select"], leaves[name], strict=True))
        for name in ("cond", "leanstep")
    )
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
