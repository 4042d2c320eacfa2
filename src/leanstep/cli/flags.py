"""Flags shared by ``leanstep train``, ``plan`` and ``audit``."""

from __future__ import annotations

import argparse
import math
from typing import Any


def grad_norm(text: str) -> float | None:
    """``--max-grad-norm``: a number, or "none"/"off" for no clipping."""
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'none', got {text!r}") from None


def int_list(text: str) -> list[int]:
    """Comma-separated integers, as ``plan --microbatch-counts`` takes them."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, got {text!r}") from None


def remat_help() -> str:
    """``--remat``'s help, from the library's policy names."""
    from leanstep.blocks.rematerialization import REMAT_POLICIES

    return ", ".join(REMAT_POLICIES) + " or save:NAME,..."


def add_compile_cache_flag(p: argparse.ArgumentParser) -> None:
    """``--no-compile-cache``: the commands that compile keep XLA's programs in a per-user folder."""
    from leanstep.compilation.cache import ENV

    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not keep or reuse compiled XLA programs in the per-user cache folder (on by default: "
        f"a second run with the same flags starts without compiling; {ENV}=off also turns it off, "
        f"{ENV}=DIR moves it)",
    )


def add_run_flags(p: argparse.ArgumentParser, d: Any, *, scope: dict[str, str] | None = None) -> None:
    """The model and batch flags that train, plan and audit share, with ``d``'s defaults;
    ``scope``: a command's words on where a flag acts there (by dest), added to its help."""
    scope = scope or {}
    from leanstep.blocks.loss_scale_registry import LOSS_SCALES
    from leanstep.models import MODELS, SIZES
    from leanstep.training.config import AUTO_SIZE

    model = p.add_argument_group("model and batch")
    model.add_argument("--model", choices=tuple(MODELS), default=d.model)
    model.add_argument("--size", choices=(AUTO_SIZE, *SIZES), default=d.size, help=f"size preset ({SIZE_HELP})")
    model.add_argument("--d-model", type=int, help="override the preset's width")
    model.add_argument("--layers", dest="n_layers", type=int, help="override the preset's depth")
    model.add_argument("--heads", dest="n_heads", type=int, help="override the preset's attention heads")
    model.add_argument("--d-ff", type=int, help="override the preset's MLP width")
    model.add_argument("--batch-size", type=int, default=d.batch_size)
    model.add_argument("--seq-len", type=int, default=d.seq_len)
    model.add_argument(
        "--precision",
        default=d.precision,
        help="jmp-style: params=...,compute=...,output=...[,strict]; 'auto': bfloat16 compute where XLA "
        "multiplies it on bfloat16 matrix units (GPUs from sm_80, AMD GPUs, TPUs), else float32 "
        "(every CPU: XLA:CPU does not use AMX or AVX512-BF16)",
    )
    model.add_argument(
        "--fp8",
        default=d.fp8,
        metavar="RECIPE",
        help="FP8 operands for the transformer's block matmuls: none, delayed (scales from amax histories kept "
        "in the state) or current (each tensor's own amax), with optional settings: margin=X, forward=e4m3|e5m2 "
        "(activations and weights; e4m3), backward=e4m3|e5m2 (gradients; e5m2), and with delayed only "
        "history=1..65536 (1024) and amax=max|most_recent, e.g. delayed,history=16,amax=most_recent; emulated "
        "exactly (and slower) on CPU",
    )
    model.add_argument(
        "--int8",
        default=d.int8,
        metavar="RECIPE",
        help="int8 operands for the transformer's block matmuls, with each tensor's own scales (per token, per "
        "weight column): none, on (the forward and input-gradient products in int8, the weight gradient in the "
        "compute dtype) or on,weight_grad=int8; not with --fp8; exact (and slower) on CPU",
    )
    model.add_argument(
        "--master",
        default=d.master,
        help="how the master weights are kept: float32, or bfloat16 with stochastic rounding, bfloat16-sr "
        "(2 bytes a weight) or bfloat16-sr-kahan (and a bfloat16 buffer of what rounding lost)",
    )
    model.add_argument(
        "--moments",
        default=d.moments,
        help="how AdamW's moments are kept: float32, bfloat16, or int8 (blocks of 256 with a float32 scale "
        "each: 1.016 bytes an element)" + scope.get("moments", ""),
    )
    model.add_argument(
        "--spike-guard",
        default=d.spike_guard,
        metavar="GUARD",
        help="skip a finite step whose loss (or gradient or update norm) is beyond mean + k std of its recent window: "
        "none, on (k=6,window=100,warmup=100,watch=loss), or k=X,window=2..16777216,warmup=N"
        "[,watch=loss+grad_norm+update_norm]" + scope.get("spike_guard", ""),
    )
    model.add_argument(
        "--spike-rollback",
        default=d.spike_rollback,
        metavar="ROLLBACK",
        help="after a burst of spikes, roll back to the checkpoint before it, skip its batches and lower the "
        "learning rate for a while (needs --spike-guard): none, on (after=3,within=50,lr=0.5,for=100,max=5,"
        "ahead=50), or after=N,within=N,lr=X,for=N,max=N,ahead=N (after <= within)" + scope.get("spike_rollback", ""),
    )
    model.add_argument(
        "--update-in-backward",
        choices=("on", "off"),
        default=d.update_in_backward,
        help="on: update each layer of the transformer as the backward pass reaches it, so the whole model's "
        "float32 gradient is never held (about 1.75x the step's FLOPs: two backward passes); --remat does not "
        "apply (each block is recomputed in the backward pass); --model transformer, not with --fp8 or "
        "--optimizer muon",
    )
    model.add_argument("--loss-scale", choices=LOSS_SCALES, default=d.loss_scale)
    model.add_argument("--max-grad-norm", type=grad_norm, default=d.max_grad_norm, help="a number, or 'none'")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except an on/off flag's: ``--no-progress`` is not "default: True"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return action.help
        if action.default is None and "default:" in (action.help or ""):  # the help says what the default is
            return action.help
        return super()._get_help_string(action)


