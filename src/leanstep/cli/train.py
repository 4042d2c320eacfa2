"""``leanstep train``: flags in, :func:`leanstep.training.train` called, its records rendered."""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from leanstep.cli.flags import (
    HelpFormatter,
    add_compile_cache_flag,
    add_run_flags,
    check_train_flags,
    mesh_devices,
    name_mesh,
    remat_help,
)
from leanstep.cli.jsontree import InputError
from leanstep.cli.machine_defaults import given_fields, size_flags_by_default
from leanstep.cli.resume_defaults import changed_flags_by_default, with_run_defaults


def _defaults() -> Any:
    from leanstep.training import RunConfig

    return RunConfig()


def add_parser(subparsers: Any) -> None:
    d = _defaults()
    p = subparsers.add_parser(
        "train",
        help="train a byte-level language model with every technique on",
        description="Trains a small decoder-only transformer (or the seeds' residual MLP) on bytes: by default "
        "the Python standard library's source, bf16 compute on float32 masters, a dynamic loss scale, "
        "microbatches, global-norm clipping and remat. Writes metrics.jsonl, config.json, curves.png and "
        "orbax checkpoints to --out.",
        formatter_class=HelpFormatter,
    )
    add_run_flags(p, d)
    training = p.add_argument_group("training")
    _add_length_flags(training)
    _add_optimizer_flags(training, d)
    output = p.add_argument_group("output")
    _add_output_flags(output, d)
    # The usage line lists the flags as they are added: --budget between the output flags, as always.
    _add_memory_budget_flag(training)
    _add_stop_flags(output)
    _add_scale_out_flags(p.add_argument_group("scaling out (JAX's mesh sharding and jax.distributed)"), d)
    add_compile_cache_flag(p)
    size_flags_by_default(p)
    changed_flags_by_default(p)
    p.set_defaults(run=run_train)


def _add_length_flags(group: Any) -> None:
    """``--time-budget`` or ``--steps``: how long the run is."""
    group.add_argument(
        "--time-budget",
        default=None,
        metavar="DURATION",
        help="size the run to this wall-clock time (e.g. 3m, 90s, 1h): steps and the learning-rate "
        "schedule are set from the step time measured after compiling, and recorded in config.json "
        "(default: 3m, unless --steps is given; %(default)s here means that)",
    )
    group.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fix the run's length exactly, instead of --time-budget (%(default)s: sized by it)",
    )


def _add_optimizer_flags(group: Any, d: Any) -> None:
    """The step's settings, the optimizer and its schedule, the seed and the data, with ``d``'s defaults."""
    from leanstep.training.config import SCHEDULES
    from leanstep.training.optimizers import MUON_LEARNING_RATE, OPTIMIZERS

    group.add_argument("--microbatches", type=int, default=d.microbatches, help="must divide --batch-size")
    group.add_argument("--initial-loss-scale", type=float, default=d.initial_loss_scale)
    group.add_argument("--remat", default=d.remat, help=remat_help())
    group.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help=f"adamw for every parameter, or muon for the layers' matrices (peak rate {MUON_LEARNING_RATE}, "
        "following --schedule) with adamw for the rest",
    )
    group.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        help="peak learning rate of AdamW (with --optimizer muon, of the parameters AdamW trains)",
    )
    group.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    group.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    group.add_argument("--weight-decay", type=float, default=d.weight_decay)
    group.add_argument("--seed", type=int, default=d.seed)
    group.add_argument(
        "--data",
        default=None,
        help="a text file or folder, or @python (the standard library's held-out files, and for training also every "
        "installed package's .py files); default: the Python standard library",
    )


