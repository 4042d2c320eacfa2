"""``leanstep verify``: flags in, :func:`leanstep.training.verify_run.verify_run` called, a table out."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from leanstep.cli.flags import HelpFormatter, add_compile_cache_flag, add_run_flags, remat_help, run_config
from leanstep.cli.jsontree import InputError

#: ``leanstep verify``'s default device count for the mesh layouts (data=4, fsdp=4, data=2,tensor=2).
DEFAULT_DEVICES = 4

#: The flags that only verify's resume check (a run trained, killed and resumed) runs with, by field:
#: the other checks build the step from the model, precision, masters and microbatches
#: (:func:`leanstep.training.verify_run.verify_setup`), with float32 moments and no spike guard.
RESUME_ONLY = {"--moments": "moments", "--spike-guard": "spike_guard", "--spike-rollback": "spike_rollback"}


def add_parser(subparsers: Any) -> None:
    """Registers ``verify``."""
    from leanstep.training import RunConfig

    d = RunConfig()
    p = subparsers.add_parser(
        "verify",
        help="check the train step of these flags against itself: microbatches, clipping, guards, keys, FP8, int8, "
        "meshes",
        description="Runs metamorphic checks of the step leanstep train would run, on CPU, each against a reference "
        "with a derived tolerance: M microbatches against each microbatch alone and against one; token weights; "
        "clipping against the float64 full-batch norm; a forced non-finite step; random keys per microbatch; the FP8 "
        "state's max; with --int8, the int8 step against the step without int8 (each leaf's direction and norm), and "
        "its microbatches and mesh layouts in float32 compute; the compute dtype of every matmul; what the remat "
        "policy saves; each mesh layout of --devices simulated devices against one device; for the transformer, the "
        "update inside the backward pass against the standard step over 3 clipped steps; a killed and resumed run "
        "against an uninterrupted one. Prints a table (and --json); exits 1 if a check fails.",
        formatter_class=HelpFormatter,
    )
    only = "; verify: its resume check only (the other checks run the step without it)"
    add_run_flags(p, d, scope=dict.fromkeys(RESUME_ONLY.values(), only))
    p.add_argument(
        "--microbatches", type=int, default=d.microbatches, help="must divide --batch-size (1: checked as 2)"
    )
    p.add_argument("--remat", default=d.remat, help=remat_help())
    p.add_argument(
        "--devices",
        dest="layout_devices",
        type=int,
        default=DEFAULT_DEVICES,
        help="check the mesh layouts data=N, fsdp=N and data=N/2,tensor=2 against one device, on N simulated CPU "
        "devices in a subprocess (1: no layouts)",
    )
    p.add_argument("--checks", help="comma-separated checks to run (default: all): " + ", ".join(_check_names()))
    p.add_argument("--no-resume", dest="resume", action="store_false", help="skip the killed-and-resumed run")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the report as JSON")
    add_compile_cache_flag(p)
    p.set_defaults(run=run_verify)


def _check_names() -> list[str]:
    # The names, without importing the checks (and JAX) to build the parser.
    # tests/test_verification_defects.py holds it equal to leanstep.verification.runner.CHECKS.
    return [
        "accumulation", "full_batch", "reference", "token_weighting", "clip", "non_finite", "keys", "fp8",
        "int8_agreement", "int8_microbatches", "compute_dtype", "remat", "meshes", "int8_meshes", "in_backward",
    ]  # fmt: skip


def _checks(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in _check_names()]
    if not names or unknown:
        raise InputError(f"--checks: expected comma-separated names among {', '.join(_check_names())}; got {text!r}")
    return names


def _deterministic_gpu() -> None:
    """Asks XLA for deterministic GPU programs, before JAX starts its backend (a no-op on CPU).

    The checks compare programs bit for bit; on a GPU, XLA's scatter-adds (an embedding's
    gradient) use atomics in whatever order the threads arrive unless told otherwise, so the
    same step twice differs (`leanstep verify` on an H200 said "not reproducible"). A training
    run wants the flag too, for a resume that equals the uninterrupted run: docs/verify.md.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_deterministic_ops=true".strip()