#: ``--size auto``, in a flag's help.
SIZE_HELP = "auto: sized for an accelerator and the budget, model, batch and data; else mini"

#: The most devices one process may simulate (``jax_num_cpu_devices``): XLA:CPU takes seconds to
#: start 4096 and does not start 65536 in minutes; a real host has at most a few dozen accelerators.
MAX_DEVICES_PER_PROCESS = 1024


def _refuse(message: str) -> None:
    from leanstep.cli.jsontree import InputError

    raise InputError(message)


def mesh_devices(mesh: str) -> int:
    """The devices ``--mesh`` needs, parsed where :class:`~leanstep.training.RunConfig` parses it
    (:attr:`~leanstep.training.RunConfig.mesh_shape`)."""
    from leanstep.training import RunConfig

    return math.prod((RunConfig(mesh=mesh).mesh_shape or {}).values())


def check_mesh_size(mesh: str | None, devices: int | None, num_processes: int | None, *, exact: bool = True) -> None:
    """Refuses a ``--mesh`` whose size is not (``exact``; else more than) the devices the run has
    (or could simulate), naming it."""
    if mesh is None or mesh == "auto":
        return
    try:
        size = mesh_devices(mesh)
    except ValueError as error:
        _refuse(str(error))
    processes = num_processes if isinstance(num_processes, int) and num_processes >= 1 else 1
    if devices is not None:
        if devices >= 1 and (devices * processes != size if exact else devices * processes < size):
            per = f" times --num-processes {processes}" if processes > 1 else ""
            _refuse(
                f"--mesh {mesh} needs {size} devices; --devices {devices}{per} gives {devices * processes} "
                "(give a mesh whose sizes multiply to the device count, or leave --devices out)"
            )
        return
    if size > MAX_DEVICES_PER_PROCESS * processes:
        _refuse(
            f"--mesh {mesh} needs {size} devices, more than {MAX_DEVICES_PER_PROCESS} per process "
            f"(over {processes} process(es)) that can be simulated or held; give a smaller --mesh, "
            "e.g. data=2,fsdp=2,tensor=2"
        )


