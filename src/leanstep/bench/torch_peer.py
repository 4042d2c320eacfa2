"""The PyTorch peer's training, as a PyTorch user writes it: its step, its calibration and its loop.

:class:`PeerTrainer` holds the model, its optimizer (AdamW, or with ``--optimizer muon`` AdamW and
:class:`leanstep.bench.torch_muon.TorchMuon`) and the ``torch.compile``'d forward;
:func:`calibrated_plan` sizes the run in a wall-clock budget as leanstep sizes its own
(:mod:`leanstep.training.budget`) and :func:`train_loop` runs it, planned again where leanstep's
loop plans again. :func:`leanstep.bench.speedrun_torch.train_torch_peer` puts them together.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from leanstep.bench.torch_muon import TorchMuon, muon_matrices
from leanstep.training.budget import BudgetPlan, plan_steps, replan, replan_step
from leanstep.training.config import RunConfig
from leanstep.training.data import BatchSampler
from leanstep.training.schedule import make_schedule

__all__ = ["TIMED_STEPS", "PeerLoop", "PeerTrainer", "calibrated_plan", "torch_heldout_bits_per_byte", "train_loop"]

#: Steps timed after the first (which compiles), as :func:`leanstep.training.budget.calibrate`.
TIMED_STEPS = 4


def torch_heldout_bits_per_byte(model: Any, batches: list[dict[str, np.ndarray]], *, bfloat16: bool = False) -> float:
    """Held-out bits per byte of ``model`` on ``batches`` (:mod:`leanstep.bench.speedrun_torch`), ``no_grad``, eager.

    Args:
      model: from :func:`leanstep.bench.torch_step.build_torch_model`: ``model(tokens)`` is the mean
        cross-entropy in nats.
      batches: :func:`leanstep.training.data.heldout_batches`, ``{"tokens": int (B, T + 1)}`` each.
      bfloat16: compute under ``torch.autocast(bfloat16)``, as the training steps did.

    Raises:
      ValueError: ``batches`` is empty.
    """
    import torch

    if not batches:
        raise ValueError("batches is empty: no held-out batch to evaluate")
    device = next(model.parameters()).device
    losses = []
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bfloat16):
        for batch in batches:
            losses.append(float(model(torch.from_numpy(np.asarray(batch["tokens"])).to(device, torch.long))))
    return float(np.mean(losses)) / math.log(2)


def _optimizers(torch: Any, model: Any, config: RunConfig) -> tuple[Any, TorchMuon | None, str]:
    """``(AdamW, Muon or None, how AdamW runs)``. AdamW of ``config`` over every parameter (optax's adamw decays them all), fused where torch has
    it; with ``--optimizer muon``, over all but the blocks' matrices, which :class:`TorchMuon` takes."""
    kwargs = {"lr": config.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": config.weight_decay}
    muon, params = None, list(model.parameters())
    if config.optimizer == "muon":
        matrices, params = muon_matrices(model)
        muon = TorchMuon(torch, matrices, lr=config.lr, weight_decay=config.weight_decay)
    with_muon = "" if muon is None else " AdamW, and Muon for the blocks' matrices"
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs), muon, "fused" + with_muon
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device or torch
        return torch.optim.AdamW(params, foreach=True, **kwargs), muon, "foreach" + with_muon


class PeerTrainer:
    """The peer's model, AdamW and ``torch.compile``'d forward: one training step, one evaluation.

    ``step`` falls back to eager, for good, when the compiled forward fails at its first call;
    ``restart`` puts the initial weights back and starts a fresh AdamW (after calibration).
    """

    def __init__(
        self,
        torch: Any,
        config: RunConfig,
        model: Any,
        *,
        device: str,
        bfloat16: bool,
        torch_compile: bool,
        sampler: BatchSampler,
        eval_data: list[dict[str, np.ndarray]],
    ) -> None:
        self.torch, self.config, self.model, self.bfloat16 = torch, config, model, bfloat16
        self.device, self.sampler, self.eval_data = device, sampler, eval_data
        self.initial = {name: value.clone() for name, value in model.state_dict().items()}
        self.optimizer, self.muon, self.adamw = _optimizers(torch, model, config)
        self.forward, self.compile_reason = model, "off: torch_compile=False"
        if torch_compile:
            try:
                self.forward, self.compile_reason = torch.compile(model), "compiled (Inductor)"
            except Exception as error:  # noqa: BLE001 - any failure of torch.compile means: run eager
                self.compile_reason = f"torch.compile unavailable ({type(error).__name__}: {error}); eager"
        self.params = list(model.parameters())
        # One compiled scalar function, called once a step (as leanstep's loop calls its schedule);
        # compiled by the first calibration step, so before the plan.
        self.learning_rate = jax.jit(make_schedule(config.schedule, config.lr, config.warmup_steps))

    def _gradients(self, module: Any, tokens: Any) -> Any:
        torch, config = self.torch, self.config
        self.model.zero_grad(set_to_none=True)  # every parameter's, Muon's matrices included
        total = torch.zeros((), device=self.device)
        for microbatch in tokens.chunk(config.microbatches):
            with torch.autocast(device_type=self.device, dtype=torch.bfloat16, enabled=self.bfloat16):
                loss = module(microbatch) / config.microbatches
            loss.backward()
            total += loss.detach()
        return total

    def step(self, index: int, total: int) -> tuple[Any, float]:
        """Step ``index`` of ``total`` (the schedule's length): ``(loss, seconds)``."""
        torch, config = self.torch, self.config
        began = time.perf_counter()
        lr = float(self.learning_rate(index, total))
        tokens = torch.from_numpy(self.sampler.batch_at(index)["tokens"]).to(self.device, torch.long)
        try:
            loss = self._gradients(self.forward, tokens)
        except Exception as error:  # compilation fails lazily, at the first call: then run eager
            if self.forward is self.model:
                raise
            self.compile_reason = f"torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0]}); eager"
            self.forward = self.model
            torch.compiler.reset()
            loss = self._gradients(self.model, tokens)
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.muon is not None:
            self.muon.step(lr)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return loss, time.perf_counter() - began

    def evaluate(self) -> float:
        return torch_heldout_bits_per_byte(self.model, self.eval_data, bfloat16=self.bfloat16)

    def restart(self) -> None:
        with self.torch.no_grad():
            self.model.load_state_dict(self.initial)  # in place: a compiled graph stays valid
        self.optimizer, self.muon, self.adamw = _optimizers(self.torch, self.model, self.config)


class PeerLoop(NamedTuple):
    """What :func:`train_loop` leaves."""

    losses: list[Any]
    curve: list[list[float]]
    done: int
    steps: int
    stopped: bool
    loop_times: list[float]
    budget_plan: BudgetPlan | None
    replanned_at_s: float | None


def calibrated_plan(peer: PeerTrainer, config: RunConfig, budget_s: float, start: float) -> BudgetPlan:
    """Calibrates as leanstep does (a compiling step, timed steps, two evaluations), restarts the peer
    from its initial weights and plans the run in ``budget_s`` counted from ``start``."""
    times = [peer.step(i, 1 + TIMED_STEPS)[1] for i in range(1 + TIMED_STEPS)]
    peer.evaluate()
    began = time.perf_counter()
    peer.evaluate()
    eval_s = time.perf_counter() - began
    peer.restart()
    spent, step_s = time.perf_counter() - start, statistics.median(times[1:])
    steps = plan_steps(budget_s, spent, step_s, eval_s, config.eval_every, 0.0, config.checkpoint_every, 0.0)
    if steps < 1:
        raise ValueError(
            f"--time-budget {budget_s:g}s leaves the PyTorch peer no time for a step: {spent:.1f} s "
            f"went to loading, compiling and timing, a step takes {step_s:.3g} s and an evaluation "
            f"{eval_s:.3g} s"
        )
    at = replan_step(config, steps)
    return BudgetPlan(
        budget_s=budget_s,
        planned_at_s=spent,
        compile_s=times[0],
        step_s=step_s,
        step_times_s=tuple(times[1:]),
        eval_s=eval_s,
        checkpoint_s=0.0,
        finish_s=0.0,
        steps=steps,
        replan_at=at if at is not None and at < steps else None,
        calibrated_steps=steps,
    )


def train_loop(
    peer: PeerTrainer, config: RunConfig, steps: int, budget_plan: BudgetPlan | None, start: float
) -> PeerLoop:
    """``steps`` steps (planned again at ``budget_plan.replan_at``), evaluating every ``eval_every``;
    stops early when the next step and the final evaluation would end past the budget."""
    losses, curve, done, stopped, loop_times = [], [], 0, False, []
    replanned_at_s = None
    while done < steps:
        loss, seconds = peer.step(done, steps)
        losses.append(loss)
        loop_times.append(seconds)
        done += 1
        if budget_plan is not None and done == budget_plan.replan_at:  # as leanstep's loop: its own recent pace
            replanned_at_s = time.perf_counter() - start
            budget_plan = replan(budget_plan, config, done, replanned_at_s, loop_times)
            steps = budget_plan.steps
        if done < steps and done % config.eval_every == 0:
            curve.append([done, peer.evaluate()])
        if (
            budget_plan is not None
            and done < steps
            and time.perf_counter() - start + (budget_plan.loop_step_s or budget_plan.step_s) + budget_plan.eval_s
            > budget_plan.budget_s
        ):
            stopped = True  # slower than planned: the next step and the evaluation would end past the budget
            break
    return PeerLoop(losses, curve, done, steps, stopped, loop_times, budget_plan, replanned_at_s)
