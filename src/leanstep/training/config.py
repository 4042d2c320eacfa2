"""What defines a training run: :class:`RunConfig`, its checks and its identity.

Field names follow the command-line flags of ``leanstep train`` (``batch_size`` is
``--batch-size``), and every check names the flag, so the CLI can print the message as is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.loss_scale import LossScale
from leanstep.blocks.loss_scale_registry import get_loss_scale
from leanstep.blocks.masters import check_master
from leanstep.blocks.precision import check_train_precision
from leanstep.blocks.rematerialization import get_remat_policy
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.common.checks import is_int, is_real
from leanstep.models import build_model
from leanstep.sharding.distributed import parse_mesh
from leanstep.step.spec import LossScaleSpec, MeshLayout, StepSpec
from leanstep.training.rollback import SpikeRollback
from leanstep.training.run_identity import (
    ADDED_FIELDS,
    RESUMABLE_FIELDS,
    config_hash,
    config_hashes,
    setting_meaning,
)
from leanstep.training.schedule import SCHEDULES

__all__ = [
    "MODEL_FLAGS",
    "RESUMABLE_FIELDS",
    "SCHEDULES",
    "RunConfig",
    "config_hash",
    "config_hashes",
    "model_overrides",
    "setting_meaning",
]


#: ``(flag, field)`` of the model-size overrides.
MODEL_FLAGS = (("--d-model", "d_model"), ("--layers", "n_layers"), ("--heads", "n_heads"), ("--d-ff", "d_ff"))


#: The wall-clock budget of a run that does not fix ``--steps``: three minutes.
DEFAULT_TIME_BUDGET_S = 180.0
#: The longest budget accepted: 30 days.
MAX_TIME_BUDGET_S = 30 * 24 * 3600.0

#: The largest int32: the bound of every count and size of a run.
INT32_MAX = 2**31 - 1
#: float32's smallest normal and largest finite numbers.
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def _flag(name: str) -> str:
    """The command-line flag of field ``name`` (``n_layers`` is ``--layers``)."""
    return {field: flag for flag, field in MODEL_FLAGS}.get(name, "--" + name.replace("_", "-"))


#: ``--precision``'s accepted forms, for its messages.
PRECISION_FORMS = "auto, or params=DTYPE,compute=DTYPE,output=DTYPE[,strict] (e.g. compute=bf16)"


def _check_precision(spec: str) -> Any:
    if isinstance(spec, str) and "auto" in (part.strip() for part in spec.split(",")) and spec != "auto":
        raise ValueError(f"'auto' stands alone (it picks every dtype), got {spec!r}; expected {PRECISION_FORMS}")
    try:
        return spec if spec == "auto" else check_train_precision(spec)
    except ValueError as error:
        raise ValueError(f"{error}; --precision takes {PRECISION_FORMS}") from None


def _is_number(value: Any, minimum: float, *, strict: bool) -> bool:
    return is_real(value) and math.isfinite(value) and (value > minimum if strict else value >= minimum)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; written to ``config.json``. Field names follow the CLI flags.

    The run's length: ``steps`` fixes it exactly; with ``steps=None`` (the default) it is sized to
    ``time_budget`` seconds of wall-clock (three minutes), counted from the start of
    :func:`leanstep.training.train`, from the step time measured once the step is compiled
    (:mod:`leanstep.training.budget`); the steps chosen are recorded in ``config.json`` and a
    resumed run keeps them. ``precision="auto"`` computes in bfloat16 only on a device with
    bfloat16 matrix units (:mod:`leanstep.training.auto_precision`), else in float32.

    Example:
      >>> RunConfig(size="tiny", steps=20).validate().microbatches
      2
      >>> RunConfig(batch_size=6, microbatches=4).validate()
      Traceback (most recent call last):
      ...
      ValueError: --batch-size 6 is not divisible by --microbatches 4
    """

    model: str = "transformer"
    size: str = "mini"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    steps: int | None = None
    time_budget: float | None = DEFAULT_TIME_BUDGET_S
    batch_size: int = 64
    seq_len: int = 32
    microbatches: int = 2
    precision: str = "auto"
    loss_scale: str = "dynamic"
    initial_loss_scale: float = 2.0**15
    remat: str = "dots"
    max_grad_norm: float | None = 1.0
    lr: float = 3e-3
    schedule: str = "warmup-stable-decay"
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    data: str | None = None
    eval_every: int = 100
    eval_batches: int = 16
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    max_consecutive_skips: int = 100
    out: str = "runs/train"
    stop_at: int | None = None
    progress: bool = True
    devices: int | None = None
    fsdp: bool = False
    mesh: str | None = None
    reduce: str = "auto"
    fp8: str = "none"
    master: str = "float32"
    moments: str = "float32"
    spike_guard: str = "none"
    spike_rollback: str = "none"

    def __post_init__(self) -> None:
        # "~" means the home directory in every path, the same for every file of the run.
        if isinstance(self.precision, str):  # dtype names, "strict" and "auto" in any case: AUTO is auto
            object.__setattr__(self, "precision", self.precision.strip().lower())
        for name in ("out", "data"):
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))

    def validate(self) -> RunConfig:
        """Checks every field, naming its flag; returns self.

        The checks run one group of fields at a time: the counts, the run's length, its layout
        over devices, its float32 numbers, then the names and paths (the model last: it builds
        the model's config).

        Raises:
          ValueError: the first field that is wrong, with its flag and what would be right.
        """
        for check in _CHECKS:
            check(self)
        return self

    @functools.cached_property
    def step(self) -> StepSpec:
        """The :class:`leanstep.StepSpec` of these flags, parsed once (:meth:`step_spec`; laid out over a
        mesh with ``--devices`` or ``--mesh``). ``--precision auto`` is resolved first, by ``build_run``."""
        return self.step_spec(sharded=self.devices is not None or self.mesh is not None)

    def step_spec(self, *, sharded: bool) -> StepSpec:
        """The step of these flags on one device, or over a mesh (``sharded``: strided microbatches,
        and ``--mesh``, ``--fsdp``, ``--reduce`` as its layout). ``--remat`` is the model's loss's.

        Example:
          >>> RunConfig(precision="compute=bf16", moments="int8").step_spec(sharded=False).to_json()["moments"]
          'int8'
        """
        if self.precision == "auto":
            raise ValueError("--precision auto is chosen for the device by build_run: read run.config.step")
        axes = None if self.mesh is None else tuple(parse_mesh(self.mesh).items())
        return StepSpec.from_keywords(
            precision=self.precision,
            num_microbatches=self.microbatches,
            max_grad_norm=self.max_grad_norm,
            loss_scale=LossScaleSpec(self.loss_scale, None if self.loss_scale == "none" else self.initial_loss_scale),
            fp8=self.fp8,
            master=self.master,
            moments=self.moments,
            spike_guard=self.spike_guard,
            sharding=MeshLayout(axes, fsdp=self.fsdp, reduce=self.reduce) if sharded else None,
        )

    def make_loss_scale(self) -> LossScale:
        """The run's initial loss scale: ``--loss-scale`` at ``--initial-loss-scale`` (none: no scale)."""
        return get_loss_scale(self.loss_scale, None if self.loss_scale == "none" else self.initial_loss_scale)

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        """The fields (other than :data:`RESUMABLE_FIELDS`) whose value differs from a saved config
        (a field newer than the saved run, absent from it, counts as its default there). A setting
        string is compared by what it means (:func:`setting_meaning`), not by how it is written.

        Example:
          >>> RunConfig(fp8="DELAYED", spike_guard="on").mismatches(
          ...     {**RunConfig().to_json(), "fp8": "delayed,history=1024", "spike_guard": "k=6,window=100"})
          []
        """
        mine, saved = self.to_json(), {**ADDED_FIELDS, **saved}
        return sorted(
            k
            for k in mine
            if k not in RESUMABLE_FIELDS
            and (k not in saved or setting_meaning(k, saved[k]) != setting_meaning(k, mine[k]))
        )


