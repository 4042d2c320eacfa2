"""``leanstep plan`` and ``leanstep audit``: flags in, :mod:`leanstep.training.analysis` called, tables out.

Size: two commands, plan and audit, that share their flags and tables; what they compute is
leanstep.training.analysis.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from leanstep.cli.flags import (
    HelpFormatter,
    accelerator_of,
    add_compile_cache_flag,
    add_run_flags,
    check_plan_flags,
    int_list,
    remat_help,
    run_config,
)
from leanstep.cli.jsontree import InputError


def add_parsers(subparsers: Any) -> None:
    """Registers ``plan`` and ``audit``."""
    from leanstep.training import RunConfig

    d = RunConfig()
    p = subparsers.add_parser(
        "plan",
        help="pick microbatches and remat (and, for --devices N, the mesh) for a memory budget, without running",
        description="Compiles (never runs) the train step for every number of microbatches that divides the "
        "batch and every remat policy, reads XLA's memory accounting of each executable (arguments + outputs "
        "- donated + temporaries) and its FLOPs, and picks the fastest setting that fits the budget: fewest "
        "FLOPs (within 2%), then fewest microbatches. With --devices N it plans a cluster of N devices "
        "(compiled for N simulated CPU devices): also the mesh (data x fsdp x tensor) and the gradient "
        "reduction, per device, choosing the setting a cost model of --accelerator predicts fastest.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--budget",
        default=None,
        help="memory budget (per device with --devices): 512MiB, 2GiB, 1.5GB or a number of bytes; "
        "with --devices the default is the accelerator's memory",
    )
    add_run_flags(p, d)
    groups: dict[str, Any] = {}
    for title, flag, options in _plan_flags():
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        groups[title].add_argument(flag, **options)
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the plan as JSON")
    add_compile_cache_flag(p)
    p.set_defaults(run=run_plan)
    _add_audit_parser(subparsers, d)


def _plan_flags() -> list[tuple[str, str, dict[str, Any]]]:
    """``leanstep plan``'s own flags: ``(argument group, flag, add_argument keywords)``."""
    from leanstep.blocks.rematerialization import REMAT_POLICIES
    from leanstep.planning.cost_model import ACCELERATORS

    c, s, preset, link = "cluster (--devices)", "search", "override the preset's", "bytes/s per device one way"
    prices = "the device the cost model prices (presets: see leanstep.planning.cost_model)"
    counts = "comma-separated counts to consider (default: %(default)s, meaning every divisor of --batch-size)"
    every = "compile every candidate, not only those that could be chosen"
    return [
        (c, "--devices", dict(type=int, help="plan for this many devices")),
        (c, "--accelerator", dict(default="h100", choices=tuple(ACCELERATORS), help=prices)),
        (c, "--mesh", dict(metavar="AXES", help="plan this mesh only, e.g. data=8,fsdp=8")),
        (c, "--reductions", dict(default="auto,step", help="comma-separated gradient reductions to consider")),
        (c, "--peak-flops", dict(type=float, help=f"{preset} peak FLOP/s")),
        (c, "--bandwidth", dict(type=float, help=f"{preset} in-node bandwidth, {link}")),
        (c, "--inter-bandwidth", dict(type=float, help=f"{preset} bandwidth between nodes, {link}")),
        (c, "--node-size", dict(type=int, help=f"{preset} devices per node")),
        (c, "--efficiency", dict(type=float, help="override the fraction of peak FLOP/s reached (preset 0.5)")),
        (s, "--remat-policies", dict(default=",".join(REMAT_POLICIES), help="comma-separated policies to consider")),
        (s, "--microbatch-counts", dict(type=int_list, help=counts)),
        (s, "--max-microbatches", dict(type=int, help="consider at most this many microbatches")),
        (s, "--all", dict(dest="exhaustive", action="store_true", help=every)),
    ]


