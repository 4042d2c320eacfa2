"""The optimizer state in host memory on one chip: device and host bytes, transfers, peak and cost.

For the built-in transformer, each state format's step is compiled with the state on the device
and offloaded (:func:`leanstep.step.offload_opt_state`, chunked update), and read by
:func:`leanstep.inspection.memory_space_report` (entry layout, HLO transfers, ``memory_analysis()``); then
both train ``--steps`` steps from the same state and batches: the time a step, and whether the
two runs' states and metrics are bit-identical.

    python benchmarks/tpu_offload.py --out offload.json          # on a TPU (d 2048, 8 layers)
    python benchmarks/tpu_offload.py --tiny --out offload.json   # CPU dry run (XLA:CPU moves nothing)
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import leanstep
from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss

#: On a TPU ``offload_opt_state`` refuses int8 moments (XLA:TPU cannot copy uint8 to host memory):
#: its row records that refusal; bfloat16 moments are the lean state that offloads there.
FORMATS = {
    "float32": ("float32", "float32"),
    "bf16-sr + bfloat16": ("bfloat16-sr", "bfloat16"),
    "bf16-sr + int8": ("bfloat16-sr", "int8"),
}


def _batch(step: int, batch: int, length: int, vocab: int) -> dict:
    rows = np.arange(batch)[:, None]
    tokens = (step * 7 + rows * 3 + np.arange(length)[None, :] * (1 + rows % 4)) % vocab
    return {"tokens": jnp.asarray(tokens, jnp.int32)}


def _run(step, state, batches) -> tuple[list[np.ndarray], float]:
    """Every step's metrics and the last state, on the host, and the median time a step.

    Only the last state is kept: a 405M model's float32 state is 4.9 GB, and keeping each step's
    ran the TPU host's 40 GiB out (2026-12-06); a step that differs leaves its mark in the metrics
    of every later step and in the last state.
    """
    leaves, times = [], []
    for batch in batches:
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        leaves += [np.asarray(x) for x in jax.tree.leaves(metrics)]
    leaves += [np.asarray(x) for x in jax.tree.leaves(state)]
    return leaves, float(np.median(times[1:] or times))  # the first call compiles


def measure(config: TransformerConfig, form: tuple, args: argparse.Namespace) -> dict:
    master, moments = form
    update_chunk = "auto" if args.update_chunk == "auto" else int(args.update_chunk)
    spec = leanstep.StepSpec.from_keywords(
        precision="compute=bfloat16", num_microbatches=args.microbatches, max_grad_norm=1.0, loss_scale="dynamic",
        master=master, moments=moments, update_chunk=update_chunk, donate=False,
    )  # fmt: skip
    state = leanstep.TrainState.create(init_transformer(jax.random.key(0), config), optax.adamw(3e-4), spec)
    loss = functools.partial(transformer_loss, config=config, remat_policy="full")
    step = leanstep.make_train_step(loss, spec)
    batches = [_batch(i, args.batch, config.seq_len + 1, config.vocab_size) for i in range(args.steps)]
    offloaded = leanstep.step.offload_opt_state(state)
    plain_report = leanstep.inspection.memory_space_report(step, state, batches[0])
    offload_report = leanstep.inspection.memory_space_report(step, offloaded, batches[0])
    try:
        leanstep.inspection.check_offload(offload_report, plain_report)
        verdict = "accepted"
    except ValueError as error:
        verdict = f"refused: {error}"
    plain_leaves, plain_time = _run(step, state, batches)
    offload_leaves, offload_time = _run(step, offloaded, batches)
    identical = len(plain_leaves) == len(offload_leaves) and all(
        a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True) for a, b in zip(plain_leaves, offload_leaves)
    )
    report = lambda r: {**r._asdict(), "device_peak_bytes": r.device_peak_bytes, "str": str(r)}
    return {
        "parameters": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "plain": report(plain_report),
        "offloaded": report(offload_report),
        "check_offload": verdict,
        "seconds_a_step": {"plain": plain_time, "offloaded": offload_time},
        "bit_identical": bool(identical),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of FORMATS")
    parser.add_argument("--update-chunk", default="auto", help="update_chunk: 'auto' or an int")
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run: a small model, 2 steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.seq, args.batch, args.microbatches, args.steps = 64, 2, 16, 4, 2, 2
        args.update_chunk = "20000" if args.update_chunk == "auto" else args.update_chunk
    config = TransformerConfig(
        vocab_size=8192 if not args.tiny else 256, d_model=args.d_model, n_layers=args.layers,
        n_heads=max(1, args.d_model // 128), d_ff=4 * args.d_model, seq_len=args.seq,
    )  # fmt: skip
    names = [name.strip() for name in args.formats.split(",")]
    unknown = [name for name in names if name not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; known: {list(FORMATS)}")
    formats: dict = {}
    for name in names:
        try:
            formats[name] = measure(config, FORMATS[name], args)
        except Exception as error:  # noqa: BLE001 (a format that leanstep refuses or XLA fails is a result)
            formats[name] = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
            print(f"{name}: {formats[name]['error']}", flush=True)
    result = {"device": str(jax.devices()[0]), "config": vars(args), "formats": formats}
    for name, entry in formats.items():
        if "error" in entry:
            continue
        print(f"{name}: {entry['parameters']:,} parameters; bit-identical {entry['bit_identical']}; "
              f"{entry['seconds_a_step']}; {entry['check_offload']}")  # fmt: skip
        print("  state on the device:\n" + entry["plain"]["str"] + "\n  offloaded:\n" + entry["offloaded"]["str"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return json.loads(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
