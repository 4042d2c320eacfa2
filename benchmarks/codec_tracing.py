"""How long a lean step takes to lower (trace, then to StableHLO) with leanstep's jitted 8-bit codec,
against the same codec unjitted (``quantize``, ``decode`` and ``dequantize`` of
``leanstep.blocks.moments`` swapped for their ``__wrapped__`` functions), and what the step then
compiles to: the temporaries must be the same bytes.

The model: the 405M transformer of the TPU runs (d 2048, 8 layers, batch 16 x 1024, 2 microbatches),
bf16-sr masters and int8 moments, ``update_chunk="auto"``; its state from ``jax.eval_shape``, so
nothing is allocated.

    python benchmarks/codec_tracing.py --out trace.json   # on the device JAX picks
    python benchmarks/codec_tracing.py --tiny             # the CPU dry run the suite runs
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import leanstep
from leanstep.blocks import moments
from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss

_CODEC = {name: getattr(moments, name) for name in ("quantize", "decode", "dequantize")}


def _codec(jitted: bool) -> None:
    for name, fn in _CODEC.items():
        setattr(moments, name, fn if jitted else fn.__wrapped__)


def measure(config: TransformerConfig, rows: int, *, jitted: bool) -> dict:
    """Seconds to lower and to compile the step with the codec jitted or not, and its temporaries."""
    traced: dict[str, float] = {}

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        name = event.rsplit("/", 1)[-1]
        traced[name] = traced.get(name, 0.0) + duration_secs

    _codec(jitted)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        spec = leanstep.StepSpec.from_keywords(
            precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0, loss_scale="dynamic",
            master="bfloat16-sr", moments="int8", update_chunk="auto",
        )  # fmt: skip
        make = lambda key: leanstep.TrainState.create(init_transformer(key, config), optax.adamw(1e-3), spec)
        state = jax.eval_shape(make, jax.random.key(0))
        loss = functools.partial(transformer_loss, config=config, remat_policy="dots")
        step = leanstep.make_train_step(loss, spec)
        batch = {"tokens": jax.ShapeDtypeStruct((rows, config.seq_len + 1), jnp.int32)}
        traced.clear()
        started = time.perf_counter()
        lowered = step.lower(state, batch)
        result: dict[str, float | int | None] = {
            "lower_s": time.perf_counter() - started,
            "trace_s": traced.get("jaxpr_trace_duration", 0.0),
        }
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        _codec(True)
    started = time.perf_counter()
    compiled = lowered.compile()
    result["compile_s"] = time.perf_counter() - started
    memory = compiled.memory_analysis()
    result["temp_bytes"] = int(memory.temp_size_in_bytes) if memory is not None else None
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run: a 2-layer model of width 64")
    parser.add_argument("--out", default=None, help="write the report here as JSON")
    args = parser.parse_args(argv)
    d, layers, rows, seq = (64, 2, 4, 32) if args.tiny else (2048, 8, 16, 1024)
    config = TransformerConfig(
        vocab_size=256, d_model=d, n_layers=layers, n_heads=max(1, d // 128), d_ff=4 * d, seq_len=seq, attention="xla"
    )
    report = {
        "backend": jax.default_backend(),
        "model": {"d_model": d, "n_layers": layers, "rows": rows, "seq_len": seq},
        # unjitted first: the jitted codec's traces would otherwise be cached from the other arm
        "unjitted": measure(config, rows, jitted=False),
        "jitted": measure(config, rows, jitted=True),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return report


if __name__ == "__main__":
    main()