def _add_audit_parser(subparsers: Any, d: Any) -> None:
    a = subparsers.add_parser(
        "audit",
        help="show what the train step really does: scans, remat, residuals, matmul dtypes, host syncs",
        description="Traces (never runs) the train step leanstep train would run and reports its scans and "
        "their lengths, remat regions and policies, the residuals one microbatch saves for the backward pass, "
        "matmuls outside any scan, the dtypes every matmul runs in, and host syncs; then checks the "
        "gradient-accumulation and remat rules.",
        formatter_class=HelpFormatter,
    )
    add_run_flags(a, d)
    a.add_argument("--microbatches", type=int, default=d.microbatches, help="must divide --batch-size")
    a.add_argument("--remat", default=d.remat, help=remat_help())
    a.add_argument(
        "--offload", choices=("none", "opt_state"), default="none",
        help="opt_state: also compile the step with the optimizer state in host memory, report device and host "
        "bytes and transfers, and fail if it moves nothing or does not lower the device peak",
    )  # fmt: skip
    add_compile_cache_flag(a)
    a.set_defaults(run=run_audit)


def _table(result: Any, budget: int | None, chosen: Any) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from leanstep.common.memory_sizes import format_bytes

    arguments = next((c.argument_bytes for c in result if c.argument_bytes is not None), None)
    # --precision auto as plan_run resolved it (leanstep.training.machine_size): the candidates'
    precision = ", ".join(dict.fromkeys(c.setting.precision for c in result)) or "none"
    table = Table(
        title=f"budget {format_bytes(budget)} ({budget or 0:,} bytes), precision {precision}",
        box=box.SIMPLE,
        caption=f"peak = arguments ({format_bytes(arguments)}) + outputs - donated + temporaries; "
        "skipped: could not be chosen, not compiled (nor traced: no FLOPs)",
    )
    for name in ("", "microbatches", "remat", "peak", "temporaries", "FLOPs", "fits"):
        table.add_column(name, justify="left" if name in ("", "remat", "fits") else "right", no_wrap=True)
    for c in result:
        fits = Text("skipped") if c.fits is None else (Text("yes") if c.fits else Text("no", style="red"))
        cells = (
            "->" if c is chosen else "",
            str(c.setting.num_microbatches),
            "in backward" if c.setting.update_in_backward else c.setting.remat,
            format_bytes(c.peak_bytes),
            format_bytes(c.temp_bytes),
            "-" if c.flops is None else _si(c.flops),
        )
        table.add_row(*(Text(str(cell)) for cell in cells), fits, style="bold green" if c is chosen else None)
    return table


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def run_plan(args: argparse.Namespace) -> int:
    """Plans, prints the table and the choice, writes ``--json``.

    Returns:
      0; 1 when no setting fits the budget, or when ``--json`` could not be written at the end
      (the plan is then printed on stdout as JSON, and one stderr line names the path).

    Raises:
      InputError: a flag is invalid; ``--json`` cannot be written there (checked before planning).
    """
    from rich.console import Console
    from rich.text import Text

    from leanstep.common.outputs import check_output_path
    from leanstep.planning.one_device import BudgetError

    check_plan_flags(args)  # a flag that would be ignored, an empty list, a mesh the devices cannot hold
    try:
        json_path = None if args.json_path is None else check_output_path(args.json_path, what="--json")
    except ValueError as error:
        raise InputError(str(error)) from None
    cluster = args.devices is not None or args.mesh is not None
    if args.devices is not None:
        _configure_devices(args.devices)
    budget = _budget(args, cluster)
    # --budget and --accelerator are the plan's here, not a budget the run plans for itself
    mesh = {"mesh": args.mesh} if args.mesh else {}
    config = run_config(args, microbatches=1, remat="none", budget=None, accelerator="h100", **mesh)
    console = Console()
    try:
        result = _cluster_plan(args, config, budget) if cluster else _one_device_plan(args, config, budget)
    except BudgetError as error:
        if cluster:
            console.print(_cluster_table(error.candidates, error.budget_bytes, None, None))
        else:
            console.print(_table(error.candidates, budget, None))
        console.print(Text.assemble(("leanstep plan:", "bold red"), f" {error}"))
        failed = {"budget_bytes": error.budget_bytes, "chosen": None, "error": str(error)}
        _write_json(json_path, {**failed, "candidates": [c.to_json() for c in error.candidates]})
        return 1
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
    if cluster:
        console.print(_cluster_table(result.candidates, result.budget_bytes, result.chosen, result.accelerator))
    else:
        console.print(_table(result.candidates, budget, result.chosen))
    console.print(
        Text(
            f"chosen: {result.chosen.setting.describe()}  (planned in {result.seconds:.1f} s, "
            f"{result.compiles} compiles taking {result.compile_seconds:.1f} s)"
        )
    )
    for note in result.notes:
        console.print(Text(f"note: {note}"))
    return 0 if _write_json(json_path, result.to_json()) else 1


