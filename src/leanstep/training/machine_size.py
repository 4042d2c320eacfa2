r"""What a run (``RunConfig(size="auto")``, ``leanstep train``) trains on an accelerator: :func:`size_for_machine`,
applied with ``--precision auto`` by :func:`choose_for_machine`.

On a CPU the default run stays the CPU-sized one (``--size mini``, 32 windows of 128 bytes: the
best of what the recipe tables of docs/speedrun-and-benchmarks.md tried on two cores). On an
accelerator that model would leave the chip idle, so the model, the batch and the corpus are
sized for the device and the budget, by a stated rule:

1. Compute: :math:`C = t \cdot P \cdot u`, the budget ``t`` (seconds) times the device's peak
   bfloat16 FLOP/s ``P`` (:data:`leanstep.planning.cost_model.ACCELERATORS`) times the model
   FLOPs utilization a model this small reaches, :data:`SMALL_MODEL_MFU` (measured: 18.4% for the
   10.9 M-parameter model it picks on a TPU v5e).
2. Compute-optimal size (Hoffmann et al., 2022: about 20 tokens a parameter, :math:`C = 6ND`):
   :math:`N = \sqrt{C / 120}`.
3. Shape: width ``d`` the multiple of 128 nearest to :math:`(N / 0.1875)^{1/3}` (a block holds
   :math:`12 d^2` weights and the depth is :math:`d / 64`, so :math:`N \approx 0.1875\, d^3`),
   between 256 and 2048; ``d / 64`` layers and heads of 64; an MLP of ``4 d``.
4. Batch: windows of :data:`SEQ_LEN` bytes, :data:`TOKENS_PER_STEP` bytes a step; microbatches
   the fewest (a power of two) whose activations, bounded above by :func:`activation_bytes`,
   take at most half the device's memory.
5. Data: ``--data @python`` (:mod:`leanstep.training.installed_corpus`): every installed
   package's source for training, the standard library's default held-out files for scoring.

The rule runs for ``size="auto"`` (the default) when the other fields it sets
(:data:`SIZED_FIELDS`) are at their defaults, the model is the transformer and no mesh, memory
budget or second process is asked for; otherwise ``auto`` is ``"mini"`` with the fields given.
The fields it chose are written to ``config.json`` as the run's, and one line says why
(``Run.size_reason``). ``--resume`` sizes again: the rule is a function of the
device kind, its memory and the budget, so the same machine gives the same fields, and a run
resumed on another is refused, naming the flags that differ (``run_dir.saved_run``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from leanstep.common.checks import is_int
from leanstep.planning.cost_model import ACCELERATORS
from leanstep.training.auto_precision import resolve_precision
from leanstep.training.config import AUTO_SIZE, DEFAULT_TIME_BUDGET_S, UNSIZED, RunConfig
from leanstep.training.installed_corpus import INSTALLED_PYTHON

__all__ = ["SIZED_FIELDS", "MachineChoice", "MachineSize", "activation_bytes", "choose_for_machine", "size_for_machine"]

#: The fields the rule sets, with their flags: given any of them, the run is not sized.
SIZED_FIELDS = (
    ("--size", "size"), ("--d-model", "d_model"), ("--layers", "n_layers"), ("--heads", "n_heads"),
    ("--d-ff", "d_ff"), ("--batch-size", "batch_size"), ("--seq-len", "seq_len"),
    ("--microbatches", "microbatches"), ("--data", "data"),
)  # fmt: skip
#: The model FLOPs utilization assumed for the rule's small models (measured 0.184 on a TPU v5e).
SMALL_MODEL_MFU = 0.2
#: Bytes of context a window holds on an accelerator (a multiple of 128, for the TPU's kernels).
SEQ_LEN = 512
#: Bytes a step trains on: 128 windows of 512.
TOKENS_PER_STEP = 65_536
#: Device kinds as JAX names them (lower case, a part of the name) and their preset.
_KINDS = (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v4", "tpu-v4"), ("h100", "h100"), ("h200", "h200"),
          ("a100", "a100"))  # fmt: skip
#: Peak FLOP/s assumed for a device of a kind with no preset.
_UNKNOWN_PEAK = 100e12


@dataclasses.dataclass(frozen=True)
class MachineSize:
    """The fields the rule chose (``RunConfig`` names) and one line saying why."""

    fields: dict[str, Any]
    reason: str


def activation_bytes(rows: int, *, d_model: int, n_layers: int, n_heads: int, seq_len: int) -> int:
    """An upper bound on the activations one microbatch of ``rows`` windows keeps for the backward
    pass: float32, per token and layer the block's matmul outputs (``9 d``: QKV, projection, MLP in
    and out) and two ``n_heads x seq_len`` attention maps (the scores and their softmax)."""
    per_token_layer = 4 * (9 * d_model + 2 * n_heads * seq_len)
    return rows * seq_len * n_layers * per_token_layer


def size_for_machine(platform: str, device_kind: str, memory_bytes: int | None, budget_s: float) -> MachineSize | None:
    """The rule of this module for one device; None on a CPU (the default run is the CPU's).

    Args:
      platform: JAX's platform name (``"cpu"``, ``"tpu"``, ``"gpu"``).
      device_kind: JAX's ``device_kind`` (``"TPU v5 lite"``).
      memory_bytes: the device's memory (``memory_stats()["bytes_limit"]``), or None (the preset's).
      budget_s: the run's budget in seconds (``--time-budget``), finite and above 0.

    Raises:
      ValueError: ``budget_s`` is not a finite number of seconds above 0, or ``memory_bytes`` is
        neither None nor a positive int; naming the argument and its flag.

    Example:
      >>> size_for_machine("tpu", "TPU v5 lite", 16 * 2**30, 180.0).fields["d_model"]
      384
      >>> size_for_machine("cpu", "cpu", None, 180.0) is None
      True
    """
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
        raise ValueError(f"budget_s (--time-budget) must be a finite number of seconds > 0, got {budget_s!r}")
    if memory_bytes is not None and (not is_int(memory_bytes) or memory_bytes < 1):
        raise ValueError(f"memory_bytes (the device's bytes_limit) must be None or an int > 0, got {memory_bytes!r}")
    if platform == "cpu":
        return None
    kind = device_kind.lower()
    preset = next((ACCELERATORS[name] for part, name in _KINDS if part in kind), None)
    peak = _UNKNOWN_PEAK if preset is None else preset.peak_flops("bfloat16")
    memory = memory_bytes or (preset.memory_bytes if preset is not None else 16 * 2**30)
    compute = budget_s * peak * SMALL_MODEL_MFU
    params = math.sqrt(compute / 120)
    d = min(2048, max(256, 128 * round((params / 0.1875) ** (1 / 3) / 128)))
    layers = heads = d // 64
    rows = TOKENS_PER_STEP // SEQ_LEN
    microbatches = 1
    while microbatches < rows and (
        activation_bytes(rows // microbatches, d_model=d, n_layers=layers, n_heads=heads, seq_len=SEQ_LEN) > memory // 2
    ):
        microbatches *= 2
    fields = dict(
        d_model=d, n_layers=layers, n_heads=heads, d_ff=4 * d, seq_len=SEQ_LEN, batch_size=rows,
        microbatches=microbatches, data=INSTALLED_PYTHON,
    )  # fmt: skip
    assumed = "" if preset is not None else f" (no preset for {device_kind!r}: {_UNKNOWN_PEAK / 1e12:.0f} assumed)"
    reason = (
        f"sized for {device_kind} and {budget_s:g} s: C = {compute:.2g} FLOPs at {SMALL_MODEL_MFU:.0%} of "
        f"{peak / 1e12:.0f} TFLOP/s{assumed}, N = sqrt(C/120) = {params / 1e6:.1f} M parameters -> d_model {d}, "
        f"{layers} layers; {rows} x {SEQ_LEN} bytes a step in {microbatches} microbatch(es) for "
        f"{memory / 2**30:.1f} GiB; data {INSTALLED_PYTHON} (pass any of --size, --d-model, --batch-size, "
        "--seq-len, --microbatches or --data to choose yourself)"
    )
    return MachineSize(fields, reason)


@dataclasses.dataclass(frozen=True)
class MachineChoice:
    """A config with what the machine decides resolved: ``size="auto"`` and ``precision="auto"``.

    Attributes:
      config: the config, validated, its size a preset and its precision a policy.
      size_reason: why the run was sized so (None: not sized for the machine).
      precision_reason: why ``--precision auto`` chose the policy (None: the config named it).
    """

    config: RunConfig
    size_reason: str | None
    precision_reason: str | None


def choose_for_machine(config: RunConfig, *, priced_accelerator: bool = False) -> MachineChoice:
    """``config`` with ``size="auto"`` and ``precision="auto"`` resolved for the device JAX runs on
    (or, ``priced_accelerator``, for a cluster of accelerators being priced: never sized, bfloat16),
    the one place both are decided: :func:`leanstep.training.build_run` (and so ``train``) and
    :func:`leanstep.training.analysis.plan_run` call it. A config resolved already comes back as it is.

    Raises:
      ValueError: an invalid config, naming the flag.

    Example:
      >>> choice = choose_for_machine(RunConfig(precision="float32"))  # on a CPU: mini, as given
      >>> choice.config.size, choice.size_reason, choice.config.precision
      ('mini', None, 'float32')
    """
    chosen: dict[str, Any] = {}
    size_reason = None
    if config.size == AUTO_SIZE:  # decided before the config is validated (with what is chosen): once
        sized = None if priced_accelerator or not _sizable(config) else _size_for_this_device(config)
        chosen = {"size": UNSIZED, **({} if sized is None else sized.fields)}
        size_reason = None if sized is None else sized.reason
    precision, precision_reason = resolve_precision(config.precision, priced_accelerator=priced_accelerator)
    return MachineChoice(config.resolved(precision, **chosen), size_reason, precision_reason)


def _sizable(config: RunConfig) -> bool:
    """Whether the rule sizes ``config``: the transformer, on one device of one process, no memory
    budget, and every other field the rule sets at its default."""
    defaults = RunConfig()
    return (
        config.model == "transformer"
        and config.mesh is None
        and config.devices is None
        and config.budget is None
        and jax.process_count() == 1
        and all(getattr(config, name) == getattr(defaults, name) for _, name in SIZED_FIELDS if name != "size")
    )


def _size_for_this_device(config: RunConfig) -> MachineSize | None:
    """:func:`size_for_machine` for JAX's first device and ``config``'s budget."""
    device = jax.devices()[0]
    try:  # a backend without memory statistics: the device kind's preset, or 16 GiB
        memory = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    except (AttributeError, RuntimeError, NotImplementedError):
        memory = None
    budget = DEFAULT_TIME_BUDGET_S if config.time_budget is None else config.time_budget
    return size_for_machine(device.platform, device.device_kind, memory, budget)