def check_train_flags(args: argparse.Namespace) -> None:
    """Refuses a ``leanstep train`` flag that would be ignored, naming it and the flag it needs.

    Run before anything else (JAX's devices are configured next); every refusal is an InputError.
    """
    from leanstep.training import RunConfig

    d = RunConfig()
    sharded = args.mesh is not None or args.devices is not None or args.coordinator is not None
    if args.resume and args.time_budget is not None:
        _refuse(
            "--resume and --time-budget: a resumed run keeps the steps its --time-budget chose; drop "
            "--time-budget (or give --steps N to change the length)"
        )
    if args.reduce != d.reduce and not sharded:
        _refuse(f"--reduce {args.reduce} reduces gradients over a mesh; add --mesh AXES or --devices N, or drop it")
    if args.loss_scale == "none" and args.initial_loss_scale != d.initial_loss_scale:
        _refuse("--initial-loss-scale with --loss-scale none: there is no scale; drop it or choose --loss-scale")
    if args.schedule in ("constant", "cosine") and args.warmup_steps != d.warmup_steps:
        _refuse(
            f"--warmup-steps with --schedule {args.schedule}: that schedule has no warmup; choose "
            "--schedule warmup-cosine or warmup-stable-decay, or drop --warmup-steps"
        )
    if args.fsdp and not sharded:
        _refuse("--fsdp shards the state over devices; add --devices N")
    if isinstance(args.devices, int) and args.devices > MAX_DEVICES_PER_PROCESS:
        _refuse(
            f"--devices must be an integer in [1, {MAX_DEVICES_PER_PROCESS}] (devices per process), got {args.devices}"
        )
    check_mesh_size(args.mesh, args.devices, args.num_processes)
    from leanstep.training.config_checks import check_memory_budget

    try:  # RunConfig's own check, before JAX starts: the flags' values are its fields'
        check_memory_budget(args)
    except ValueError as error:
        _refuse(str(error))


def name_mesh(message: str, mesh: str | None) -> str:
    """A partition rule's refusal, with the ``--mesh`` that made it (the flag that fixes it)."""
    if mesh and "partition rule" in message and not message.startswith("--mesh"):
        return f"--mesh {mesh}: {message}; choose axis sizes that divide the model's dimensions"
    return message


#: ``leanstep plan``'s flags that price or search a cluster plan, with their defaults: given without
#: ``--devices`` (or ``--mesh``) they would be ignored.
_CLUSTER_ONLY = {
    "accelerator": "h100",
    "reductions": "auto,step",
    "peak_flops": None,
    "bandwidth": None,
    "inter_bandwidth": None,
    "node_size": None,
    "efficiency": None,
}


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuses a ``leanstep plan`` flag that would be ignored or is out of range, naming it."""
    if args.devices is None and args.mesh is None:
        for name, default in _CLUSTER_ONLY.items():
            if getattr(args, name) != default:
                flag = "--" + name.replace("_", "-")
                _refuse(f"{flag} prices or searches a cluster plan only; add --devices N (or --mesh AXES), or drop it")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        _refuse(f"--efficiency must be a fraction of peak FLOP/s in (0, 1], got {args.efficiency}")
    if args.microbatch_counts is not None and not args.microbatch_counts:
        _refuse("--microbatch-counts is empty; give comma-separated counts such as 1,2,4, or leave it out")
    if not [name for name in str(args.remat_policies).split(",") if name.strip()]:
        _refuse(f"--remat-policies is empty; give comma-separated policies of {remat_help()}, or leave it out")
    if not [name for name in str(args.reductions).split(",") if name.strip()]:
        _refuse("--reductions is empty; give comma-separated reductions of auto, step, microbatch, or leave it out")
    check_mesh_size(args.mesh, args.devices, None, exact=False)


#: The cost model's overrides: :class:`leanstep.planning.cost_model.Accelerator` field -> the flag that sets it.
_OVERRIDES = {
    "flops": "--peak-flops",
    "bandwidth": "--bandwidth",
    "inter_bandwidth": "--inter-bandwidth",
    "node_size": "--node-size",
    "efficiency": "--efficiency",
}


def accelerator_of(args: argparse.Namespace) -> Any:
    """``plan --accelerator`` with the cost-model flags' overrides (InputError naming the flag)."""
    from leanstep.cli.jsontree import InputError
    from leanstep.planning.cost_model import get_accelerator

    if args.node_size is not None and not 1 <= args.node_size <= 2**31 - 1:
        raise InputError(f"--node-size must be an integer in [1, 2147483647], got {args.node_size}")
    overrides = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in _OVERRIDES.items()}
    try:
        return get_accelerator(args.accelerator, **overrides)
    except ValueError as error:  # named by the flag that set the field
        message = str(error)
        for field, flag in _OVERRIDES.items():
            message = message.replace(f"Accelerator.{field} ", f"{flag} (Accelerator.{field}) ", 1)
        raise InputError(message) from None


def run_config(args: argparse.Namespace, **fixed: Any) -> Any:
    """The validated :class:`leanstep.training.RunConfig` of the parsed flags (``fixed`` fields set).

    Raises:
      InputError: a flag is invalid (the message names it).
    """

    from leanstep.cli.jsontree import InputError
    from leanstep.cli.machine_defaults import given_fields
    from leanstep.training import RunConfig

    try:
        return RunConfig(**{**given_fields(args), **fixed}).validate()
    except (TypeError, ValueError) as error:
        raise InputError(str(error)) from None
