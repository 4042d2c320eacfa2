"""How fast 8-bit moments are coded and decoded on this device, by each way of finding a code.

``quantize`` finds each entry's code among the map's 255 midpoints: by a binary search
(``jnp.searchsorted`` "scan", "scan_unrolled": gathers), by sorting ("sort"), or by one fused
compare-and-count ("compare_all"). ``dequantize`` looks the code up in the 256 values: a gather
("take", leanstep's on a CPU), a compare-and-select over the 256 codes ("select"), or arithmetic
("arithmetic", leanstep's on an accelerator: ``leanstep.blocks.moments.decode``). Each is timed on ``--entries``
normal entries with a heavy tail, checked equal to "scan" / "take", and its nanoseconds an entry
reported; leanstep's choice per platform is ``leanstep.blocks.moments._ACCELERATOR_SEARCH``.

    python benchmarks/moment_codes.py                  # on the device JAX picks (2**24 entries)
    python benchmarks/moment_codes.py --entries 65536  # the CPU dry run the suite runs
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from leanstep.blocks import dynamic_map, moments

SEARCHES = ("scan", "scan_unrolled", "sort", "compare_all")
DECODES = ("take", "select", "arithmetic")


def _decode(form: str):
    values, _ = dynamic_map.map_tables(True)
    table = jnp.asarray(values)
    if form == "take":
        return lambda codes: table[codes.astype(jnp.int32)]
    if form == "arithmetic":
        return lambda codes: dynamic_map.decode_with(jnp, codes.astype(jnp.int32), True)
    # one compare-and-select per code, summed: no gather
    return lambda codes: jnp.sum(
        jnp.where(codes[:, None].astype(jnp.int32) == jnp.arange(256)[None, :], table[None, :], 0.0), axis=-1
    )


def _time(fn, x, repeats: int) -> float:
    fn(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(into: dict, fns: dict, x: jax.Array, args: argparse.Namespace) -> jax.Array:
    """Times each of ``fns`` on ``x`` into ``into[name]``, checked equal to the first's output; returns that."""
    reference = None
    for name, fn in fns.items():
        out = fn(x)
        reference = out if reference is None else reference
        seconds = _time(fn, x, args.repeats)
        into[name] = {"ns_an_entry": round(seconds * 1e9 / args.entries, 3), "same": bool(jnp.all(out == reference))}
        print(name, into[name], flush=True)
    assert reference is not None
    return reference


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--searches", default=",".join(SEARCHES))
    args = parser.parse_args(argv)
    keys = jax.random.split(jax.random.key(0))
    x = jax.random.normal(keys[0], (args.entries,)) * jnp.exp(3.0 * jax.random.normal(keys[1], (args.entries,)))
    x = x / jnp.max(jnp.abs(x))
    values, midpoints = dynamic_map.map_tables(True)
    mids = jnp.asarray(midpoints)
    report: dict = {"device": jax.devices()[0].device_kind, "entries": args.entries, "search": {}, "decode": {}}
    searches = {
        m: jax.jit(lambda v, m=m: moments._search(m)(mids, v).astype(jnp.uint8)) for m in args.searches.split(",")
    }
    reference = _measure(report["search"], searches, x, args)
    _measure(report["decode"], {form: jax.jit(_decode(form)) for form in DECODES}, reference, args)
    every = jnp.arange(256, dtype=jnp.uint8)  # each code, not only those the data hit
    report["decode_every_code_exact"] = bool(jnp.all(jax.jit(_decode("arithmetic"))(every) == jnp.asarray(values)))
    print("decode_every_code_exact", report["decode_every_code_exact"], flush=True)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
