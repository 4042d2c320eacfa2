"""``leanstep bench --speedrun``: flags in, :func:`leanstep.bench.speedrun.run_speedrun` called, a table out."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from leanstep.cli.jsontree import InputError, write_json_or_print

__all__ = ["add_speedrun_flags", "check_no_speedrun_flags", "render_speedrun", "run_speedrun_command"]

#: ``(flag, RunConfig field)`` that the speedrun takes from ``leanstep bench``'s own flags.
_RUN_FLAGS = (
    ("--size", "size"),
    ("--batch-size", "batch_size"),
    ("--microbatches", "microbatches"),
    ("--remat", "remat"),
    ("--seed", "seed"),
)
#: Flags of the step benchmark that mean nothing to the speedrun (each defaults to None or False).
_STEP_BENCH_FLAGS = (
    ("--quick", "quick"),
    ("--microbatch-sweep", "microbatch_sweep"),
    ("--remat-sweep", "remat_sweep"),
    ("--repeats", "repeats"),
    ("--torch-repeats", "torch_repeats"),
    ("--torch-threads", "torch_threads"),
    ("--matmul-size", "matmul_size"),
)
#: The speedrun's own flags, refused without ``--speedrun``.
_SPEEDRUN_FLAGS = (("--time-budget", "time_budget"), ("--out", "out"), ("--data", "data"))
DEFAULT_BUDGET, DEFAULT_OUT, DEFAULT_CHART = "3m", "runs/speedrun", "bench.png"


def add_speedrun_flags(parser: argparse.ArgumentParser) -> None:
    """Adds ``--speedrun`` and its flags to ``leanstep bench``'s parser."""
    group = parser.add_argument_group(
        "speedrun",
        "held-out bits per byte at equal wall-clock: leanstep's run, a PyTorch peer of it, gzip -9 and xz -9e",
    )
    group.add_argument(
        "--speedrun",
        action="store_true",
        help="train leanstep, then the same model in PyTorch, each for --time-budget, and compare "
        "held-out bits per byte with gzip -9 and xz -9e (takes --size, --batch-size, "
        "--microbatches, --remat, --seed, --no-torch, --torch-compile/--no-torch-compile, --json; "
        "the peer compiles by default on a GPU, runs eager on a CPU)",
    )
    group.add_argument(
        "--time-budget",
        metavar="DURATION",
        help=f"each contender's wall-clock, e.g. 3m, 180s, 1.5m, 1h (default {DEFAULT_BUDGET})",
    )
    group.add_argument("--out", metavar="DIR", help=f"leanstep's run goes to DIR/leanstep (default {DEFAULT_OUT})")
    group.add_argument("--data", metavar="PATH", help="the corpus, as for leanstep train (default: the stdlib)")


def check_no_speedrun_flags(args: argparse.Namespace) -> None:
    """Raises InputError naming a speedrun flag given without ``--speedrun``."""
    for flag, name in _SPEEDRUN_FLAGS:
        if getattr(args, name) is not None:
            raise InputError(f"{flag} is a flag of --speedrun; add --speedrun, or leave {flag} out")


def _speedrun_config(args: argparse.Namespace) -> tuple[float, Any]:
    """The budget in seconds and the :class:`RunConfig` the flags describe, every flag checked."""
    from leanstep.training import RunConfig
    from leanstep.training.budget import parse_duration

    for flag, name in _STEP_BENCH_FLAGS:
        if getattr(args, name) not in (None, False):
            raise InputError(f"{flag} is a flag of the step benchmark; --speedrun does not take it")
    if args.chart != DEFAULT_CHART:
        raise InputError("--chart: --speedrun draws no chart (its numbers go to the table and --json)")
    try:
        budget = parse_duration(DEFAULT_BUDGET if args.time_budget is None else args.time_budget, "--time-budget")
        fields = {name: getattr(args, name) for _, name in _RUN_FLAGS if getattr(args, name) is not None}
        config = RunConfig(**fields, data=args.data, steps=None, time_budget=budget).validate()
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
    return budget, config


