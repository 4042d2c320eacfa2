"""leanstep on one accelerator chip, in one command: what fits, how fast, what the planner predicts.

Five parts, each written to ``<out>/check.json`` as it ends (a part that fails records its error):

* ``fit``: the fit ladder of the built-in transformer (d 2048, seq 1024, batch 8 x 1024 in 4
  microbatches, full remat, bf16 compute, AdamW, dynamic loss scale, clip 1.0) per state format
  (float32; bf16-sr masters with int8 moments and the chunked update). Compiled peaks at two
  depths give bytes a layer; the deepest model under the chip's memory is compiled (one layer
  less while it does not fit) and, for int8 (chunked, and with the update inside the backward
  pass: :mod:`leanstep.step.layerwise`), trains ``--fit-steps`` steps from that compiled program:
  losses, skips, seconds a step. bf16-sr masters with bfloat16 moments are compiled at the int8
  format's depth, so the two peaks compare at equal model and batch, and the update inside the
  backward pass trains 5 steps there too: its time a step beside the chunked format's.
* ``pace``: leanstep's step and the hand-written one (``benchmarks/tpu_step.py``) at 405M and
  152M parameters (JAX's splash attention): seconds a step, MFU by the model's formula and
  XLA's count; the 405M step profiled kernel by kernel (``benchmarks/step_trace.py``); the 405M
  step again with int8 matmuls (forward and input gradient; then the weight gradient too), beside
  the bf16 one in the same run.
* ``plan``: :func:`leanstep.planning.plan` for the 405M model under the chip's memory; its chosen
  setting's compiled peak (arguments + outputs - aliased + temporaries) beside XLA's own peak
  (``peak_memory_in_bytes``) and the allocator's (``memory_stats()``) before and after 3 steps,
  which on a TPU leaves out the program's temporaries.
* ``offload``: the optimizer state in host memory (``benchmarks/tpu_offload.py``).
* ``moments``: nanoseconds an entry to code and decode 8-bit moments, per search
  (``benchmarks/moment_codes.py``).

    bash benchmarks/tpu_check.sh --out check          # on a TPU VM after pip install -e . (9-10 min)
    python benchmarks/tpu_check.py --tiny --out check # the CPU dry run the suite runs
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import optax

import leanstep
from benchmarks import tpu_fit, tpu_step
from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss

LADDER = {  # name -> (master, moments, update_chunk)
    "float32": ("float32", "float32", None),
    "bf16-sr + int8 (chunked)": ("bfloat16-sr", "int8", "auto"),
    "bf16-sr + int8 (update in backward)": ("bfloat16-sr", "int8", tpu_fit.IN_BACKWARD),
}
TRAINED = ("bf16-sr + int8 (chunked)", "bf16-sr + int8 (update in backward)")  # the others compile only
BF16_MOMENTS = ("bfloat16-sr", "bfloat16", "auto")  # compiled at the int8 format's depth, to compare peaks
_USABLE = 0.97  # of the chip's bytes_limit: the allocator's own blocks and fragmentation


def _config(size: dict, layers: int) -> TransformerConfig:
    """The ladder's model. Its attention is written out ("xla"): under full remat the splash kernel's
    step did not compile in 6.5 minutes on the v5e (the written-out one compiled in 22-34 s)."""
    d = size["d_model"]
    return TransformerConfig(
        vocab_size=256, d_model=d, n_layers=layers, n_heads=max(1, d // 128), d_ff=4 * d, seq_len=size["seq"],
        attention="xla",
    )  # fmt: skip


def _memory_limit(tiny: bool) -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) if not tiny else 12 << 20


def _compile(config: TransformerConfig, form: tuple, size: dict) -> tuple[Any, int]:
    make, step, tokens = tpu_fit._setup(config, form, size["batch"], size["microbatches"])
    compiled = step.lower(jax.eval_shape(make, jax.random.key(0)), {"tokens": tokens}).compile()
    return compiled, tpu_fit.compiled_peak(compiled)


def ladder(name: str, size: dict, limit: int, *, train_steps: int, lo: int, hi: int) -> dict:
    """The deepest model of ``size`` whose step in format ``name`` compiles under ``limit`` bytes."""
    form, cap = LADDER[name], limit * _USABLE
    tried: dict[int, tuple[Any, int]] = {}  # layers -> (compiled step, its peak)

    def peak_at(n: int) -> int:
        if n not in tried:
            tried[n] = _compile(_config(size, n), form, size)
        return tried[n][1]

    peaks = {n: peak_at(n) for n in (lo, hi)}
    per_layer = (peaks[hi] - peaks[lo]) / (hi - lo)
    layers = max(1, math.floor((cap - (peaks[lo] - lo * per_layer)) / per_layer))
    while layers > 1 and peak_at(layers) > cap:  # from the estimate down while it does not fit,
        layers -= 1
    while peak_at(layers) <= cap and peak_at(layers + 1) <= cap:  # then up while one layer more does
        layers += 1
    compiled, peak = tried[layers]
    above = tried.get(layers + 1, (None, None))[1]
    config = _config(size, layers)
    params = sum(
        x.size for x in jax.tree.leaves(jax.eval_shape(lambda k: init_transformer(k, config), jax.random.key(0)))
    )
    out: dict = {
        "layers": layers,
        "params": int(params),
        "peak_bytes": peak,
        "next_layer_peak_bytes": above,
        "bytes_a_layer": per_layer,
        "peaks": peaks,
    }
    out["fits"] = peak <= cap
    if train_steps and out["fits"]:
        out["train"] = tpu_fit.train(config, form, size["batch"], size["microbatches"], train_steps, step=compiled)
    del compiled
    tried.clear()  # the compiled programs: the next format compiles beside none of them
    return out


def part_fit(args: argparse.Namespace, limit: int) -> dict:
    size = {"d_model": args.d_model, "seq": args.seq, "batch": args.batch, "microbatches": args.microbatches}
    lo, hi = (1, 2) if args.tiny else (2, 4)
    result: dict = {"size": size, "limit_bytes": limit, "formats": {}}
    for name in LADDER:
        steps = args.fit_steps if name in TRAINED else 0
        result["formats"][name] = ladder(name, size, limit, train_steps=steps, lo=lo, hi=hi)
    layers = result["formats"]["bf16-sr + int8 (chunked)"]["layers"]
    _, result["bf16_moments_at_int8_depth_peak_bytes"] = _compile(_config(size, layers), BF16_MOMENTS, size)
    # The update in the backward pass at the chunked format's depth: its time a step beside that one's.
    form = LADDER["bf16-sr + int8 (update in backward)"]
    compiled, peak = _compile(_config(size, layers), form, size)
    train = tpu_fit.train(_config(size, layers), form, size["batch"], size["microbatches"], 5, step=compiled)
    result["in_backward_at_int8_depth"] = {"layers": layers, "peak_bytes": peak, "train": train}
    return result


def part_pace(args: argparse.Namespace) -> dict:
    if args.tiny:
        return tpu_step.main(["--tiny"])
    return tpu_step.main(
        [
            "--configs",
            "splash,splash+int8,splash+int8all,small-splash",
            "--handwritten",
            "splash,small-splash",
            "--trace",
            "splash",
            "--steps",
            "6",
        ]
    )


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def part_plan(args: argparse.Namespace, limit: int) -> dict:
    d, layers, rows, seq = (64, 2, 8, 32) if args.tiny else (2048, 8, 16, 1024)
    config = TransformerConfig(
        vocab_size=256, d_model=d, n_layers=layers, n_heads=max(1, d // 256), d_ff=4 * d, seq_len=seq
    )
    params = init_transformer(jax.random.key(0), config)
    batch, optimizer = tpu_step._batch(0, rows, seq + 1), optax.adamw(3e-4)
    spec = leanstep.StepSpec.from_keywords(precision="compute=bfloat16", max_grad_norm=1.0, loss_scale="dynamic")
    chosen = leanstep.planning.plan(
        lambda policy: functools.partial(transformer_loss, config=config, remat_policy=policy),
        _shapes(params), _shapes(batch), optimizer, spec, budget_bytes=int(limit * _USABLE),
        candidates=leanstep.planning.SearchSpace(remat_policies=("dots", "full"), microbatches=(1, 2, 4)),
    ).chosen  # fmt: skip
    state = leanstep.TrainState.create(params, optimizer, spec)
    del params
    before = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    for i in range(3):
        state, metrics = chosen.executable(state, tpu_step._batch(i, rows, seq + 1))
    jax.block_until_ready(metrics)
    measured = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    # On a TPU v5e (JAX 0.10.2) the allocator's peak did not move over the 405M step's three runs
    # (9.74 GB before and after, from building the state): its statistics leave out a program's
    # temporaries (9.89 GB there), so they measure the arrays between steps, not the step's peak.
    # XLA's own peak (its buffer assignment's, live ranges counted) is reported beside the plan's.
    return {
        "setting": chosen.setting._asdict(), "predicted_peak_bytes": chosen.peak_bytes,
        "xla_peak_bytes": chosen.xla_peak_bytes, "allocator_peak_before_steps": before,
        "measured_peak_bytes": measured, "loss": float(metrics.loss),
    }  # fmt: skip


def part_moments(args: argparse.Namespace) -> dict:
    from benchmarks import moment_codes

    return moment_codes.main(["--entries", str(1 << 16 if args.tiny else 1 << 22)])


def part_offload(args: argparse.Namespace) -> dict:
    from benchmarks import tpu_offload

    # Two formats, as before tpu_offload measured bfloat16 moments too: on a TPU the lean state that
    # offloads (bfloat16 moments) and int8's one-line refusal; on a CPU float32 and int8, both offloaded.
    if args.tiny:
        return tpu_offload.main(["--tiny", "--formats", "float32,bf16-sr + int8"])
    return tpu_offload.main(["--layers", "4", "--steps", "3", "--formats", "bf16-sr + bfloat16,bf16-sr + int8"])


PARTS = ("moments", "fit", "pace", "plan", "offload")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a folder for check.json")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--fit-steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run: tiny shapes, a 12 MiB 'chip'")
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.seq, args.batch, args.microbatches, args.fit_steps = 64, 32, 4, 1, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limit = _memory_limit(args.tiny)
    report: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "limit_bytes": limit, "parts": {}}
    run = {
        "fit": lambda: part_fit(args, limit),
        "pace": lambda: part_pace(args),
        "plan": lambda: part_plan(args, limit),
    }
    run["offload"] = lambda: part_offload(args)
    run["moments"] = lambda: part_moments(args)
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            report["parts"][name] = run[name]()
        except Exception:  # noqa: BLE001 (the other parts still run; the error is the result)
            report["parts"][name] = {"error": traceback.format_exc(limit=4)[-1500:]}
        report["parts"][name]["seconds"] = round(time.perf_counter() - start, 1)
        print(name, json.dumps(report["parts"][name], default=str)[:2000], flush=True)
        (out / "check.json").write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
