"""The step's pace on one chip: leanstep's step beside a hand-written one, MFU by formula and by XLA.

For each named configuration of the built-in transformer (width, depth, attention kernel, remat
policy, microbatches; float32 AdamW masters, bf16 compute, dynamic loss scale, clip 1.0), the
two steps are compiled and timed one after the other (both states do not fit together), each
the median of ``--steps`` calls after two warm-up calls. MFU is the model's training FLOPs a
second (``transformer_flops_per_token`` x tokens, the PaLM formula) over the chip's peak;
XLA's own count of the compiled step (``cost_analysis()["flops"]``) is printed beside it, with
the compiled peak (arguments + outputs - aliased + temporaries). ``--trace`` profiles leanstep's
step of the named configurations kernel by kernel (``benchmarks.step_trace``: time by phase and
primitive, the slowest instructions, and each profiler line's busy time).

A name followed by ``+int8`` runs the block matmuls in int8 (:class:`leanstep.blocks.int8.Int8Recipe`:
the forward and input-gradient products), ``+int8all`` the weight-gradient product too; the
hand-written step is bf16 only.

    python benchmarks/tpu_step.py --configs base,splash --out step.json   # on a TPU v5e
    python benchmarks/tpu_step.py --configs splash,splash+int8,splash+int8all --out step.json
    python benchmarks/tpu_step.py --tiny --out step.json                  # CPU dry run
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import leanstep
from benchmarks import step_trace, tpu_fit
from leanstep.bench.handwritten import init_handwritten_state, make_handwritten_step
from leanstep.blocks.int8 import Int8Recipe
from leanstep.models.transformer import (
    TransformerConfig,
    init_transformer,
    transformer_flops_per_token,
    transformer_loss,
)

#: TPU v5e bf16 peak, FLOP/s (Google Cloud's TPU v5e specification).
V5E_PEAK = 197e12

#: name -> (d_model, layers, head_dim, attention, remat, microbatches, batch rows of seq tokens)
CONFIGS: dict[str, tuple[int, int, int, str, str, int, int]] = {
    "base": (2048, 8, 256, "xla", "dots", 2, 16),
    "splash": (2048, 8, 256, "splash", "dots", 2, 16),
    "splash-mb1": (2048, 8, 256, "splash", "dots", 1, 16),
    "splash-none-mb4": (2048, 8, 256, "splash", "none", 4, 16),
    "splash-none-mb2": (2048, 8, 256, "splash", "none", 2, 16),
    "splash-h128": (2048, 8, 128, "splash", "dots", 2, 16),
    "small-base": (1024, 12, 256, "xla", "dots", 2, 16),
    "small-splash": (1024, 12, 256, "splash", "dots", 2, 16),
    "small-splash-none-mb2": (1024, 12, 256, "splash", "none", 2, 16),
}


#: A configuration name's suffix -> the int8 recipe of its block matmuls.
INT8_SUFFIXES = {"+int8": Int8Recipe(), "+int8all": Int8Recipe("int8")}


def configuration(name: str) -> tuple[tuple[int, int, int, str, str, int, int], Int8Recipe | None]:
    """The sizes of configuration ``name`` (a key of :data:`CONFIGS`, with an int8 suffix or not) and its recipe."""
    base, plus, suffix = name.partition("+")
    if base not in CONFIGS or (plus and plus + suffix not in INT8_SUFFIXES):
        raise ValueError(
            f"--configs: unknown {name!r}; expected names of {sorted(CONFIGS)}, each with +int8, +int8all or not"
        )
    return CONFIGS[base], INT8_SUFFIXES.get(plus + suffix)


def _batch(step: int, rows: int, length: int) -> dict:
    return tpu_fit._batch(step, rows, length, 256)


def _compiled_figures(step: Any, state: Any, batch: dict) -> tuple[dict, Any]:
    compiled = step.lower(state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    figures = {"peak_bytes": tpu_fit.compiled_peak(compiled), "xla_flops": float(cost.get("flops", float("nan")))}
    return figures, compiled


def _trace(step: Any, state: Any, compiled: Any, rows: int, length: int) -> tuple[dict, Any]:
    """The profile of ``calls`` steps (``benchmarks.step_trace``): each kernel's time, by phase and primitive."""
    batch = _batch(0, rows, length)

    def one_step() -> None:
        nonlocal state  # each traced call takes the state the last one returned (the step donates it)
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)

    trace = step_trace.trace_kernels(one_step, compiled.as_text(), calls=2, top=20)
    return trace, state