def _add_output_flags(group: Any, d: Any) -> None:
    """The run directory, evaluations, checkpoints and the stuck-loss-scale stop, with ``d``'s defaults."""
    group.add_argument("--out", default=d.out, help="run directory")
    group.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    group.add_argument("--eval-every", type=int, default=d.eval_every)
    group.add_argument("--eval-batches", type=int, default=d.eval_batches)
    group.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    group.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    group.add_argument(
        "--max-consecutive-skips",
        type=int,
        default=d.max_consecutive_skips,
        help="stop when this many steps in a row are skipped with the loss scale at its minimum",
    )


def _add_memory_budget_flag(group: Any) -> None:
    """``--budget``: memory per device, for which ``leanstep plan`` chooses the step's settings."""
    group.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="a memory budget (e.g. 512MiB): leanstep plan picks --microbatches and --remat "
        "for it before training (overrides both)",
    )


def _add_stop_flags(group: Any) -> None:
    """``--stop-at`` (a preemption on purpose), ``--no-progress`` and ``--no-chart``."""
    group.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop after this step with a checkpoint, as a preemption would (resume with --resume)",
    )
    group.add_argument("--no-progress", dest="progress", action="store_false", help="no live progress bar")
    group.add_argument(
        "--no-chart",
        dest="chart",
        action="store_false",
        help="no curves.png at the end (about a second; leanstep report RUN draws it later)",
    )


def _add_scale_out_flags(group: Any, d: Any) -> None:
    """Devices, the mesh and its reductions, and a multi-process run's coordinates."""
    group.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices per process, data parallel; on CPU this simulates N devices (default: one device, unsharded)",
    )
    group.add_argument(
        "--fsdp", action="store_true", help="also shard parameters and optimizer state over the devices (ZeRO-3 style)"
    )
    group.add_argument(
        "--mesh",
        default=None,
        metavar="AXES",
        help="a mesh of several axes over every device of every process, e.g. data=2,fsdp=2,tensor=2: "
        "data parallel, FSDP (ZeRO-3) and tensor parallel, the first axis across processes; on "
        "CPU it simulates the devices it needs. 'auto': leanstep plan chooses the mesh, "
        "--microbatches, --remat and --reduce for --budget over --devices (per process)",
    )
    group.add_argument(
        "--reduce",
        choices=("auto", "step", "microbatch"),
        default=d.reduce,
        help="where gradients are reduced over the mesh (see leanstep.step.ShardingLayer)",
    )
    group.add_argument(
        "--accelerator",
        default="h100",
        help="with --mesh auto: the device the plan's cost model prices (leanstep.planning.cost_model)",
    )
    group.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address for a multi-process run (jax.distributed; gloo on CPU)",
    )
    group.add_argument("--num-processes", type=int, default=None, help="processes in a multi-process run")
    group.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. P-1")
    group.add_argument(
        "--join-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long to wait for every process of a multi-process run to join (default 120)",
    )


def run_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    check_train_flags(args)  # a flag that would be ignored, or a mesh the devices cannot hold
    _configure_devices(args)  # first: the device count and the processes are fixed once JAX makes its first array
    if args.coordinator is not None:
        from leanstep.cli.joining import check_same_out

        check_same_out(args.out, args.process_id, args.num_processes)
    config = _config_from(args)
    console = Console(stderr=True)
    config = with_run_defaults(config, args, console)
    try:
        config.validate()
    except ValueError as error:
        raise InputError(str(error)) from None
    return _train_and_report(config, args.resume, console)


