"""``BenchConfig``: what one ``leanstep bench`` run measures, and its presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from leanstep.bench.contenders import Spec
from leanstep.bench.machine import Platform
from leanstep.blocks.rematerialization import REMAT_POLICIES, get_remat_policy
from leanstep.common.checks import is_int, is_real
from leanstep.models import build_model
from leanstep.training import RunConfig

__all__ = ["ACCELERATOR_MODEL", "BenchConfig"]

#: The transformer an accelerator times, beside ``n_layers`` (4 quick, 8 full): big enough that the
#: chip, not the host's dispatch, sets the step time (a 128-wide model ran a v5e's step in its
#: host overhead); head width 128 fills a TPU's matrix units.
ACCELERATOR_MODEL = (("d_model", 1024), ("n_heads", 8), ("d_ff", 4096), ("seq_len", 1024))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one ``leanstep bench`` run measures. :meth:`full` and :meth:`quick` are the presets.

    The comparisons (leanstep vs hand-written, leanstep vs torch) use ``num_microbatches``;
    leanstep vs hand-written uses ``remat`` and bf16 compute (``leanstep train``'s defaults);
    leanstep vs torch uses the ``"full"`` policy on both sides, because
    ``torch.utils.checkpoint`` saves exactly the block inputs.
    """

    size: str = "small"
    model_overrides: tuple[tuple[str, int], ...] = ()
    batch_size: int = 16
    num_microbatches: int = 2
    remat: str = "dots"
    microbatch_sweep: tuple[int, ...] = (1, 2, 4, 8)
    remat_sweep: tuple[str, ...] = (*REMAT_POLICIES, "save:attn_out,mlp_hidden")
    repeats: int = 10
    torch_repeats: int = 3
    warmup: int = 0
    torch: bool = True
    torch_compile: bool = False
    torch_threads: int | None = None
    matmul_size: int = 4096
    matmul_repeats: int = 5
    matmul_max_seconds: float = 20.0
    lr: float = 3e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    initial_loss_scale: float = 2.0**15
    seed: int = 0

    @classmethod
    def full(cls, **changes: Any) -> BenchConfig:
        """The default run: ``leanstep train``'s model and batch (about 5-8 minutes on 2 cores)."""
        return cls(**changes).validate()

    @classmethod
    def quick(cls, **changes: Any) -> BenchConfig:
        """A small version (tiny model, few repeats, under 2 minutes on 2 cores)."""
        fields = dict(
            size="tiny",
            repeats=50,
            torch_repeats=5,
            matmul_size=2048,
            matmul_repeats=3,
            microbatch_sweep=(1, 2, 4),
            remat_sweep=("full", "dots"),
        )
        return cls(**{**fields, **changes}).validate()

    @classmethod
    def for_platform(cls, platform: Platform, *, quick: bool, **changes: Any) -> BenchConfig:
        """:meth:`quick` or :meth:`full` on a CPU; on an accelerator, a model and sweeps sized for the chip.

        On an accelerator: :data:`ACCELERATOR_MODEL` with 4 layers at batch 8 (``quick``: 4
        programs, each compiled in 10-15 s on a v5e) or 8 layers at batch 16 (7 programs; their
        states and the largest step's temporaries took 9.2 of a v5e's 15.75 GiB), bf16 compute as
        on a CPU, matmul peaks up to 8192^2 (quick) or 16384^2, and no torch rows (PyTorch here
        runs on the host CPU: no peer of the chip). A ``size`` or ``model_overrides`` in
        ``changes`` replaces the platform's model.

        Example:
          >>> from leanstep.bench.machine import platform_for
          >>> BenchConfig.for_platform(platform_for("cpu", "cpu"), quick=True) == BenchConfig.quick()
          True
          >>> config = BenchConfig.for_platform(platform_for("tpu", "TPU v5 lite"), quick=True)
          >>> dict(config.model_overrides)["d_model"], config.batch_size, config.torch
          (1024, 8, False)
        """
        if not platform.accelerator:
            return cls.quick(**changes) if quick else cls.full(**changes)
        layers = 4 if quick else 8
        fields: dict[str, Any] = dict(
            size="small",
            model_overrides=(*ACCELERATOR_MODEL, ("n_layers", layers)),
            batch_size=8 if quick else 16,
            microbatch_sweep=(2,) if quick else (2, 4, 8),
            remat_sweep=("full", "dots") if quick else ("full", "dots", "dots_no_batch"),
            repeats=20,
            matmul_size=8192 if quick else 16384,
            matmul_repeats=5,
        )
        if "size" in changes and "model_overrides" not in changes:
            fields["model_overrides"] = ()
        return cls(**{**fields, **changes, "torch": False}).validate()

    def validate(self) -> BenchConfig:
        """Checks every field, naming it; returns self. Raises ValueError."""
        for name in (
            "batch_size",
            "num_microbatches",
            "repeats",
            "torch_repeats",
            "matmul_size",
            "matmul_repeats",
            "torch_threads",
        ):
            value = getattr(self, name)
            if name == "torch_threads" and value is None:
                continue
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup!r}")
        if not is_real(self.matmul_max_seconds) or not self.matmul_max_seconds > 0:
            raise ValueError(f"matmul_max_seconds must be a number > 0, got {self.matmul_max_seconds!r}")
        sweep = (self.num_microbatches, *self.microbatch_sweep)
        if any(not is_int(m) or m < 1 for m in sweep):
            raise ValueError(f"microbatch counts must be integers >= 1, got {sweep}")
        bad = [m for m in sweep if self.batch_size % m]
        if bad:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by num_microbatches {bad}")
        for policy in (self.remat, *self.remat_sweep):
            get_remat_policy(policy)
        build_model("transformer", self.size, **dict(self.model_overrides))
        return self

    def run_config(self) -> RunConfig:
        """The training run this benchmark times (constant learning rate), as ``leanstep train`` would build it."""
        overrides = dict(self.model_overrides)
        seq_len = build_model("transformer", self.size, **overrides).seq_len  # the preset's, unless overridden
        sizes: dict[str, Any] = {name: value for name, value in overrides.items() if name != "seq_len"}
        return RunConfig(
            model="transformer",
            size=self.size,
            seq_len=seq_len,
            batch_size=self.batch_size,
            microbatches=self.num_microbatches,
            remat=self.remat,
            lr=self.lr,
            weight_decay=self.weight_decay,
            schedule="constant",
            max_grad_norm=self.max_grad_norm,
            initial_loss_scale=self.initial_loss_scale,
            seed=self.seed,
            **sizes,
        )

    def specs(self, with_torch: bool) -> list[Spec]:
        """Every contender, deduplicated, in the order they are timed each round."""
        m, bf16 = self.num_microbatches, "bfloat16"
        specs = [Spec("leanstep", bf16, m, self.remat), Spec("handwritten_jax", bf16, m, self.remat)]
        specs += [Spec("leanstep", bf16, n, self.remat) for n in self.microbatch_sweep]
        specs += [Spec("leanstep", bf16, m, policy) for policy in self.remat_sweep]
        for precision in ("float32", bf16):
            specs.append(Spec("leanstep", precision, m, "full"))
            if with_torch:
                variants = ("eager", "compiled") if self.torch_compile else ("eager",)
                specs += [Spec("torch", precision, m, "full", variant) for variant in variants]
        return list(dict.fromkeys(specs))