def _check_int(config: RunConfig, name: str, minimum: int = 1, maximum: int = INT32_MAX) -> None:
    # Counters and sizes live in int32 (the step counter saturates there), so every one is
    # bounded here, where it is parsed, not where it would overflow.
    value = getattr(config, name)
    if not is_int(value) or value < minimum:
        raise ValueError(f"{_flag(name)} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{_flag(name)} must be an integer in [{minimum}, {maximum}], got {value!r}")


def _check_counts(config: RunConfig) -> None:
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


def _check_length(config: RunConfig) -> None:
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


def _check_layout(config: RunConfig) -> None:
    """The batch split into microbatches and over devices, ``--mesh``, ``--fsdp`` and ``--reduce``."""
    if config.batch_size % config.microbatches:
        raise ValueError(f"--batch-size {config.batch_size} is not divisible by --microbatches {config.microbatches}")
    if config.mesh is not None:
        from leanstep.sharding.distributed import parse_mesh

        parse_mesh(config.mesh)
        if config.fsdp:
            raise ValueError("--fsdp and --mesh: name an fsdp axis in --mesh instead (e.g. data=2,fsdp=4)")
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


def _check_float32s(config: RunConfig) -> None:
    """The numbers that become float32s: the positive ones normal, ``--weight-decay`` finite."""
    # A positive one must be a normal float32 (a denormal one flushes to zero, a huge one is
    # inf), and a non-negative one finite in float32.
    for name in ("lr", "initial_loss_scale", "max_grad_norm"):
        value, none = getattr(config, name), " or 'none'" if name == "max_grad_norm" else ""
        if name == "max_grad_norm" and value is None:
            continue
        if not _is_number(value, 0, strict=True):
            raise ValueError(f"{_flag(name)} must be a positive finite number{none}, got {value!r}")
        if not FLOAT32_TINY <= value <= FLOAT32_MAX:
            raise ValueError(
                f"{_flag(name)} must be in float32's normal range [{FLOAT32_TINY:.8g}, "
                f"{FLOAT32_MAX:.8g}]{none} (it becomes a float32), got {value!r}"
            )
    if not _is_number(config.weight_decay, 0, strict=False):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {config.weight_decay!r}")
    if config.weight_decay > FLOAT32_MAX:
        raise ValueError(
            f"--weight-decay must be at most {FLOAT32_MAX:.8g} (it becomes a float32), got {config.weight_decay!r}"
        )


