"""The checks of a :class:`leanstep.training.RunConfig`'s numbers: its counts, its length, its
layout over devices and the numbers that become float32s, each naming its flag (the names, the
step's flags and the model are checked in :mod:`leanstep.training.config`, which imports these:
``config`` is a ``RunConfig``, untyped here so that the import goes one way)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from leanstep.common.checks import is_int, is_real

#: ``(flag, field)`` of the model-size overrides.
MODEL_FLAGS = (("--d-model", "d_model"), ("--layers", "n_layers"), ("--heads", "n_heads"), ("--d-ff", "d_ff"))


#: The longest budget accepted: 30 days.
MAX_TIME_BUDGET_S = 30 * 24 * 3600.0

#: The largest int32: the bound of every count and size of a run.
INT32_MAX = 2**31 - 1
#: float32's smallest normal and largest finite numbers.
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def flag_of(name: str) -> str:
    """The command-line flag of field ``name`` (``n_layers`` is ``--layers``)."""
    return {field: flag for flag, field in MODEL_FLAGS}.get(name, "--" + name.replace("_", "-"))


def _is_number(value: Any, minimum: float, *, strict: bool) -> bool:
    return is_real(value) and math.isfinite(value) and (value > minimum if strict else value >= minimum)


def _check_int(config: Any, name: str, minimum: int = 1, maximum: int = INT32_MAX) -> None:
    # Counters and sizes live in int32 (the step counter saturates there), so every one is
    # bounded here, where it is parsed, not where it would overflow.
    value = getattr(config, name)
    if not is_int(value) or value < minimum:
        raise ValueError(f"{flag_of(name)} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{flag_of(name)} must be an integer in [{minimum}, {maximum}], got {value!r}")


def check_counts(config: Any) -> None:
    """The counts and sizes: integers in int32's range (the seed in 32 bits), and the tokens per step."""
    for name in (
        "batch_size",
        "seq_len",
        "microbatches",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "keep_checkpoints",
        "max_consecutive_skips",
    ):
        _check_int(config, name)
    _check_int(config, "warmup_steps", 0)
    _check_int(config, "seed", 0, 2**32 - 1)  # a PRNG key keeps 32 bits of the seed
    for name in ("steps", "d_model", "n_layers", "n_heads", "d_ff", "stop_at", "devices"):
        if getattr(config, name) is not None:
            _check_int(config, name)
    if config.batch_size * config.seq_len > INT32_MAX:
        raise ValueError(
            f"--batch-size {config.batch_size} times --seq-len {config.seq_len} is more than "
            f"{INT32_MAX} tokens per step"
        )


def check_length(config: Any) -> None:
    """The run's length: ``--steps`` or a ``--time-budget`` in (0 s, 30 days], and ``--stop-at`` within it."""
    if config.time_budget is not None and not (
        _is_number(config.time_budget, 0, strict=True) and config.time_budget <= MAX_TIME_BUDGET_S
    ):
        raise ValueError(
            f"--time-budget must be a duration in (0 s, 30 days], like 3m or 90s, got {config.time_budget!r} seconds"
        )
    if config.steps is None and config.time_budget is None:
        raise ValueError("--steps or --time-budget: give one (how long the run is)")
    if config.stop_at is not None and config.steps is not None and config.stop_at > config.steps:
        raise ValueError(f"--stop-at {config.stop_at} is past --steps {config.steps}: the run would never stop there")


def check_layout(config: Any) -> None:
    """The batch split into microbatches and over devices, ``--mesh``, ``--fsdp`` and ``--reduce``."""
    if config.batch_size % config.microbatches:
        raise ValueError(f"--batch-size {config.batch_size} is not divisible by --microbatches {config.microbatches}")
    if config.mesh is not None and config.fsdp:  # --mesh is parsed with the step's flags (RunConfig.step)
        raise ValueError("--fsdp and --mesh: name an fsdp axis in --mesh instead (e.g. data=2,fsdp=4)")
    check_memory_budget(config)
    from leanstep.step.sharding_layer import REDUCTIONS

    if config.reduce not in REDUCTIONS:
        raise ValueError(f"--reduce must be one of {', '.join(REDUCTIONS)}, got {config.reduce!r}")
    if (
        config.devices is not None
        and config.mesh is None
        and config.batch_size % (config.microbatches * config.devices)
    ):
        raise ValueError(
            f"--batch-size {config.batch_size} is not divisible by --microbatches "
            f"{config.microbatches} times --devices {config.devices}"
        )


def check_memory_budget(config: Any) -> None:
    """``--budget`` a size, ``--mesh auto`` with ``--devices`` and ``--budget``, ``--accelerator`` with ``--mesh auto``."""
    from leanstep.common.memory_sizes import parse_bytes

    if config.budget is not None:
        try:
            parse_bytes(config.budget)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--budget: {error}") from None
    if config.mesh == "auto" and config.devices is None:
        raise ValueError("--mesh auto plans a mesh over --devices N devices per process; give --devices")
    if config.mesh == "auto" and config.budget is None:
        raise ValueError("--mesh auto needs --budget (memory per device, e.g. 80GiB)")
    if config.accelerator != "h100" and config.mesh != "auto":
        raise ValueError(
            f"--accelerator {config.accelerator} prices only the plan of --mesh auto; add --mesh auto or drop it"
        )


def check_float32s(config: Any) -> None:
    """The numbers that become float32s: the positive ones normal, ``--weight-decay`` finite."""
    # A positive one must be a normal float32 (a denormal one flushes to zero, a huge one is
    # inf), and a non-negative one finite in float32.
    for name in ("lr", "initial_loss_scale", "max_grad_norm"):
        value, none = getattr(config, name), " or 'none'" if name == "max_grad_norm" else ""
        if name == "max_grad_norm" and value is None:
            continue
        if not _is_number(value, 0, strict=True):
            raise ValueError(f"{flag_of(name)} must be a positive finite number{none}, got {value!r}")
        if not FLOAT32_TINY <= value <= FLOAT32_MAX:
            raise ValueError(
                f"{flag_of(name)} must be in float32's normal range [{FLOAT32_TINY:.8g}, "
                f"{FLOAT32_MAX:.8g}]{none} (it becomes a float32), got {value!r}"
            )
    if not _is_number(config.weight_decay, 0, strict=False):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {config.weight_decay!r}")
    if config.weight_decay > FLOAT32_MAX:
        raise ValueError(
            f"--weight-decay must be at most {FLOAT32_MAX:.8g} (it becomes a float32), got {config.weight_decay!r}"
        )