def _number(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_speedrun(result: dict[str, Any]) -> Any:
    """The table (a rich ``Group``) of :func:`leanstep.bench.speedrun.run_speedrun`'s result, and a line per choice."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    budget = result["budget_s"]
    table = Table(
        title=f"speedrun: held-out bits per byte after {budget:g} s of wall-clock each (lower is better)",
        title_justify="left",
    )
    for name in ("contender", "all held-out", "in run", "steps", "tokens", "seconds", "compile s", "precision"):
        table.add_column(name, justify="left" if name in ("contender", "precision") else "right")
    notes = []
    for key, label in (("leanstep", "leanstep"), ("pytorch", "PyTorch")):
        row = result["contenders"].get(key)
        if row is None:
            continue
        if "skipped" in row:
            table.add_row(Text(label), *(Text("-") for _ in range(7)))
            notes.append(f"{label}: skipped: {row['skipped']}")
            continue
        if key == "pytorch":
            label += " (torch.compile)" if row["torch_compile"] else " (eager)"
            notes.append(
                f"PyTorch torch.compile: {row['torch_compile_reason']}; {row['remat_reason']}; "
                f"AdamW {row['adamw']}; {row['torch_threads']} threads"
            )
        notes.append(f"{label} precision: {row['precision_reason']}")
        if row.get("stopped_at_budget"):
            notes.append(
                f"{label} ran slower than planned and stopped at step {row['steps']} of {row['planned_steps']}"
            )
        table.add_row(
            *(
                Text(cell)
                for cell in (
                    label,
                    _number(row.get("heldout_bits_per_byte_all"), ".4f"),
                    _number(row["heldout_bits_per_byte"], ".4f"),
                    f"{row['steps']:,}",
                    f"{row['tokens']:,}",
                    _number(row["wall_s"], ".1f"),
                    _number(row.get("compile_s"), ".1f"),
                    row["precision"],
                )
            )
        )
    references = result["references"]
    for key in ("gzip", "xz"):
        reference = references[key]
        table.add_row(
            *(
                Text(cell)
                for cell in (reference["command"], f"{reference['bits_per_byte']:.4f}", "-", "-", "-", "-", "-", "-")
            )
        )
    notes.append(
        f"gzip and xz compress all {references['bytes']:,} held-out bytes; 'all held-out' scores each "
        f"model's final weights on every window of them ({references['windows_bytes']:,} bytes, after the "
        "budget); 'in run' is the run's own estimate, on windows spread over them"
    )
    machine = result["machine"]
    notes.append(
        f"machine: {machine.get('cpu_model')}, {machine.get('cores_available')} cores, jax "
        f"{machine.get('jax')}" + (f", torch {machine['torch']}" if "torch" in machine else "")
    )
    return Group(table, *(Text(f"  {note}", style="dim") for note in notes))


def run_speedrun_command(args: argparse.Namespace) -> int:
    """``leanstep bench --speedrun``: checks every flag and ``--json`` first, runs, prints; the exit code.

    Raises:
      InputError: a flag is invalid, ``--json`` cannot be written, or leanstep's run does not fit
        ``--out`` or the budget.
    """
    from rich.console import Console
    from rich.text import Text

    from leanstep.bench.speedrun import run_speedrun
    from leanstep.common.outputs import check_output_path
    from leanstep.training import RunStopped

    budget, config = _speedrun_config(args)
    try:
        json_path = None if args.json_path is None else check_output_path(args.json_path, what="--json")
    except ValueError as error:
        raise InputError(str(error)) from None
    start, stderr = time.perf_counter(), Console(stderr=True)

    def log(message: str) -> None:
        if not args.quiet:  # Text, not markup: a path like runs/a[/b] is printed as it is
            stderr.print(Text(f"[{time.perf_counter() - start:6.1f}s] {message}", style="dim"), highlight=False)

    try:
        result = run_speedrun(
            budget,
            config=config,
            out=DEFAULT_OUT if args.out is None else args.out,
            torch_peer=args.torch,
            torch_compile=args.torch_compile,
            log=log,
        )
    except ValueError as error:
        raise InputError(str(error)) from None
    except RunStopped as stopped:
        stderr.print(Text.assemble(("leanstep bench: ", "bold red"), str(stopped)), soft_wrap=True)
        return stopped.exit_code
    result["command"] = "leanstep bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    Console(width=max(Console().width, 120)).print(render_speedrun(result))
    if json_path is not None and (failure := write_json_or_print(json_path, result, log)) is not None:
        print(
            f"leanstep bench: error: could not write {failure}; the table and the JSON are printed on stdout",
            file=sys.stderr,
        )
        return 1
    return 0