def _check_parts(config: RunConfig) -> None:
    """The names and paths: schedule, ``--out``/``--data``, precision, remat, loss scale, the model."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    for flag, value in (("--out", config.out), ("--data", config.data)):
        if not (isinstance(value, str) and value.strip()) and not (flag == "--data" and value is None):
            raise ValueError(f"{flag} must be a non-empty path, got {value!r}")
    for flag, parse, value in (
        ("--precision", _check_precision, config.precision),
        ("--remat", get_remat_policy, config.remat),
        ("--fp8", Fp8Recipe.from_string, config.fp8),
        ("--master", check_master, config.master),
        ("--moments", lambda moments: StepSpec(moments=moments), config.moments),
        ("--spike-guard", SpikeGuard.from_string, config.spike_guard),
        ("--spike-rollback", SpikeRollback.from_string, config.spike_rollback),
    ):
        try:
            parse(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{flag}: {error}") from None
    try:
        config.make_loss_scale()
    except (TypeError, ValueError) as error:
        raise ValueError(f"--loss-scale: {error}") from None
    if (
        SpikeRollback.from_string(config.spike_rollback) is not None
        and SpikeGuard.from_string(config.spike_guard) is None
    ):
        raise ValueError(
            f"--spike-rollback {config.spike_rollback} rolls back past the spikes the guard skips: "
            "pass --spike-guard on (or its settings) too"
        )
    if config.fp8.strip().lower() != "none" and config.model != "transformer":
        raise ValueError(f"--fp8 {config.fp8}: FP8 matmuls are built into --model transformer, not {config.model}")
    try:  # cheap: builds the config dataclass only, no arrays
        build_model(config.model, config.size, **model_overrides(config))
    except (TypeError, ValueError) as error:
        flags = "".join(
            f" {flag} {getattr(config, name)}" for flag, name in MODEL_FLAGS if getattr(config, name) is not None
        )
        raise ValueError(f"--model {config.model} --size {config.size}{flags}: {error}") from None


#: :meth:`RunConfig.validate`'s checks, in order: each raises ValueError for the first wrong field of its group.
_CHECKS: tuple[Callable[[RunConfig], None], ...] = (
    _check_counts,
    _check_length,
    _check_layout,
    _check_float32s,
    _check_parts,
)


def model_overrides(config: RunConfig) -> dict[str, Any]:
    """The model-config fields a run sets: the size flags given, ``seq_len``, and ``fp8`` (an
    :class:`leanstep.Fp8Recipe`) where ``--fp8`` is not ``none``."""
    overrides: dict[str, Any] = {
        name: getattr(config, name) for _, name in MODEL_FLAGS if getattr(config, name) is not None
    }
    recipe = Fp8Recipe.from_string(config.fp8)
    if recipe is not None:
        overrides["fp8"] = recipe
    if config.model == "mlp":
        overrides.pop("n_heads", None)
        if "d_ff" in overrides:
            overrides["d_hidden"] = overrides.pop("d_ff")
    overrides["seq_len"] = config.seq_len
    return overrides