def _configure_devices(args: argparse.Namespace) -> None:
    """JAX's devices and processes as the flags ask (:func:`leanstep.sharding.distributed.configure_devices`)."""
    from leanstep.sharding.distributed import configure_devices

    if args.join_timeout is not None and args.coordinator is None:
        raise InputError("--join-timeout applies to a multi-process run: give --coordinator too")
    try:
        devices = args.devices
        if args.mesh not in (None, "auto") and devices is None:  # every device the mesh needs, over the processes
            devices = max(1, mesh_devices(args.mesh) // (args.num_processes or 1))
        if args.coordinator is None:
            configure_devices(devices, args.coordinator, args.num_processes, args.process_id)
        else:
            _join(args, lambda: configure_devices(devices, args.coordinator, args.num_processes, args.process_id,
                                                  initialization_timeout=int(args.join_timeout or 120) + 60))  # fmt: skip
    except ValueError as error:
        flags = {
            "num_devices": "--devices",
            "num_processes": "--num-processes",
            "process_id": "--process-id",
            "coordinator": "--coordinator",
        }
        raise InputError(re.sub("|".join(flags), lambda m: flags[m.group(0)], str(error))) from None


def _join(args: argparse.Namespace, configure: Any) -> None:
    """``configure()`` for a multi-process run, said, bounded by ``--join-timeout``, stoppable (``cli.joining``)."""
    from leanstep.cli.joining import join_processes

    timeout = 120.0 if args.join_timeout is None else args.join_timeout
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and 1 <= timeout <= 86400):
        raise InputError(f"--join-timeout must be a number of seconds in [1, 86400], got {timeout!r}")
    others = f"{args.num_processes} processes"
    join_processes(
        configure,
        timeout_s=timeout,
        prefix="leanstep train",
        waiting=f"process {args.process_id} waiting up to {timeout:g} s for {others} to join at {args.coordinator} "
        "(--join-timeout; Ctrl-C or SIGTERM stops)",
        timed_out=f"not all {others} joined at --coordinator {args.coordinator} within --join-timeout {timeout:g} s: "
        "start every process (--process-id 0 .. --num-processes - 1) with the same --coordinator HOST:PORT",
    )


def _config_from(args: argparse.Namespace) -> Any:
    """The :class:`~leanstep.training.RunConfig` of the flags (not yet validated)."""
    from leanstep.training import RunConfig

    given = given_fields(args)
    if args.time_budget is not None and args.steps is not None:
        raise InputError("--steps and --time-budget: give one (--steps fixes the length, --time-budget sizes it)")
    if args.time_budget is not None:
        from leanstep.training.budget import parse_duration

        try:
            given["time_budget"] = parse_duration(args.time_budget)
        except ValueError as error:
            raise InputError(str(error)) from None
    else:
        given.pop("time_budget")  # RunConfig's default: three minutes unless --steps is given
    return RunConfig(**given)


def _train_and_report(config: Any, resume: bool, console: Any) -> int:
    """Trains ``config`` under a progress bar, then prints its summary, or the one line of why it stopped."""
    from rich.text import Text

    from leanstep.cli.progress import TrainProgress
    from leanstep.cli.render import render_summary
    from leanstep.training import RunStopped, train
    from leanstep.training.stop_signals import Terminated, raising_on_sigterm

    try:
        # SIGTERM (like SIGINT) stops the run after a saved step; train() then delivers it again,
        # which here raises Terminated (or KeyboardInterrupt) carrying the RunStopped that says where.
        with raising_on_sigterm(), TrainProgress(enabled=config.progress, console=console) as progress:
            summary = train(config, resume=resume, on_record=progress.handle)
    except ValueError as error:
        raise InputError(name_mesh(str(error), config.mesh)) from None
    except (RunStopped, KeyboardInterrupt, Terminated) as error:
        stopped = error if isinstance(error, RunStopped) else error.__context__
        if not isinstance(stopped, RunStopped):
            raise  # before the step loop: the command line's "interrupted" / "terminated"
        # One line whatever the terminal width, and no rich markup read into paths or messages.
        console.print(Text.assemble(("leanstep train: ", "bold red"), str(stopped)), soft_wrap=True)
        return stopped.exit_code
    if "run" in summary:  # process 0 of a multi-process run summarizes it
        console.print(render_summary(summary))
    chart = summary["curves"] or ("not written, see the warning above" if config.chart else "none, --no-chart")
    console.print(Text(f"run directory: {config.out}  (chart: {chart})"), soft_wrap=True)
    return 0
