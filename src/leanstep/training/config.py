"""What defines a training run: :class:`RunConfig`, its checks and its identity.

Field names follow the command-line flags of ``leanstep train`` (``batch_size`` is
``--batch-size``), and every check names the flag, so the CLI can print the message as is.

Size: one dataclass of every flag, with the values it parses once (the step, the layout, the
rollback policy); its numbers' checks are :mod:`leanstep.training.config_checks`'.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.rematerialization import get_remat_policy
from leanstep.models import build_model
from leanstep.step.spec import LossScaleSpec, MeshLayout, StepSpec
from leanstep.training.config_checks import (
    MODEL_FLAGS,
    check_counts,
    check_float32s,
    check_layout,
    check_length,
)
from leanstep.training.optimizers import check_optimizer_name
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
    "in_backward_refusal",
    "model_overrides",
    "setting_meaning",
]


#: The wall-clock budget of a run that does not fix ``--steps``: three minutes.
DEFAULT_TIME_BUDGET_S = 180.0

#: ``--size auto``: the run sized for the machine (:func:`leanstep.training.machine_size.choose_for_machine`).
AUTO_SIZE = "auto"
#: ``--mesh auto``: the mesh ``budget``'s plan chooses over ``devices``.
AUTO_MESH = "auto"
#: The size preset of a run the machine does not size (a CPU's, or one whose size flags are given).
UNSIZED = "mini"

#: ``--precision``'s accepted forms, for its messages.
PRECISION_FORMS = "auto, or params=DTYPE,compute=DTYPE,output=DTYPE[,strict] (e.g. compute=bf16)"


def _check_precision(spec: str) -> None:
    # The rest of --precision is parsed with the step's flags (RunConfig.step).
    if isinstance(spec, str) and "auto" in (part.strip() for part in spec.split(",")) and spec != "auto":
        raise ValueError(f"'auto' stands alone (it picks every dtype), got {spec!r}; expected {PRECISION_FORMS}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; written to ``config.json``. Field names follow the CLI flags.

    The run's length: ``steps`` fixes it exactly; with ``steps=None`` (the default) it is sized to
    ``time_budget`` seconds of wall-clock (three minutes), counted from the start of
    :func:`leanstep.training.train`, from the step time measured once the step is compiled
    (:mod:`leanstep.training.budget`); the steps chosen are recorded in ``config.json`` and a
    resumed run keeps them. ``precision="auto"`` computes in bfloat16 only on a device with
    bfloat16 matrix units (:mod:`leanstep.training.auto_precision`), else in float32.
    ``size="auto"`` sizes the model, batch and data for an accelerator and the budget
    (:mod:`leanstep.training.machine_size`), else takes ``"mini"``. Both are resolved once, by
    :func:`leanstep.training.build_run` (and so by :func:`leanstep.training.train`). ``budget``
    (memory per device, e.g. ``"2GiB"``): :func:`~leanstep.training.train` has the planner choose
    ``microbatches`` and ``remat`` for it (with ``mesh="auto"`` and ``devices``, also the mesh and
    ``reduce``, priced on ``accelerator``) before it trains (:func:`leanstep.training.analysis.fit_memory_budget`).

    Example:
      >>> RunConfig(size="tiny", steps=20).validate().microbatches
      2
      >>> RunConfig(batch_size=6, microbatches=4).validate()
      Traceback (most recent call last):
      ...
      ValueError: --batch-size 6 is not divisible by --microbatches 4
    """

    model: str = "transformer"
    size: str = AUTO_SIZE
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    steps: int | None = None
    time_budget: float | None = DEFAULT_TIME_BUDGET_S
    batch_size: int = 32
    seq_len: int = 128
    microbatches: int = 2
    precision: str = "auto"
    loss_scale: str = "dynamic"
    initial_loss_scale: float = 2.0**15
    remat: str = "dots"
    max_grad_norm: float | None = 1.0
    lr: float = 3e-3
    optimizer: str = "muon"
    schedule: str = "warmup-stable-decay"
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    data: str | None = None
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    max_consecutive_skips: int = 100
    out: str = "runs/train"
    stop_at: int | None = None
    progress: bool = True
    chart: bool = True
    devices: int | None = None
    fsdp: bool = False
    mesh: str | None = None
    reduce: str = "auto"
    budget: str | None = None
    accelerator: str = "h100"
    fp8: str = "none"
    int8: str = "none"
    master: str = "float32"
    moments: str = "float32"
    spike_guard: str = "none"
    spike_rollback: str = "none"
    update_in_backward: str = "off"

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

    @property
    def step(self) -> StepSpec:
        """The :class:`leanstep.StepSpec` of the step's flags, parsed once (by :meth:`validate`): laid
        out over a mesh with ``--devices`` or ``--mesh``. ``--precision auto`` is resolved first, by
        ``build_run`` (:meth:`resolved`). ``--remat`` is the model's loss's, not the step's.

        Example:
          >>> RunConfig(precision="compute=bf16", moments="int8").step.to_json()["moments"]
          'int8'
        """
        if self.precision == "auto":
            raise ValueError("--precision auto is chosen for the device by build_run: read run.config.step")
        return self._parsed_step

    @functools.cached_property
    def _parsed_step(self) -> StepSpec:
        # Each step flag parsed into its field once, a refusal naming the flag (float32 stands in for
        # --precision auto until resolved() sets the device's).
        sharded = self.devices is not None or self.mesh is not None
        layout = self._layout if sharded else None
        spec = StepSpec(accumulation=Accumulation(self.microbatches, "strided" if sharded else "contiguous"))
        initial = None if self.loss_scale == "none" else self.initial_loss_scale
        for flag, name, value in (
            ("--precision", "precision", lambda: "float32" if self.precision == "auto" else self.precision),
            ("--max-grad-norm", "max_grad_norm", lambda: self.max_grad_norm),
            ("--loss-scale", "loss_scale", lambda: LossScaleSpec(self.loss_scale, initial)),
            ("--fp8", "fp8", lambda: self.fp8),
            ("--int8", "int8", lambda: self.int8),
            ("--master", "master", lambda: self.master),
            ("--moments", "moments", lambda: self.moments),
            ("--spike-guard", "spike_guard", lambda: self.spike_guard),
            ("--mesh", "sharding", lambda: layout),
            ("--update-in-backward", "update_in_backward", lambda: _on_off(self.update_in_backward)),
        ):
            try:
                spec = spec.replace(**{name: value()})
            except (TypeError, ValueError) as error:
                message = str(error).removeprefix(f"{name}: ")
                forms = f"; --precision takes {PRECISION_FORMS}" if name == "precision" else ""
                raise ValueError(f"{message if message.startswith(flag) else f'{flag}: {message}'}{forms}") from None
        return spec

    @property
    def mesh_shape(self) -> dict[str, int] | None:
        """``--mesh`` as ``{axis: size}`` (None: no mesh), parsed once, into :attr:`step`'s layout:
        ``RunConfig(mesh="data=2,fsdp=2").mesh_shape`` is ``{"data": 2, "fsdp": 2}``."""
        axes = None if self.mesh is None else self._layout.axes  # the step's layout (not the rest of the step)
        return None if axes is None else dict(axes)

    @functools.cached_property
    def rollback(self) -> SpikeRollback | None:
        """``--spike-rollback`` parsed once (by :meth:`validate`): its :class:`SpikeRollback`, or None."""
        return SpikeRollback.from_string(self.spike_rollback)

    def step_spec(self, *, sharded: bool) -> StepSpec:
        """:attr:`step` on one device, or over a mesh (``sharded``: strided microbatches, and
        ``--mesh``, ``--fsdp``, ``--reduce`` as its layout), its fields not parsed again."""
        spec = self.step
        if sharded == (spec.sharding is not None):
            return spec
        layout = self._layout if sharded else None
        split = "strided" if sharded else "contiguous"
        return spec.replace(sharding=layout, accumulation=Accumulation(self.microbatches, split))

    @functools.cached_property
    def _layout(self) -> MeshLayout:
        # --mesh as "data=2,fsdp=2" (MeshLayout parses it; "auto": any mesh, until --budget's plan), --fsdp, --reduce.
        axes = None if self.mesh == AUTO_MESH else self.mesh
        return MeshLayout(axes, fsdp=self.fsdp, reduce=self.reduce)  # type: ignore[arg-type]

    def resolved(self, precision: str, **chosen: Any) -> RunConfig:
        """This config, validated, with ``--precision auto`` resolved to ``precision`` (as it is
        otherwise) and the fields ``chosen`` for it (``--size auto``'s); its step flags parsed once."""
        config = (dataclasses.replace(self, **chosen) if chosen else self).validate()
        if config.precision != "auto":
            return config
        resolved = dataclasses.replace(config, precision=precision)
        resolved.__dict__["_parsed_step"] = config._parsed_step.replace(precision=precision)
        return resolved

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


