"""The lean state on one chip: compiled peaks per state format, and a 20-step run of the leanest.

For the built-in transformer at the given size, every format (float32 AdamW; bfloat16-sr masters
with bfloat16 moments; bfloat16-sr with int8 moments and the chunked update) is compiled ahead of
time on abstract inputs and its peak read from ``memory_analysis()`` (arguments + outputs -
aliased + temporaries); then the last format trains ``--steps`` steps on a learnable token
pattern (dynamic loss scale, clip 1.0), reporting loss, skips and time a step.

    python benchmarks/tpu_fit.py --d-model 2048 --layers 26 --steps 20 --out fit.json   # on a TPU
    python benchmarks/tpu_fit.py --tiny --out fit.json                                  # CPU dry run
    python -m benchmarks.tpu_fit --d-model 2560 --layers 32 --steps 20 \
        --formats "bf16-sr + int8 (chunked update),bf16-sr + int8 (update in backward)"     # >= 2.5B, in backward
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
from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss, transformer_stack

IN_BACKWARD = "in backward"
FORMATS = {
    "float32": ("float32", "float32", None),
    "bf16-sr + bfloat16": ("bfloat16-sr", "bfloat16", "auto"),
    "bf16-sr + int8 (whole-tree update)": ("bfloat16-sr", "int8", None),
    "bf16-sr + int8 (chunked update)": ("bfloat16-sr", "int8", "auto"),
    # each layer updated inside the backward pass (StepSpec.update_in_backward; docs/in-backward.md)
    "bf16-sr + int8 (update in backward)": ("bfloat16-sr", "int8", IN_BACKWARD),
    "float32 (update in backward)": ("float32", "float32", IN_BACKWARD),
}


def _setup(config: TransformerConfig, form: tuple, batch: int, microbatches: int):
    master, moments, update_chunk = form
    in_backward = update_chunk == IN_BACKWARD  # the same loss, as a LayerStack (a mean, as transformer_loss)
    spec = leanstep.StepSpec.from_keywords(
        precision="compute=bfloat16", num_microbatches=microbatches, max_grad_norm=1.0, loss_scale="dynamic",
        master=master, moments=moments, update_chunk="auto" if in_backward else update_chunk,
        update_in_backward=in_backward,
    )  # fmt: skip
    make = functools.partial(_state, config=config, spec=spec)
    loss = (
        transformer_stack(config, token_weighted=False)
        if in_backward
        else functools.partial(transformer_loss, config=config, remat_policy="full")
    )
    step = leanstep.make_train_step(loss, spec)
    tokens = jax.ShapeDtypeStruct((batch, config.seq_len + 1), jnp.int32)
    return make, step, tokens


_OPTIMIZER = optax.adamw(3e-4)  # one instance: it is the state's static metadata, which compiled programs check


def _state(key: jax.Array, *, config: TransformerConfig, spec: leanstep.StepSpec) -> leanstep.TrainState:
    """The step-0 state in one program: made eagerly, the float32 parameters beside it do not fit (1.31B, 16 GiB)."""
    init = functools.partial(init_transformer, key, config)
    return leanstep.TrainState.create_from(init, _OPTIMIZER, spec)


def _batch(step: int, batch: int, length: int, vocab: int) -> dict:
    """Rows counting up by a per-row stride from a per-step offset: learnable, never the same batch."""
    rows = np.arange(batch)[:, None]
    tokens = (step * 7 + rows * 3 + np.arange(length)[None, :] * (1 + rows % 4)) % vocab
    return {"tokens": jnp.asarray(tokens, jnp.int32)}


def compiled_peak(compiled: Any) -> int:
    """A compiled step's peak: arguments + outputs - aliased + temporaries (``memory_analysis()``)."""
    memory = compiled.memory_analysis()
    total = (
        memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )  # fmt: skip
    return int(total)


def peak(config: TransformerConfig, form: tuple, batch: int, microbatches: int) -> dict:
    make, step, tokens = _setup(config, form, batch, microbatches)
    state = jax.eval_shape(make, jax.random.key(0))
    start = time.perf_counter()
    try:
        compiled = step.lower(state, {"tokens": tokens}).compile()
    except Exception as error:  # XLA:TPU refuses a program past the chip's memory at compile time
        if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
            raise
        return {"out_of_memory": str(error).splitlines()[0][:300], "compile_s": round(time.perf_counter() - start, 1)}
    memory = compiled.memory_analysis()
    return {
        "peak_bytes": compiled_peak(compiled),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def train(config: TransformerConfig, form: tuple, batch: int, microbatches: int, steps: int, step: Any = None) -> dict:
    """``steps`` steps of ``form`` from a fresh state: losses, skips, the median seconds a step.

    ``step``: a program compiled for this state and batch (``tpu_check``'s), or None to jit one.
    """
    make, jitted, _ = _setup(config, form, batch, microbatches)
    step = jitted if step is None else step
    start = time.perf_counter()
    state = make(jax.random.key(0))
    jax.block_until_ready(state)
    print(
        f"{time.strftime('%X')} state made in {time.perf_counter() - start:.1f} s; training {steps} steps", flush=True
    )
    losses, skipped, times = [], [], []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, _batch(i, batch, config.seq_len + 1, config.vocab_size))
        losses.append(float(metrics.loss))
        skipped.append(bool(metrics.skipped))
        times.append(time.perf_counter() - start)
        print(f"{time.strftime('%X')} step {i}: loss {losses[-1]:.4f} {times[-1]:.2f} s", flush=True)
    return {"losses": losses, "skipped": skipped, "step_s": round(float(np.median(times[2:] or times)), 4)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of FORMATS")
    parser.add_argument(
        "--train",
        default=None,
        help="comma-separated formats to train --steps steps each (default: the last of --formats)",
    )
    parser.add_argument("--update-chunk", default="auto", help="the chunked formats' update_chunk: 'auto' or an int")
    parser.add_argument(
        "--tiny", action="store_true", help="a CPU dry run: d 64, 2 layers, seq 32, 3 steps, chunks of 8192"
    )
    parser.add_argument("--attention", default="auto", help="TransformerConfig.attention: auto, xla or splash")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.seq, args.batch, args.microbatches, args.steps = 64, 2, 32, 4, 2, 3
        args.update_chunk = "8192"
    chunk = args.update_chunk if args.update_chunk == "auto" else int(args.update_chunk)
    formats = {name: (m, v, chunk if c == "auto" else c) for name, (m, v, c) in FORMATS.items()}
    config = TransformerConfig(
        vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 128),
        d_ff=4 * args.d_model, seq_len=args.seq, attention=args.attention,
    )  # fmt: skip
    names = [n for n in args.formats.split(",") if n]
    params = sum(
        x.size for x in jax.tree.leaves(jax.eval_shape(lambda k: init_transformer(k, config), jax.random.key(0)))
    )
    report: dict = {"device": jax.devices()[0].device_kind, "params": int(params), "config": vars(args), "formats": {}}
    for name in names:
        print(f"{time.strftime('%X')} compiling {name}", flush=True)
        report["formats"][name] = peak(config, formats[name], args.batch, args.microbatches)
        print(name, report["formats"][name], flush=True)
    trained = [n for n in (args.train or names[-1]).split(",") if n]
    if args.steps:
        report["train"] = {}
        for name in trained:  # one after another on the chip: their times a step side by side
            report["train"][name] = train(config, formats[name], args.batch, args.microbatches, args.steps)
            print(name, report["train"][name], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
