"""``leanstep bench``: flags in, :func:`leanstep.bench.run_benchmark` called, table/JSON/chart out."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from leanstep.cli.bench_speedrun import (
    add_speedrun_flags,
    check_no_speedrun_flags,
    run_speedrun_command,
)
from leanstep.cli.flags import add_compile_cache_flag
from leanstep.cli.jsontree import InputError, write_json_or_print

if TYPE_CHECKING:
    from leanstep.bench.machine import Platform


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
        "writes a PNG chart and, with --json, the numbers. Default: the small transformer at batch 16 x 128 bytes "
        "(about 5-10 minutes on 2 cores); --quick: a tiny model in about 2 minutes. On an accelerator (TPU, GPU): a "
        "1024-wide transformer at sequence 1024 (4 layers with --quick, about a minute on a v5e; 8 without), MFU "
        "against the chip's dense bf16 peak, no torch rows.",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, fewer settings and repeats")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write every number as JSON to FILE")
    p.add_argument(
        "--chart", metavar="FILE", default="bench.png", help="PNG chart path, 'none' for no chart (default bench.png)"
    )
    p.add_argument("--size", choices=SIZES, help="model size preset (default: small; tiny with --quick)")
    p.add_argument("--batch-size", type=int, help="batch size (default 16)")
    p.add_argument("--microbatches", type=int, help="microbatches for the comparisons (default 2)")
    p.add_argument("--remat", help="remat policy for leanstep vs hand-written (default dots)")
    p.add_argument(
        "--microbatch-sweep",
        type=_int_list,
        metavar="N,N,...",
        help="microbatch counts for the memory sweep (default 1,2,4,8; 1,2,4 with --quick)",
    )
    p.add_argument(
        "--remat-sweep",
        type=_policy_list,
        metavar="P;P;...",
        help="';'-separated remat policies for the memory sweep "
        "(default none;full;dots;dots_no_batch;save:attn_out,mlp_hidden; full;dots with --quick)",
    )
    p.add_argument("--repeats", type=int, help="timed steps per JAX contender (default 10; 50 with --quick)")
    p.add_argument("--torch-repeats", type=int, help="timed steps per PyTorch contender (default 3; 5 with --quick)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip the PyTorch contenders")
    p.add_argument(
        "--torch-compile",
        dest="torch_compile",
        action="store_true",
        default=None,
        help="also time torch.compile'd models (default on; off with --quick)",
    )
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    p.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: the cores JAX uses)")
    p.add_argument(
        "--matmul-size", type=int, help="largest square matmul for the best-of-N peak (default 4096; 2048 with --quick)"
    )
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_speedrun_flags(p)
    add_compile_cache_flag(p)
    p.set_defaults(run=run_bench)


_FIELDS = {
    "size": "size",
    "batch_size": "batch_size",
    "microbatches": "num_microbatches",
    "remat": "remat",
    "microbatch_sweep": "microbatch_sweep",
    "remat_sweep": "remat_sweep",
    "repeats": "repeats",
    "torch_repeats": "torch_repeats",
    "torch_compile": "torch_compile",
    "torch_threads": "torch_threads",
    "matmul_size": "matmul_size",
}


def _config(args: argparse.Namespace, platform: Platform | None = None) -> Any:
    """The flags' :class:`BenchConfig` for ``platform`` (None: this process's, :func:`detect_platform`)."""
    from leanstep.bench.config import BenchConfig
    from leanstep.bench.machine import detect_platform

    changes = {field: getattr(args, flag) for flag, field in _FIELDS.items() if getattr(args, flag) is not None}
    changes.update(torch=args.torch, seed=args.seed)
    if not args.quick:
        changes = {"torch_compile": True, **changes}
    try:
        return BenchConfig.for_platform(
            detect_platform() if platform is None else platform, quick=args.quick, **changes
        )
    except (TypeError, ValueError) as error:
        raise InputError(_flag_names(str(error))) from None


def _flag_names(message: str) -> str:
    """Names config fields in an error message by their flags (``num_microbatches`` -> ``--microbatches``)."""
    flags = {field: "--" + flag.replace("_", "-") for flag, field in _FIELDS.items() if field != "size"}
    pattern = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    return re.sub(rf"\b({pattern})\b", lambda match: flags[match.group(1)], message)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark the flags describe; returns the exit code.

    ``--json`` and ``--chart`` are checked before the benchmark runs (minutes of work never end
    in a path error). Should writing them still fail (a full disk), the results are not lost:
    the table is printed, the JSON goes to stdout instead, one stderr line names what could
    not be written, and the exit code is 1. Otherwise 0.

    Raises:
      InputError: a flag is invalid, or ``--json``/``--chart`` cannot be written there.
    """
    if args.speedrun:
        return run_speedrun_command(args)
    check_no_speedrun_flags(args)
    from rich.console import Console
    from rich.text import Text

    from leanstep.bench.chart import plot_benchmark
    from leanstep.bench.runner import run_benchmark
    from leanstep.cli.bench_table import render_benchmark
    from leanstep.common.outputs import check_output_path

    config = _config(args)
    try:
        json_path = None if args.json_path is None else check_output_path(args.json_path, what="--json")
        chart_path = None if args.chart == "none" else check_output_path(args.chart, what="--chart")
    except ValueError as error:
        raise InputError(str(error)) from None
    start = time.perf_counter()
    stderr = Console(stderr=True)

    def log(message: str) -> None:
        if not args.quiet:  # Text, not markup: a path like runs/a[/b] is printed as it is
            stderr.print(Text(f"[{time.perf_counter() - start:6.1f}s] {message}", style="dim"), highlight=False)

    result = run_benchmark(config, log=log)
    result["wall_s"] = time.perf_counter() - start
    result["command"] = "leanstep bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    Console(width=max(Console().width, 150)).print(render_benchmark(result))
    failed, shown = [], "the table is"
    if json_path is not None and (failure := write_json_or_print(json_path, result, log)) is not None:
        failed.append(failure)
        shown = "the table and the JSON are"
    if chart_path is not None:
        try:
            plot_benchmark(result, chart_path)
            log(f"chart written to {chart_path}")
        except OSError as error:
            failed.append(f"--chart {str(chart_path)!r} ({error.strerror or error})")
    if failed:
        print(
            f"leanstep bench: error: could not write {' nor '.join(failed)}; {shown} printed on stdout", file=sys.stderr
        )
        return 1
    return 0
