"""``leanstep plan`` and ``leanstep audit``: flags in, :mod:`leanstep.training.analysis` called, tables out."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from leanstep.cli.flags import add_run_flags, remat_help
from leanstep.cli.jsontree import InputError


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, got {text!r}") from None


def add_parsers(subparsers: Any) -> None:
    """Registers ``plan`` and ``audit``."""
    from leanstep.rematerialization import REMAT_POLICIES
    from leanstep.training import RunConfig

    d = RunConfig()
    p = subparsers.add_parser(
        "plan",
        help="pick microbatches and remat policy for a memory budget, without running",
        description="Compiles (never runs) the train step for every number of microbatches that divides the "
        "batch and every remat policy, reads XLA's memory accounting of each executable (arguments + outputs "
        "- donated + temporaries) and its FLOPs, and picks the fastest setting that fits the budget: fewest "
        "FLOPs (within 2%), then fewest microbatches.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--budget", required=True, default=argparse.SUPPRESS,
                   help="memory budget: 512MiB, 2GiB, 1.5GB or a number of bytes")
    add_run_flags(p, d)
    search = p.add_argument_group("search")
    search.add_argument("--remat-policies", default=",".join(REMAT_POLICIES),
                        help="comma-separated policies to consider")
    search.add_argument("--microbatch-counts", type=_int_list, default=None,
                        help="comma-separated counts to consider (default: %(default)s, meaning every divisor "
                        "of --batch-size)")
    search.add_argument("--all", dest="exhaustive", action="store_true",
                        help="compile every candidate, not only those that could be chosen")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the plan as JSON")
    p.set_defaults(run=run_plan)

    a = subparsers.add_parser(
        "audit",
        help="show what the train step really does: scans, remat, residuals, matmul dtypes, host syncs",
        description="Traces (never runs) the train step leanstep train would run and reports its scans and "
        "their lengths, remat regions and policies, the residuals one microbatch saves for the backward pass, "
        "matmuls outside any scan, the dtypes every matmul runs in, and host syncs; then checks the "
        "gradient-accumulation and remat rules.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_run_flags(a, d)
    a.add_argument("--microbatches", type=int, default=d.microbatches, help="must divide --batch-size")
    a.add_argument("--remat", default=d.remat, help=remat_help())
    a.set_defaults(run=run_audit)


def _config(args: argparse.Namespace, **fixed: Any) -> Any:
    from leanstep.training import RunConfig

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        return RunConfig(**{**{k: v for k, v in vars(args).items() if k in fields}, **fixed}).validate()
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None


def _table(result: Any, budget: int, chosen: Any, precision: str) -> Any:
    from rich import box
    from rich.table import Table

    from leanstep.memory_sizes import format_bytes

    arguments = next((c.argument_bytes for c in result if c.argument_bytes is not None), None)
    table = Table(title=f"budget {format_bytes(budget)} ({budget:,} bytes), precision {precision}", box=box.SIMPLE,
                  caption=f"peak = arguments ({format_bytes(arguments)}) + outputs - donated + temporaries; "
                  "skipped: could not be chosen, not compiled (nor traced: no FLOPs)")
    for name in ("", "microbatches", "remat", "peak", "temporaries", "FLOPs", "fits"):
        table.add_column(name, justify="left" if name in ("", "remat", "fits") else "right", no_wrap=True)
    for c in result:
        fits = "skipped" if c.fits is None else ("yes" if c.fits else "[red]no")
        table.add_row("->" if c is chosen else "", str(c.setting.num_microbatches), c.setting.remat,
                      format_bytes(c.peak_bytes), format_bytes(c.temp_bytes), "-" if c.flops is None else _si(c.flops), fits,
                      style="bold green" if c is chosen else None)
    return table


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def run_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from leanstep.memory_sizes import parse_bytes
    from leanstep.planning import BudgetError, settings_grid
    from leanstep.training.analysis import plan_run

    try:
        budget = parse_bytes(args.budget)
    except ValueError as error:
        raise InputError(f"--budget: {error}") from None
    config = _config(args, microbatches=1, remat="none")  # planned, not taken from flags
    policies = [name.strip() for name in args.remat_policies.split(",") if name.strip()]
    try:
        candidates = settings_grid(config.batch_size, remat_policies=policies, precisions=(config.precision,),
                                   microbatches=args.microbatch_counts)
    except ValueError as error:
        raise InputError(str(error)) from None
    console = Console()
    try:
        result = plan_run(config, budget, candidates=candidates, exhaustive=args.exhaustive)
    except BudgetError as error:
        console.print(_table(error.candidates, budget, None, config.precision))
        _write_json(args.json_path, {"budget_bytes": budget, "chosen": None, "error": str(error),
                                     "candidates": [c.to_json() for c in error.candidates]})
        console.print(f"[bold red]leanstep plan:[/] {error}")
        return 1
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
    console.print(_table(result.candidates, budget, result.chosen, config.precision))
    s = result.chosen.setting
    console.print(f"chosen: --microbatches {s.num_microbatches} --remat {s.remat}  (planned in {result.seconds:.1f} s, {result.compiles} compiles)")
    _write_json(args.json_path, result.to_json())
    return 0


def _write_json(path: str | None, value: Any) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(value, indent=2) + "\n")


def run_audit(args: argparse.Namespace) -> int:
    from leanstep.training.analysis import audit_run

    config = _config(args)
    try:
        report = audit_run(config)
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
    print(report)
    problems = report.accumulation_violations(config.microbatches)
    if config.remat != "none":
        problems += report.remat_violations(config.remat)
    loop = ("one microbatch: no microbatch loop, no gradient through a scan" if config.microbatches == 1 else
            "one scan over the microbatches, value_and_grad in its body, no matmul outside a scan")
    print(f"rules ({loop}" + (f", remat policy {config.remat}" if config.remat != "none" else "") + "): "
          + ("ok" if not problems else "BROKEN"))
    for problem in problems:
        print(f"  - {problem}")
    return 0 if not problems else 1