def _time(step: Any, state: Any, rows: int, length: int, steps: int) -> tuple[list[float], Any, Any]:
    times, metrics = [], None
    for i in range(steps + 2):
        batch = _batch(i, rows, length)
        jax.block_until_ready(batch)
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return times[2:], state, metrics


def measure(
    name: str,
    spec: tuple,
    *,
    seq: int,
    steps: int,
    handwritten: bool,
    trace: bool = False,
    int8: Int8Recipe | None = None,
) -> dict:
    d, layers, head_dim, attention, remat, microbatches, rows = spec
    config = TransformerConfig(
        vocab_size=256, d_model=d, n_layers=layers, n_heads=d // head_dim, d_ff=4 * d, seq_len=seq,
        attention=attention, int8=int8,
    )  # fmt: skip
    loss = functools.partial(transformer_loss, config=config, remat_policy=remat)
    params = init_transformer(jax.random.key(0), config)
    n = sum(x.size for x in jax.tree.leaves(params))
    tokens = rows * seq
    model_flops = transformer_flops_per_token(config) * tokens
    out: dict = {"params": int(n), "tokens": tokens, "model_flops": float(model_flops), "spec": list(spec)}
    out["int8"] = None if int8 is None else int8.to_string()
    step_spec = leanstep.StepSpec.from_keywords(
        precision="compute=bfloat16", num_microbatches=microbatches, max_grad_norm=1.0, loss_scale="dynamic"
    )
    step = leanstep.make_train_step(loss, step_spec)
    state = leanstep.TrainState.create(params, optax.adamw(3e-4), step_spec)
    del params
    out["leanstep"], compiled = _compiled_figures(step, state, _batch(0, rows, seq + 1))
    times, state, metrics = _time(step, state, rows, seq + 1, steps)
    out["leanstep"].update(step_s=float(np.median(times)), loss=float(metrics.loss))
    if trace:
        out["trace"], state = _trace(step, state, compiled, rows, seq + 1)
    del compiled
    del state
    if handwritten and int8 is None:
        hand = make_handwritten_step(loss, optax.adamw(3e-4), compute_dtype=jnp.bfloat16, num_microbatches=microbatches)
        hand_state = init_handwritten_state(init_transformer(jax.random.key(0), config), optax.adamw(3e-4))
        out["handwritten"], _ = _compiled_figures(hand, hand_state, _batch(0, rows, seq + 1))
        times, hand_state, _ = _time(hand, hand_state, rows, seq + 1, steps)
        out["handwritten"]["step_s"] = float(np.median(times))
        out["ratio"] = out["leanstep"]["step_s"] / out["handwritten"]["step_s"]
        del hand_state
    peak = V5E_PEAK if jax.default_backend() == "tpu" else float("nan")
    out["mfu"] = model_flops / out["leanstep"]["step_s"] / peak
    out["xla_mfu"] = out["leanstep"]["xla_flops"] / out["leanstep"]["step_s"] / peak
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="base,splash", help=f"comma-separated names of {sorted(CONFIGS)}")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--handwritten", default="base,splash", help="configs that also time the hand-written step")
    parser.add_argument("--trace", default="", help="configs whose leanstep step is also profiled, kernel by kernel")
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run: d 64, 2 layers, seq 32, 2 steps, profiled")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    configs = {name: configuration(name) for name in args.configs.split(",") if name}
    if args.tiny:
        tiny = (64, 2, 32, "xla", "dots", 2, 4)
        configs = {"tiny": (tiny, None), "tiny+int8": (tiny, Int8Recipe())}
        args.seq, args.steps, args.handwritten, args.trace = 32, 2, "tiny", "tiny"
    report: dict = {"device": jax.devices()[0].device_kind, "seq": args.seq, "results": {}}
    for name, (spec, int8) in configs.items():
        try:
            report["results"][name] = measure(
                name, spec, seq=args.seq, steps=args.steps, handwritten=name in args.handwritten.split(","),
                trace=name in args.trace.split(","), int8=int8,
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 (an out-of-memory configuration is a result)
            report["results"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, json.dumps(report["results"][name]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
