"""One benchmark contender: a compiled step with its own state, ready to be timed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from leanstep.bench.handwritten import HandwrittenState, init_handwritten_state, make_handwritten_step
from leanstep.bench.timing import compiled_stats, hlo_op_counts
from leanstep.blocks.accumulation import Accumulation
from leanstep.step.spec import LossScaleSpec, StepSpec
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step

__all__ = ["Contender", "Spec", "build_jax_contender", "build_torch_contender"]

#: leanstep's precision string for each compute dtype the benchmark measures.
PRECISIONS = {
    "float32": "float32",
    "bfloat16": "params=float32,compute=bfloat16,output=float32",
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to run: implementation, compute dtype, microbatches, remat policy, torch variant."""

    impl: str
    precision: str
    num_microbatches: int
    remat: str
    variant: str | None = None

    @property
    def key(self) -> str:
        parts = [self.impl, self.precision, f"mb{self.num_microbatches}", self.remat]
        return "/".join(parts + ([self.variant] if self.variant else []))


@dataclasses.dataclass
class Contender:
    """A ready-to-time step: ``run()`` takes one step and waits for it."""

    spec: Spec
    run: Callable[[], Any]
    stats: dict[str, Any]
    first_loss: float
    first_params: Any = None
    hlo_ops: dict[str, int] | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def build_jax_contender(
    spec: Spec,
    model: Any,
    params: Any,
    batch: dict[str, jax.Array],
    optimizer: Any,
    *,
    max_grad_norm: float,
    initial_loss_scale: float,
) -> Contender:
    """Compiles leanstep's or the hand-written step for ``spec`` and takes its first step.

    bf16 compute uses a dynamic loss scale (starting at ``initial_loss_scale``); float32
    compute uses none, as a float32 user would. The first step (from ``params``) is
    returned for the equivalence check; its parameters are copied to the host.
    """

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return model.loss(p, b, remat_policy=spec.remat)

    bf16 = spec.precision == "bfloat16"
    step: jax.stages.Wrapped  # leanstep's or the hand-written one, each with its own state type
    state: TrainState | HandwrittenState
    if spec.impl == "leanstep":
        step_spec = StepSpec(
            PRECISIONS[spec.precision],  # type: ignore[arg-type]  # a string, parsed by StepSpec
            accumulation=Accumulation(spec.num_microbatches),
            max_grad_norm=max_grad_norm,
            loss_scale=LossScaleSpec("dynamic", initial_loss_scale) if bf16 else LossScaleSpec(),
        )
        step = make_train_step(loss_fn, step_spec)
        state = TrainState.create(params, optimizer, step_spec)
    elif spec.impl == "handwritten_jax":
        step = make_handwritten_step(
            loss_fn,
            optimizer,
            compute_dtype=jnp.bfloat16 if bf16 else jnp.float32,
            num_microbatches=spec.num_microbatches,
            max_grad_norm=max_grad_norm,
            dynamic_loss_scale=bf16,
        )
        state = init_handwritten_state(params, optimizer, loss_scale=initial_loss_scale if bf16 else 1.0)
    else:
        raise ValueError(f"spec.impl must be 'leanstep' or 'handwritten_jax', got {spec.impl!r}")
    compiled = step.lower(state, batch).compile()
    holder = [state]

    def take_step() -> jax.Array:
        holder[0], metrics = compiled(holder[0], batch)
        loss = metrics.loss if spec.impl == "leanstep" else metrics["loss"]
        return loss.block_until_ready()

    first_loss = float(take_step())
    first_params = jax.tree.map(np.asarray, holder[0].params)
    return Contender(spec, take_step, compiled_stats(compiled), first_loss, first_params, hlo_op_counts(compiled))


def build_torch_contender(
    spec: Spec,
    config: Any,
    tokens: np.ndarray,
    *,
    max_grad_norm: float,
    initial_loss_scale: float,
    lr: float,
    weight_decay: float,
    seed: int,
) -> Contender:
    """Builds the PyTorch step for ``spec`` (``variant`` "eager" or "compiled") and takes a step.

    The first step includes ``torch.compile``'s compilation; its wall time is in ``info``
    (a compiled model takes a second untimed step).
    """
    import time

    import torch

    from leanstep.bench.torch_step import build_torch_model, make_torch_step

    module = build_torch_model(config, remat=spec.remat == "full", seed=seed)
    step, info = make_torch_step(
        module,
        bfloat16=spec.precision == "bfloat16",
        num_microbatches=spec.num_microbatches,
        max_grad_norm=max_grad_norm,
        lr=lr,
        weight_decay=weight_decay,
        initial_loss_scale=initial_loss_scale,
        compile=spec.variant == "compiled",
    )
    batch = torch.from_numpy(np.asarray(tokens, np.int64))
    start = time.perf_counter()
    first_loss = step(batch)
    info["first_step_s"] = time.perf_counter() - start
    if spec.variant == "compiled":  # a second untimed step, in case the first call left work behind
        start = time.perf_counter()
        step(batch)
        info["second_step_s"] = time.perf_counter() - start
    stats = {"temp_bytes": None, "argument_bytes": None, "output_bytes": None, "alias_bytes": None, "xla_gflop": None}
    return Contender(spec, lambda: step(batch), stats, first_loss, info=info)