def _configure_devices(devices: int) -> None:
    from leanstep.sharding.distributed import configure_devices

    try:  # before JAX starts: the planner compiles for this many simulated CPU devices
        configure_devices(devices)
    except ValueError as error:
        raise InputError(str(error).replace("num_devices", "--devices")) from None
    except RuntimeError:  # JAX already runs (an embedding process): plan_run plans in a subprocess
        pass


def _budget(args: argparse.Namespace, cluster: bool) -> int | None:
    from leanstep.common.memory_sizes import parse_bytes

    if args.budget is None and not cluster:
        raise InputError("--budget is required (per device with --devices), e.g. --budget 2GiB")
    try:
        return None if args.budget is None else parse_bytes(args.budget)
    except ValueError as error:
        raise InputError(f"--budget: {error}") from None


def _split(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _one_device_plan(args: argparse.Namespace, config: Any, budget: int | None) -> Any:
    from leanstep.planning.one_device import settings_grid
    from leanstep.training.analysis import plan_run

    candidates = settings_grid(
        config.batch_size,
        remat_policies=_split(args.remat_policies),
        precisions=(config.precision,),
        microbatches=args.microbatch_counts,
        max_microbatches=getattr(args, "max_microbatches", None),
    )
    return plan_run(config, budget, candidates=candidates, exhaustive=args.exhaustive)


def _cluster_plan(args: argparse.Namespace, config: Any, budget: int | None) -> Any:
    from rich.console import Console

    from leanstep.training.analysis import plan_run

    accelerator = accelerator_of(args)
    log = Console(stderr=True)
    return plan_run(
        config,
        budget,
        num_devices=args.devices,
        accelerator=accelerator,
        remat_policies=_split(args.remat_policies),
        microbatches=args.microbatch_counts,
        max_microbatches=getattr(args, "max_microbatches", None),
        progress=lambda line: log.print(line, highlight=False, markup=False),
        reductions=_split(args.reductions),
        exhaustive=args.exhaustive,
    )


#: The columns of the cluster table.
_CLUSTER_COLUMNS: tuple[str, ...] = ("", "mesh", "reduce", "remat", "micro", "peak", "GFLOP/dev", "GB/step")
_CLUSTER_COLUMNS += ("compute", "comm", "predicted", "why not chosen")


def _cluster_table(candidates: Any, budget: int, chosen: Any, accelerator: Any) -> Any:
    """One row per family (mesh, reduction, remat): its best compiled member, else its first."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from leanstep.common.memory_sizes import format_bytes
    from leanstep.planning.cluster_grid import format_seconds
    from leanstep.planning.records import family_rows

    rows = family_rows(candidates, chosen)
    families = {c.setting[1:] for c in candidates}
    compiles = sum(c.compiled for c in candidates)
    where = (
        ""
        if accelerator is None
        else (
            f"; {accelerator.name}: {accelerator.flops} FLOP/s peak x {accelerator.efficiency}, "
            f"{accelerator.bandwidth / 1e9:g} GB/s in a node of {accelerator.node_size}, "
            f"{'-' if accelerator.inter_bandwidth is None else f'{accelerator.inter_bandwidth / 1e9:g}'} GB/s across"
        )
    )
    table = Table(
        title=f"budget {format_bytes(budget)} per device{where}",
        box=box.SIMPLE,
        caption=f"{len(candidates)} candidates in {len(families)} families (mesh, reduce, remat), one row "
        f"each; {compiles} compiled. peak = per-device arguments + outputs - donated + temporaries; "
        "predicted = dot FLOPs / (peak FLOP/s x efficiency) + collectives (leanstep.planning.cost_model)",
    )
    for name in _CLUSTER_COLUMNS:
        table.add_column(
            name,
            justify="left" if name in ("", "mesh", "reduce", "remat", "why not chosen") else "right",
            no_wrap=name not in ("mesh", "why not chosen"),
            overflow="fold",
        )
    for c in rows:
        s = c.setting
        seconds = lambda v: "-" if v is None else format_seconds(v)
        cells = (
            "->" if c is chosen else "",
            s.mesh,
            s.reduce,
            s.remat,
            str(s.num_microbatches),
            format_bytes(c.peak_bytes),
            "-" if c.flops is None else f"{c.flops / 1e9:,.1f}",
            "-" if c.bytes_per_step is None else f"{c.bytes_per_step / 1e9:.3f}",
            seconds(c.compute_seconds),
            seconds(c.communication_seconds),
            seconds(c.predicted_seconds),
            c.note,
        )
        table.add_row(*(Text(str(cell)) for cell in cells), style="bold green" if c is chosen else None)
    return table


def _write_json(path: Path | None, value: Any) -> bool:
    """Writes ``value`` to ``--json`` atomically; returns False if that failed.

    The plan is not lost to a full disk: it is printed on stdout instead, and one line on stderr
    names the path and the reason.
    """
    from leanstep.common.outputs import write_bytes_atomic

    if path is None:
        return True
    text = json.dumps(value, indent=2) + "\n"
    try:
        write_bytes_atomic(path, text.encode("utf-8"))
    except OSError as error:
        sys.stdout.write(text)
        print(
            f"leanstep plan: error: could not write --json {str(path)!r} ({error.strerror or error}); "
            "the plan is printed on stdout as JSON",
            file=sys.stderr,
        )
        return False
    return True


def run_audit(args: argparse.Namespace) -> int:
    from leanstep.training.analysis import audit_run

    config = run_config(args)
    try:
        report = audit_run(config)
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
    print(report)
    if config.optimizer != "adamw":
        print(
            f"(audited with AdamW's update in place of --optimizer {config.optimizer}'s: the rules are the gradient's)"
        )
    in_backward = config.update_in_backward == "on"
    rules, problems = report.run_rules(config.microbatches, config.remat, in_backward=in_backward)
    print(f"rules ({rules}): " + ("ok" if not problems else "BROKEN"))
    for problem in problems:
        print(f"  - {problem}")
    return (0 if not problems else 1) | _audit_offload(config, getattr(args, "offload", "none"))


def _audit_offload(config: Any, offload: str) -> int:
    """``--offload opt_state``: both steps' memory spaces, and the verdict (1: refused)."""
    if offload == "none":
        return 0
    from leanstep.inspection.memory_spaces import check_offload
    from leanstep.training.analysis import offload_audit_run

    plain, offloaded = offload_audit_run(config)
    print(f"state on the device: {plain}\noptimizer state offloaded: {offloaded}")
    try:
        check_offload(offloaded, plain)
    except ValueError as error:
        print(f"offload (--offload opt_state): REFUSED: {error}")
        return 1
    print("offload (--offload opt_state): ok")
    return 0
