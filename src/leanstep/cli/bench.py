"""``leanstep bench``: flags in, :func:`leanstep.bench.run_benchmark` called, table/JSON/chart out."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from leanstep.cli.jsontree import InputError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4,8, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _policy_list(text: str) -> tuple[str, ...]:
    # "save:a,b" contains a comma itself, so policies are separated by ';'.
    values = tuple(part.strip() for part in text.split(";") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected ';'-separated remat policies, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    """Registers ``leanstep bench`` on an ``argparse`` subparsers object."""
    from leanstep.models import SIZES

    p = subparsers.add_parser(
        "bench",
        help="measure leanstep's step against a hand-written JAX step, PyTorch and the matmul limit",
        description="Times leanstep's train step interleaved (A B A B ...) with the same step written by hand in "
        "JAX and in PyTorch (if installed), reports XLA's compiled memory for every microbatch count and remat "
        "policy, and the machine's measured matmul throughput with leanstep's MFU against it. Prints a table, "
        "writes a PNG chart and, with --json, the numbers. Default: the model and batch of `leanstep train` "
        "(about 5-10 minutes on 2 cores); --quick: a tiny model in about 2 minutes.",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, fewer settings and repeats")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write every number as JSON to FILE")
    p.add_argument("--chart", metavar="FILE", default="bench.png", help="PNG chart path, 'none' for no chart (default bench.png)")
    p.add_argument("--size", choices=SIZES, help="model size preset (default: small; tiny with --quick)")
    p.add_argument("--batch-size", type=int, help="batch size (default 16)")
    p.add_argument("--microbatches", type=int, help="microbatches for the comparisons (default 2)")
    p.add_argument("--remat", help="remat policy for leanstep vs hand-written (default dots)")
    p.add_argument("--microbatch-sweep", type=_int_list, metavar="N,N,...",
                   help="microbatch counts for the memory sweep (default 1,2,4,8; 1,2,4 with --quick)")
    p.add_argument("--remat-sweep", type=_policy_list, metavar="P;P;...",
                   help="';'-separated remat policies for the memory sweep "
                   "(default none;full;dots;dots_no_batch;save:attn_out,mlp_hidden; full;dots with --quick)")
    p.add_argument("--repeats", type=int, help="timed steps per JAX contender (default 10; 50 with --quick)")
    p.add_argument("--torch-repeats", type=int, help="timed steps per PyTorch contender (default 3; 5 with --quick)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip the PyTorch contenders")
    p.add_argument("--torch-compile", dest="torch_compile", action="store_true", default=None,
                   help="also time torch.compile'd models (default on; off with --quick)")
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    p.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: the cores JAX uses)")
    p.add_argument("--matmul-size", type=int, help="largest square matmul for the peak (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run_bench)


_FIELDS = {"size": "size", "batch_size": "batch_size", "microbatches": "num_microbatches", "remat": "remat",
           "microbatch_sweep": "microbatch_sweep", "remat_sweep": "remat_sweep", "repeats": "repeats",
           "torch_repeats": "torch_repeats", "torch_compile": "torch_compile", "torch_threads": "torch_threads",
           "matmul_size": "matmul_size"}


def _config(args: argparse.Namespace) -> Any:
    from leanstep.bench.runner import BenchConfig

    changes = {field: getattr(args, flag) for flag, field in _FIELDS.items() if getattr(args, flag) is not None}
    changes.update(torch=args.torch, seed=args.seed)
    try:
        if args.quick:
            return BenchConfig.quick(**changes)
        return BenchConfig.full(**{"torch_compile": True, **changes})
    except (TypeError, ValueError) as error:
        raise InputError(_flag_names(str(error))) from None


def _flag_names(message: str) -> str:
    """Names config fields in an error message by their flags (``num_microbatches`` -> ``--microbatches``)."""
    flags = {field: "--" + flag.replace("_", "-") for flag, field in _FIELDS.items() if field != "size"}
    pattern = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    return re.sub(rf"\b({pattern})\b", lambda match: flags[match.group(1)], message)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def run_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark the flags describe; returns the exit code (0)."""
    from rich.console import Console

    from leanstep.bench.chart import plot_benchmark
    from leanstep.bench.runner import run_benchmark
    from leanstep.cli.bench_table import render_benchmark

    config = _config(args)
    for path in (args.json_path, None if args.chart == "none" else args.chart):
        if path is not None and Path(path).is_dir():
            raise InputError(f"{path!r} is a directory; expected a file path")
    start = time.perf_counter()
    stderr = Console(stderr=True)

    def log(message: str) -> None:
        if not args.quiet:
            stderr.print(f"[dim][{time.perf_counter() - start:6.1f}s] {message}[/dim]", highlight=False)

    result = run_benchmark(config, log=log)
    result["wall_s"] = time.perf_counter() - start
    result["command"] = "leanstep bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    Console(width=max(Console().width, 150)).print(render_benchmark(result))
    if args.chart != "none":
        Path(args.chart).parent.mkdir(parents=True, exist_ok=True)
        plot_benchmark(result, args.chart)
        log(f"chart written to {args.chart}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(_json_safe(result), indent=2) + "\n")
        log(f"JSON written to {args.json_path}")
    return 0
