"""The int8 product's forms on the chip, one matmul at the transformer's shapes: the bf16 dot, the
int8 dot alone, and the quantize-dot-dequantize of leanstep.blocks.int8 with its int32 sum or an
f32 one (exactness of the f32 form checked against the int32 one).

    python -m benchmarks.int8_forms --out forms.json     # on a TPU v5e
    python -m benchmarks.int8_forms --tiny               # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from leanstep.blocks.int8 import quantize_int8


def _time(fn, *args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _forms(x, w):
    dims = (((1,), (0,)), ((), ()))

    def bf16(x, w):
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)

    def int32_sum(x, w):
        qx, sx = quantize_int8(x, 1)
        qw, sw = quantize_int8(w, 0)
        acc = jax.lax.dot_general(qx, qw, dims, preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * sx * sw).astype(x.dtype)

    def f32_sum(x, w):
        qx, sx = quantize_int8(x, 1)
        qw, sw = quantize_int8(w, 0)
        acc = jax.lax.dot_general(qx, qw, dims, preferred_element_type=jnp.float32)
        return (acc * sx * sw).astype(x.dtype)

    qx, _ = quantize_int8(x, 1)
    qw, _ = quantize_int8(w, 0)

    def int8_only(qx, qw):
        return jax.lax.dot_general(qx, qw, dims, preferred_element_type=jnp.int32)

    return {
        "bf16": (bf16, x, w),
        "int32_sum": (int32_sum, x, w),
        "f32_sum": (f32_sum, x, w),
        "int8_only": (int8_only, qx, qw),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    shapes = (
        [(64, 32, 48)]
        if args.tiny
        else [(8192, 2048, 8192), (8192, 8192, 2048), (8192, 2048, 6144), (8192, 2048, 2048)]
    )
    report: dict = {"device": jax.devices()[0].device_kind, "shapes": {}}
    for m, k, n in shapes:
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        row: dict = {}
        outputs = {}
        for name, (fn, a, b) in _forms(x, w).items():
            jitted = jax.jit(fn)
            row[name + "_ms"] = 1e3 * _time(jitted, a, b, calls=args.calls)
            outputs[name] = jitted(a, b)
        row["f32_sum_equals_int32_sum"] = bool(jnp.array_equal(outputs["f32_sum"], outputs["int32_sum"]))
        flops = 2 * m * k * n
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        row["int8_only_tops"] = flops / row["int8_only_ms"] / 1e9
        report["shapes"][f"{m}x{k}x{n}"] = row
        print(f"{m}x{k}x{n}", json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
