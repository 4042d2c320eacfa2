r"""Which way of writing an FP8 matmul reaches an FP8 GEMM, and with what numbers, on this device.

.. code-block:: text

    bf16         dot(x, w)                                            the baseline
    qdq_f32      dot(bf16(f32(q_x) s_x), bf16(f32(q_w) s_w))          leanstep 0.10's qdq
    qdq_bf16     dot(bf16(q_x) bf16(s_x), bf16(q_w) bf16(s_w))        Flax's fp8_ops form
    direct       bf16(dot_f32(q_x, q_w) s_x s_w)                      FP8 operands into the dot itself

    q_x = e4m3(clip(x / s_x)), q_w likewise; s_x, s_w not powers of two

For each form: the compiled program's FP8 GEMMs (``__cublas$lt$matmul$f8`` on a GPU) and FP8-typed
values, the best of ``--repeats`` timings of ``--iters`` products, and the largest error relative
to the largest entry of a float64 reference of the quantized product. A form whose FP8 values
XLA strips computes in bf16: its error is bf16's, not FP8's. Run it as
``python -m benchmarks.fp8_gemm_forms --size 8192`` (``--json F`` writes the result).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks import print_result

__all__ = ["FORMS", "main", "measure"]

E4M3 = jnp.float8_e4m3fn
LIMIT = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
DIMS = (((1,), (0,)), ((), ()))


def _quantize(x: jax.Array, s: jax.Array) -> jax.Array:
    return jnp.clip(x.astype(jnp.float32) / s, -LIMIT, LIMIT).astype(E4M3)


def bf16(x: jax.Array, w: jax.Array, sx: jax.Array, sw: jax.Array) -> jax.Array:
    return jnp.dot(x, w)


def qdq_f32(x: jax.Array, w: jax.Array, sx: jax.Array, sw: jax.Array) -> jax.Array:
    xq = (_quantize(x, sx).astype(jnp.float32) * sx).astype(jnp.bfloat16)
    wq = (_quantize(w, sw).astype(jnp.float32) * sw).astype(jnp.bfloat16)
    return jnp.dot(xq, wq)


def qdq_bf16(x: jax.Array, w: jax.Array, sx: jax.Array, sw: jax.Array) -> jax.Array:
    xq = _quantize(x, sx).astype(jnp.bfloat16) * sx.astype(jnp.bfloat16)
    wq = _quantize(w, sw).astype(jnp.bfloat16) * sw.astype(jnp.bfloat16)
    return jnp.dot(xq, wq)


def direct(x: jax.Array, w: jax.Array, sx: jax.Array, sw: jax.Array) -> jax.Array:
    y = jax.lax.dot_general(_quantize(x, sx), _quantize(w, sw), DIMS, preferred_element_type=jnp.float32)
    return (y * (sx * sw)).astype(jnp.bfloat16)


FORMS: dict[str, Callable[..., jax.Array]] = {"bf16": bf16, "qdq_f32": qdq_f32, "qdq_bf16": qdq_bf16, "direct": direct}


def _reference(x: np.ndarray, w: np.ndarray, sx: float, sw: float) -> np.ndarray:
    """The quantized product in float64: FP8 rounding by ml_dtypes, everything else exact."""

    def q(a: np.ndarray, s: float) -> np.ndarray:
        scaled = np.clip(a.astype(np.float64) / np.float32(s), -LIMIT, LIMIT).astype(np.float32)
        return scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(np.float32(s))

    return q(x, sx) @ q(w, sw)


def measure(*, size: int, iters: int, repeats: int, check: int = 512) -> dict[str, Any]:
    """Compiles and times every form on ``size``-square bf16 operands.

    Example:
      >>> result = measure(size=64, iters=2, repeats=2, check=64)
      >>> result["forms"]["qdq_f32"]["relative_error"] < 0.1, result["forms"]["direct"]["fp8_values"] > 0
      (True, True)
    """
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (size, size), jnp.float32) * 0.02).astype(jnp.bfloat16)
    sx, sw = jnp.float32(3.7 / LIMIT * 1.3), jnp.float32(0.08 / LIMIT * 1.3)
    reference = _reference(np.asarray(x[:check], np.float32), np.asarray(w, np.float32), float(sx), float(sw))
    scale = float(np.abs(reference).max())
    out: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "size": size}
    forms: dict[str, Any] = {}
    for name, form in FORMS.items():
        compiled = jax.jit(form).lower(x, w, sx, sw).compile()
        hlo = compiled.as_text() or ""
        y = np.asarray(compiled(x, w, sx, sw)[:check], np.float64)
        best = float("inf")
        for _ in range(repeats):
            jax.block_until_ready(compiled(x, w, sx, sw))
            start = time.perf_counter()
            for _ in range(iters):
                result = compiled(x, w, sx, sw)
            jax.block_until_ready(result)
            best = min(best, (time.perf_counter() - start) / iters)
        forms[name] = {
            "fp8_gemms": hlo.count("__cublas$lt$matmul$f8"),
            "fp8_values": len(re.findall(r"f8e[45]m[23]", hlo)),
            "ms": 1e3 * best,
            "tflops": 2 * size**3 / best / 1e12,
            "relative_error": float(np.abs(y - reference).max() / scale),
        }
    out["forms"] = forms
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_gemm_forms", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    return print_result(measure(size=args.size, iters=args.iters, repeats=args.repeats), args.json)


if __name__ == "__main__":
    sys.exit(main())