def run_verify(args: argparse.Namespace) -> int:
    """Verifies, prints the table, writes ``--json``.

    Returns:
      0 when every check passed (or does not apply), 1 when one failed or ``--json`` could not be
      written (the report is then printed on stdout as JSON).

    Raises:
      InputError: a flag is invalid.
    """
    from rich.console import Console

    from leanstep.common.outputs import check_output_path
    from leanstep.training.verify_run import verify_run

    _deterministic_gpu()
    checks = _checks(args.checks)
    if args.layout_devices < 1:
        raise InputError(f"--devices: expected an integer >= 1, got {args.layout_devices}")
    try:
        json_path = None if args.json_path is None else check_output_path(args.json_path, what="--json")
    except ValueError as error:
        raise InputError(str(error)) from None
    config = run_config(args)
    only = _resume_only(config)
    many = " --" in only  # more than one flag
    if only and not args.resume:
        raise InputError(
            f"{only} {'act' if many else 'acts'} only in verify's resume check, which --no-resume skips: drop "
            f"--no-resume, or drop {'them' if many else 'it'}"
        )
    if only:
        print(
            f"leanstep verify: note: {only} {'act' if many else 'acts'} only in the resume check; the other checks "
            "run the step with float32 moments and no spike guard",
            file=sys.stderr,
        )
    try:
        report = verify_run(config, checks=checks, num_devices=args.layout_devices, resume=args.resume)
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
    # a pipe or a file gets a table 110 columns wide (rich's default of 80 wraps every description)
    Console(width=None if sys.stdout.isatty() else 110).print(render_report(report))
    written = _write_json(json_path, report.to_json())
    return 0 if report.passed and written else 1


def _resume_only(config: Any) -> str:
    """The flags of :data:`RESUME_ONLY` that ``config`` sets (as ``--flag value``, space-joined), or ``""``."""
    from leanstep.training import RunConfig
    from leanstep.training.config import setting_meaning

    default = RunConfig()
    return " ".join(
        f"{flag} {getattr(config, name)}"
        for flag, name in RESUME_ONLY.items()
        if setting_meaning(name, getattr(config, name)) != setting_meaning(name, getattr(default, name))
    )


def render_report(report: Any) -> Any:
    """The report as a rich table: one row a check, and under a failed one where and what."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"leanstep verify: {report.verdict}", caption=report.setup, box=box.SIMPLE)
    for name in ("check", "status", "largest", "bound", "seconds", "compared"):
        numeric = name in ("largest", "bound", "seconds")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=name != "compared")
    styles = {"pass": "green", "fail": "bold red", "n/a": "dim"}
    for c in report.checks:
        table.add_row(
            c.name,
            Text(c.status, style=styles[c.status]),
            f"{c.largest:.3g}",
            f"{c.bound:.3g}",
            f"{c.seconds:.1f}",
            c.compared,
        )
        for label, value in (("where", c.where), ("bug", c.diagnosis), ("note", c.detail)):
            if value:
                table.add_row("", "", "", "", "", Text(f"{label}: {value}", style="red" if c.failed else "dim"))
    return table


def _write_json(path: Path | None, text: str) -> bool:
    """Writes the report to ``--json`` atomically; on failure prints it on stdout and says why."""
    from leanstep.common.outputs import write_bytes_atomic

    if path is None:
        return True
    try:
        write_bytes_atomic(path, (text + "\n").encode("utf-8"))
    except OSError as error:
        sys.stdout.write(text + "\n")
        print(
            f"leanstep verify: error: could not write --json {str(path)!r} ({error.strerror or error}); the report "
            "is printed on stdout as JSON",
            file=sys.stderr,
        )
        return False
    return True
