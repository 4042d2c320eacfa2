r"""The PyTorch peer of ``leanstep bench --speedrun``: leanstep's run as a PyTorch user writes it.

The same model (:func:`leanstep.bench.torch_step.build_torch_model`: leanstep's transformer as an
``nn.Module``, GPT-2 init), the same bytes (the corpus split, :class:`BatchSampler`'s batch of
every step, the held-out batches), the same recipe from the :class:`RunConfig` (its optimizer:
AdamW's betas 0.9/0.95, and with ``--optimizer muon`` leanstep's Muon for the blocks' matrices,
:mod:`leanstep.bench.torch_muon`; weight decay on every parameter as ``optax.add_decayed_weights`` applies it, the peak
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

import numpy as np

from leanstep.bench.torch_peer import (
    PeerLoop,
    PeerTrainer,
    calibrated_plan,
    torch_heldout_bits_per_byte,
    train_loop,
)
from leanstep.bench.torch_step import build_torch_model, load_jax_params
from leanstep.blocks.precision import get_precision
from leanstep.models import build_model
from leanstep.training.auto_precision import (
    BFLOAT16,
    bfloat16_units,
    choose_precision,
    cpu_flags,
)
from leanstep.training.config import RunConfig, model_overrides
from leanstep.training.data import BatchSampler, Corpus, heldout_batches, load_corpus

__all__ = ["TorchPeerRun", "choose_torch_precision", "torch_heldout_bits_per_byte", "train_torch_peer"]


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


def _peer_result(
    peer: PeerTrainer,
    loop: PeerLoop,
    *,
    start: float,
    budget_s: float | None,
    precision_reason: str,
    remat: bool,
    init: str,
) -> dict[str, Any]:
    """The final evaluation and the JSON-ready result of :func:`train_torch_peer` (see its doc)."""
    config, torch = peer.config, peer.torch
    began = time.perf_counter()
    bits = peer.evaluate()
    final_eval_s = time.perf_counter() - began
    if loop.curve and loop.curve[-1][0] == loop.done:  # stopped for time right after a periodic evaluation
        loop.curve.pop()  # the same parameters: the final evaluation is the step's one point
    loop.curve.append([loop.done, bits])
    train_losses = [float(x) for x in loop.losses[-10:]]
    if loop.budget_plan is None:
        plan = {"compile_s": loop.loop_times[0], "step_s": statistics.median(loop.loop_times[1:] or loop.loop_times)}
    else:
        plan = {
            key: value
            for key, value in loop.budget_plan.to_json().items()
            if key not in ("budget_s", "steps", "checkpoint_s", "finish_s")
        } | {"replanned_at_s": loop.replanned_at_s}
    return {
        "contender": "pytorch",
        "heldout_bits_per_byte": bits,
        "heldout_loss": bits * math.log(2),
        "heldout_curve": loop.curve,
        "final_train_loss": float(np.mean(train_losses)),
        "steps": loop.done,
        "planned_steps": loop.steps,
        "tokens": loop.done * config.batch_size * config.seq_len,
        "budget_s": budget_s,
        "elapsed_s": time.perf_counter() - start,
        "stopped_at_budget": loop.stopped,
        **plan,
        "slowest_step_s": max(loop.loop_times),
        "final_eval_s": final_eval_s,
        "precision": "bfloat16" if peer.bfloat16 else "float32",
        "precision_reason": precision_reason,
        "torch_compile": peer.forward is not peer.model,
        "torch_compile_reason": peer.compile_reason,
        "remat": remat,
        "remat_reason": f"--remat {config.remat}: "
        + ("torch.utils.checkpoint around each block" if remat else "no activation checkpointing"),
        "init": init,
        "adamw": peer.adamw,
        "device": peer.device,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


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
    peer = PeerTrainer(
        torch,
        config,
        model,
        device=device,
        bfloat16=bfloat16,
        torch_compile=torch_compile,
        sampler=sampler,
        eval_data=eval_data,
    )
    budget_s: float | None = None
    budget_plan = None  # the plan, as leanstep's (leanstep.training.budget)
    if config.steps is not None:
        steps = config.steps
    elif config.time_budget is None:  # RunConfig refuses this already
        raise ValueError("--steps or --time-budget: give one (how long the run is)")
    else:  # calibrate as leanstep does, then start again from the initial weights
        budget_s = float(config.time_budget)
        budget_plan = calibrated_plan(peer, config, budget_s, start)
        steps = budget_plan.steps
    loop = train_loop(peer, config, steps, budget_plan, start)
    init = "leanstep's initial parameters" if initial_params is not None else f"GPT-2 (seed {config.seed})"
    result = _peer_result(
        peer, loop, start=start, budget_s=budget_s, precision_reason=precision_reason, remat=remat, init=init
    )
    return TorchPeerRun(result, model)
