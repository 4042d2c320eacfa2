r"""The PyTorch peer of ``leanstep bench --speedrun``: leanstep's run as a PyTorch user writes it.

The same model (:func:`leanstep.bench.torch_step.build_torch_model`: leanstep's transformer as an
``nn.Module``, GPT-2 init), the same bytes (the corpus split, :class:`BatchSampler`'s batch of
every step, the held-out batches), the same recipe from the :class:`RunConfig` (AdamW's betas
0.9/0.95, weight decay on every parameter as ``optax.add_decayed_weights`` applies it, the peak
learning rate and its schedule from :func:`leanstep.training.schedule.make_schedule`,
microbatches, ``clip_grad_norm_``) and the same wall-clock budget, sized as leanstep sizes its
run (:mod:`leanstep.training.budget`):

.. code-block:: text

    clock starts                          (torch imported before, as jax is for leanstep)
    load the corpus, build model and AdamW (fused where torch has it)
    calibrate: 1 step (torch.compile compiles here), 4 timed steps, 2 held-out evaluations
    restore the initial weights, a fresh AdamW   (calibration is dropped, as leanstep's is)
    N = plan_steps(budget, spent, median step, evaluation, eval_every)   (no checkpoints)
    N steps under schedule(count, N), evaluating every eval_every steps; planned again at
      replan_step(N) from the loop's own step times, as leanstep's loop plans again (so a
      machine that slows down still finishes the schedule's decay); stop early when the
      next step and the final evaluation would end past the budget
    held-out bits per byte

Held-out bits per byte, as leanstep reports them (``EvalRecord.from_loss``): the mean over the
``K`` held-out batches of each batch's mean next-byte cross-entropy, in nats, over :math:`\ln 2`
(one token is one byte):

.. math:: \text{bpb} = \frac{1}{K \ln 2} \sum_{k=1}^{K} \frac{1}{|B_k|}
          \sum_{(b, t) \in B_k} -\ln p_\theta(x_{b, t+1} \mid x_{b, \le t})
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from leanstep.bench.torch_step import build_torch_model, load_jax_params
from leanstep.blocks.precision import get_precision
from leanstep.models import build_model
from leanstep.training.auto_precision import (
    BFLOAT16,
    bfloat16_units,
    choose_precision,
    cpu_flags,
)
from leanstep.training.budget import BudgetPlan, plan_steps, replan, replan_step
from leanstep.training.config import RunConfig, model_overrides
from leanstep.training.data import BatchSampler, Corpus, heldout_batches, load_corpus
from leanstep.training.schedule import make_schedule

__all__ = ["TorchPeerRun", "choose_torch_precision", "torch_heldout_bits_per_byte", "train_torch_peer"]

#: Steps timed after the first (which compiles), as :func:`leanstep.training.budget.calibrate`.
TIMED_STEPS = 4


class TorchPeerRun(NamedTuple):
    """What :func:`train_torch_peer` returns: ``result``, a JSON-ready dict, and the trained ``model``."""

    result: dict[str, Any]
    model: Any


def choose_torch_precision(
    spec: str, *, platform: str, compute_capability: str | None = None, flags: frozenset[str] | None = None
) -> tuple[bool, str]:
    """``(bfloat16, reason)``: whether the peer computes under ``torch.autocast(bfloat16)``, and why.

    ``auto`` is leanstep's own choice for the device
    (:func:`leanstep.training.auto_precision.choose_precision`: float32 on every CPU), and
    ``leanstep bench --speedrun`` passes the policy leanstep's run chose, so the two compute in
    one dtype. A policy naming bfloat16 compute gets it where the hardware multiplies bfloat16
    natively (torch's oneDNN does use AMX and AVX512-BF16, unlike XLA:CPU):
    torch's CPU autocast on a core without those units runs about 100x slower than float32,
    which no PyTorch user would accept, so the peer computes in float32 there.

    Raises:
      ValueError: ``spec`` is neither ``"auto"`` nor a precision policy.

    Example:
      >>> choose_torch_precision("auto", platform="cpu", flags=frozenset({"avx2"}))[0]
      False
      >>> choose_torch_precision("float32", platform="cpu", flags=frozenset({"amx_bf16"}))
      (False, '--precision float32 computes in float32')
    """
    chosen, why = choose_precision(platform, compute_capability=compute_capability, flags=flags)
    if spec == "auto":
        return chosen == BFLOAT16, f"--precision auto, as leanstep chooses: {why}"
    if np.dtype(get_precision(spec).compute_dtype).name != "bfloat16":
        return False, f"--precision {spec} computes in float32"
    units = bfloat16_units(flags) if platform == "cpu" else []
    if units:
        return True, f"--precision {spec} computes in bfloat16: a CPU with {' and '.join(units)}"
    if chosen == BFLOAT16:
        return True, f"--precision {spec} computes in bfloat16: {why}"
    return False, (
        f"--precision {spec} computes in bfloat16, but on {why.split(':')[0]} torch's bfloat16 "
        "autocast is emulated (~100x slower than float32), so float32"
    )


def _device(torch: Any) -> tuple[str, str | None, frozenset[str] | None]:
    """``(platform, compute capability, CPU flags)`` of the device the peer runs on."""
    if torch.cuda.is_available():
        return "cuda", "{}.{}".format(*torch.cuda.get_device_capability()), None
    try:
        return "cpu", None, cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "cpu", None, None


def torch_heldout_bits_per_byte(model: Any, batches: list[dict[str, np.ndarray]], *, bfloat16: bool = False) -> float:
    """Held-out bits per byte of ``model`` on ``batches`` (see the module doc), ``no_grad``, eager.

    Args:
      model: from :func:`build_torch_model`: ``model(tokens)`` is the mean cross-entropy in nats.
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


def _adamw(torch: Any, model: Any, config: RunConfig) -> tuple[Any, str]:
    """AdamW of ``config`` over every parameter (optax's adamw decays them all); fused where torch has it."""
    kwargs = {"lr": config.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": config.weight_decay}
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kwargs), "fused"
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device or torch
        return torch.optim.AdamW(model.parameters(), foreach=True, **kwargs), "foreach"


def train_torch_peer(
    config: RunConfig, *, corpus: Corpus | None = None, torch_compile: bool = True, initial_params: Any = None
) -> TorchPeerRun:
    """Trains leanstep's transformer in PyTorch for ``config``'s length (see the module doc).

    Args:
      config: the run: ``steps``, or with ``steps=None`` its ``time_budget`` in seconds, counted
        from this call; ``out``, ``checkpoint_every``, ``mesh`` and friends do not apply (one
        device, no checkpoints).
      corpus: the corpus, if already loaded (default: loaded from ``config.data`` inside the budget).
      torch_compile: try ``torch.compile`` (Inductor); should it raise, the peer runs eager and
        the result says why. Its compile time is spent inside the budget.
      initial_params: leanstep's initial parameters (``build_run(config).init_state().params``), to
        start from the very weights leanstep starts from, so that two runs differ only in how
        fast their steps go; they are copied in after the module's own initialization (inside
        the budget). None: the module's GPT-2 initialization from ``config.seed``, the same
        distribution but other draws.

    Returns:
      :class:`TorchPeerRun`: the result (held-out bits per byte and loss, steps, tokens, seconds,
      the plan, precision, compile and remat choices with their reasons) and the model.

    Raises:
      ValueError: an invalid config, a model other than the transformer, or a budget that leaves
        no time for a step (naming ``--time-budget``).
    """
    import torch
    import torch._dynamo  # torch.optim imports it on first use: library loading, not training

    start = time.perf_counter()  # the budget counts from here, torch imported (as jax is before leanstep's)
    config.validate()
    if config.model != "transformer":
        raise ValueError(f"--model {config.model}: the PyTorch peer is leanstep's transformer only")
    platform, capability, flags = _device(torch)
    device = "cuda" if platform == "cuda" else "cpu"
    bfloat16, precision_reason = choose_torch_precision(
        config.precision, platform=platform, compute_capability=capability, flags=flags
    )
    corpus = load_corpus(config.data, seq_len=config.seq_len) if corpus is None else corpus
    sampler = BatchSampler(corpus.train, config.batch_size, config.seq_len, config.seed)
    eval_data = heldout_batches(corpus.heldout, config.batch_size, config.seq_len, config.eval_batches)
    # torch.utils.checkpoint recomputes a whole block, which is leanstep's "full"; the selective
    # policies have no counterpart a nanoGPT-style script would write, so those run without.
    remat = config.remat == "full"
    model = build_torch_model(
        build_model(config.model, config.size, **model_overrides(config)).config, remat=remat, seed=config.seed
    )
    if initial_params is not None:
        load_jax_params(model, initial_params)
    model = model.to(device)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer, adamw = _adamw(torch, model, config)
    forward, compile_reason = model, "off: torch_compile=False"
    if torch_compile:
        try:
            forward, compile_reason = torch.compile(model), "compiled (Inductor)"
        except Exception as error:  # noqa: BLE001 - any failure of torch.compile means: run eager
            compile_reason = f"torch.compile unavailable ({type(error).__name__}: {error}); eager"
    params = list(model.parameters())

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def gradients(module: Any, tokens: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for microbatch in tokens.chunk(config.microbatches):
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bfloat16):
                loss = module(microbatch) / config.microbatches
            loss.backward()
            total += loss.detach()
        return total

    # One compiled scalar function, called once a step (as leanstep's loop calls its schedule);
    # compiled by the first calibration step, so before the plan.
    learning_rate = jax.jit(make_schedule(config.schedule, config.lr, config.warmup_steps))

    def step(index: int, total: int) -> tuple[Any, float]:
        nonlocal forward, compile_reason
        began = time.perf_counter()
        lr = float(learning_rate(index, total))
        tokens = torch.from_numpy(sampler.batch_at(index)["tokens"]).to(device, torch.long)
        try:
            loss = gradients(forward, tokens)
        except Exception as error:  # compilation fails lazily, at the first call: then run eager
            if forward is model:
                raise
            compile_reason = f"torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0]}); eager"
            forward = model
            torch.compiler.reset()
            loss = gradients(model, tokens)
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        sync()
        return loss, time.perf_counter() - began

    def evaluate() -> float:
        return torch_heldout_bits_per_byte(model, eval_data, bfloat16=bfloat16)

    budget_s: float | None = None
    budget_plan, replanned_at_s = None, None  # the plan, as leanstep's (leanstep.training.budget)
    if config.steps is not None:
        steps = config.steps
    elif config.time_budget is None:  # RunConfig refuses this already
        raise ValueError("--steps or --time-budget: give one (how long the run is)")
    else:  # calibrate as leanstep does, then start again from the initial weights
        budget_s = float(config.time_budget)
        times = [step(i, 1 + TIMED_STEPS)[1] for i in range(1 + TIMED_STEPS)]
        evaluate()
        began = time.perf_counter()
        evaluate()
        eval_s = time.perf_counter() - began
        with torch.no_grad():
            model.load_state_dict(initial)  # in place: a compiled graph stays valid
        optimizer, adamw = _adamw(torch, model, config)
        spent, step_s = time.perf_counter() - start, statistics.median(times[1:])
        steps = plan_steps(budget_s, spent, step_s, eval_s, config.eval_every, 0.0, config.checkpoint_every, 0.0)
        if steps < 1:
            raise ValueError(
                f"--time-budget {budget_s:g}s leaves the PyTorch peer no time for a step: {spent:.1f} s "
                f"went to loading, compiling and timing, a step takes {step_s:.3g} s and an evaluation "
                f"{eval_s:.3g} s"
            )
        at = replan_step(config, steps)
        budget_plan = BudgetPlan(
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
    losses, curve, done, stopped, loop_times = [], [], 0, False, []
    while done < steps:
        loss, seconds = step(done, steps)
        losses.append(loss)
        loop_times.append(seconds)
        done += 1
        if budget_plan is not None and done == budget_plan.replan_at:  # as leanstep's loop: its own recent pace
            replanned_at_s = time.perf_counter() - start
            budget_plan = replan(budget_plan, config, done, replanned_at_s, loop_times)
            steps = budget_plan.steps
        if done < steps and done % config.eval_every == 0:
            curve.append([done, evaluate()])
        if (
            budget_plan is not None
            and done < steps
            and time.perf_counter() - start + (budget_plan.loop_step_s or budget_plan.step_s) + budget_plan.eval_s
            > budget_plan.budget_s
        ):
            stopped = True  # slower than planned: the next step and the evaluation would end past the budget
            break
    began = time.perf_counter()
    bits = evaluate()
    final_eval_s = time.perf_counter() - began
    curve.append([done, bits])
    train_losses = [float(x) for x in losses[-10:]]
    if budget_plan is None:
        plan = {"compile_s": loop_times[0], "step_s": statistics.median(loop_times[1:] or loop_times)}
    else:
        plan = {
            key: value
            for key, value in budget_plan.to_json().items()
            if key not in ("budget_s", "steps", "checkpoint_s", "finish_s")
        } | {"replanned_at_s": replanned_at_s}
    result = {
        "contender": "pytorch",
        "heldout_bits_per_byte": bits,
        "heldout_loss": bits * math.log(2),
        "heldout_curve": curve,
        "final_train_loss": float(np.mean(train_losses)),
        "steps": done,
        "planned_steps": steps,
        "tokens": done * config.batch_size * config.seq_len,
        "budget_s": budget_s,
        "elapsed_s": time.perf_counter() - start,
        "stopped_at_budget": stopped,
        **plan,
        "slowest_step_s": max(loop_times),
        "final_eval_s": final_eval_s,
        "precision": "bfloat16" if bfloat16 else "float32",
        "precision_reason": precision_reason,
        "torch_compile": forward is not model,
        "torch_compile_reason": compile_reason,
        "remat": remat,
        "remat_reason": f"--remat {config.remat}: "
        + ("torch.utils.checkpoint around each block" if remat else "no activation checkpointing"),
        "init": "leanstep's initial parameters" if initial_params is not None else f"GPT-2 (seed {config.seed})",
        "adamw": adamw,
        "device": device,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    return TorchPeerRun(result, model)