def _check_parts(config: RunConfig) -> None:
    """The names and paths: schedule, ``--out``/``--data``, remat, the step's flags (parsed once into
    :attr:`RunConfig.step`), the model."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    check_optimizer_name(config.optimizer)
    for flag, value in (("--out", config.out), ("--data", config.data)):
        if not (isinstance(value, str) and value.strip()) and not (flag == "--data" and value is None):
            raise ValueError(f"{flag} must be a non-empty path, got {value!r}")
    for flag, parse in (
        ("--precision", lambda: _check_precision(config.precision)),
        ("--remat", lambda: get_remat_policy(config.remat)),
        ("--spike-rollback", lambda: config.rollback),  # parsed here once
    ):
        try:
            parse()
        except (TypeError, ValueError) as error:
            raise ValueError(f"{flag}: {error}") from None
    spec = config._parsed_step  # the step's flags, parsed here once
    if config.rollback is not None and spec.spike_guard is None:
        raise ValueError(
            f"--spike-rollback {config.spike_rollback} rolls back past the spikes the guard skips: "
            "pass --spike-guard on (or its settings) too"
        )
    if spec.fp8 is not None and config.model != "transformer":
        raise ValueError(f"--fp8 {config.fp8}: FP8 matmuls are built into --model transformer, not {config.model}")
    if spec.int8 is not None and config.model != "transformer":
        raise ValueError(f"--int8 {config.int8}: int8 matmuls are built into --model transformer, not {config.model}")
    refusal = in_backward_refusal(config)
    if spec.update_in_backward and refusal is not None:
        raise ValueError(f"--update-in-backward on: {refusal}")
    try:  # cheap: builds the config dataclass only, no arrays
        build_model(config.model, UNSIZED if config.size == AUTO_SIZE else config.size, **model_overrides(config))
    except (TypeError, ValueError) as error:
        flags = "".join(
            f" {flag} {getattr(config, name)}" for flag, name in MODEL_FLAGS if getattr(config, name) is not None
        )
        raise ValueError(f"--model {config.model} --size {config.size}{flags}: {error}") from None


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise ValueError(f"expected on or off, got {value!r}")
    return value == "on"


def in_backward_refusal(config: RunConfig) -> str | None:
    """Why the run cannot update its layers inside the backward pass (:mod:`leanstep.step.layerwise`),
    or None: the model's layers must be a :class:`leanstep.LayerStack` without FP8 state, and the
    optimizer must update each entry from its own gradient and state.

    Example:
      >>> in_backward_refusal(RunConfig(optimizer="adamw")) is None
      True
      >>> print(in_backward_refusal(RunConfig(model="mlp", optimizer="adamw")))
      the update inside the backward pass takes --model transformer (its layers as a LayerStack), not mlp
    """
    if config.model != "transformer":
        return f"the update inside the backward pass takes --model transformer (its layers as a LayerStack), not {config.model}"
    spec = config._parsed_step
    if spec.fp8 is not None:
        return f"--fp8 {config.fp8} keeps FP8 state under the layers; the update inside the backward pass takes none"
    try:  # the step's own refusals (a guard on the update's norm, ...), in their one place
        spec.replace(update_in_backward=True)
    except ValueError as error:
        return f"--spike-guard {config.spike_guard}: {error}" if spec.spike_guard is not None else str(error)
    return None


#: :meth:`RunConfig.validate`'s checks, in order: each raises ValueError for the first wrong field of its group.
_CHECKS: tuple[Callable[[RunConfig], None], ...] = (
    check_counts,
    check_length,
    check_layout,
    check_float32s,
    _check_parts,
)


def model_overrides(config: RunConfig) -> dict[str, Any]:
    """The model-config fields a run sets: the size flags given and ``seq_len`` (the FP8 recipe is
    the step's: ``config.step.fp8``, and the int8 one ``config.step.int8``)."""
    overrides: dict[str, Any] = {
        name: getattr(config, name) for _, name in MODEL_FLAGS if getattr(config, name) is not None
    }
    if config.model == "mlp":
        overrides.pop("n_heads", None)
        if "d_ff" in overrides:
            overrides["d_hidden"] = overrides.pop("d_ff")
    overrides["seq_len"] = config.seq_len
    return overrides
