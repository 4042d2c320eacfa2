r"""The in_backward check: the update inside the backward pass against the standard step.

For a setup whose loss is given as a :class:`leanstep.LayerStack` (the built-in transformer's
:func:`leanstep.models.transformer_stack`; ``layer_stack=`` for another), both steps run
:data:`STEPS` steps from one state over the setup's batch, in ``M`` microbatches:

.. code-block:: text

    state      float32 compute and state (whatever the setup's); the probe (it records the gradient) chained before SGD
    settle     the standard step, unclipped, until a step applies (a dynamic loss scale halving)
    clip       max_grad_norm = ||G_1|| / 2, the first step's norm: the clip acts (factor 1/2 at step 1)
    compared   standard vs update_in_backward=True, each step, every leaf of the state (params,
               optimizer state, loss scale, counters) and of the metrics (loss, grad_norm, ...):
               max |a - b| / max |a| a leaf; which steps were clipped or skipped, exactly

**Optimizer.** SGD with momentum 0.9 and weight decay 0.1, learning rate 0.01: its update and
state are linear in the gradients, so a roundoff difference stays one. Not AdamW: Adam divides
each entry by its own RMS, so an entry whose gradient is roundoff alone (the key bias, which the
softmax does not see) moves by about the learning rate, in whichever direction each program's
roundoff points. Measured, AdamW (eps 1e-8) on the mini transformer: 5.7e-4 of ``blocks/qkv_b``
after 3 steps (eps 1e-6: 6.4e-6), a difference of no bug.

**Bound.** The two programs compute the same sums (each layer's gradient over the microbatches
in order, from zeros), but the global norm is summed layer by layer rather than leaf by leaf,
and XLA fuses the two programs differently; so they differ by float32 roundoff, which the clip
factor and the momentum carry from step to step. Measured on the built-in transformer, the clip
active in every step, the worst leaf over 3 steps: tiny (``M`` = 4, 8 rows of 16 tokens) 3.3e-7,
with int8 matmuls 1.9e-7; mini (``M`` = 2, 8 rows of 32 tokens) 3.9e-7; tests/test_layerwise.py
measured at most 3e-6 over 20 steps of a small model with an active clip. The bound,
:math:`2^{-14}` = 6.1e-5 of a leaf's largest magnitude (the float32 sum's tolerance of the
gradient checks), leaves a margin of over 150. The bugs it is for move a leaf by a large part of
itself: a layer updated with its unclipped gradient is given twice the standard step's gradient
at step 1 (the probe's record), a layer's update written into another layer's row moves that
row by another's update.

The setup's own compute dtype and lean masters are not what is compared (tests/test_layerwise.py
holds the lean states bit for bit and bfloat16 compute to its losses); FP8 state, model state,
aux and PRNG keys, which the update inside the backward pass does not take yet, make it ``n/a``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np
import optax

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.fp8_state import has_fp8
from leanstep.blocks.layer_stack import LayerStack
from leanstep.blocks.loss_contract import LossContract
from leanstep.step.spec import LossScaleSpec, StepSpec
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step
from leanstep.verification.gradient_checks import SUM_TOLERANCE
from leanstep.verification.protocol import probe_optimizer, seen_gradient
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import SETTLE_STEPS, Runs
from leanstep.verification.trees import named_leaves, to_float64

__all__ = ["STEPS", "check_in_backward"]

#: The steps each run takes: enough for the clip factor and AdamW's moments to carry a difference on.
STEPS = 3

UNCLIPPED = (
    "a layer updated with its unclipped gradient: the clip factor (max_grad_norm / ||G||) not applied inside the "
    "layer loop, so the layers move by their whole gradient while the step reports it clipped"
)
WRONG_ROW = (
    "a layer updated with another layer's gradient, or its update written into another layer's row: the layer "
    "loop's row index (it runs from the last layer down) counted from the wrong end"
)
DIFFERENT = (
    "the update inside the backward pass is not the standard step's: a layer's gradient, its clip factor, its "
    "optimizer state or the norm differs"
)


def _not_applicable(setup: Any) -> str | None:
    """Why the check does not apply to ``setup``, or None."""
    stack = getattr(setup, "layer_stack", None)
    if not isinstance(stack, LayerStack) and has_fp8(getattr(setup, "params", None)):
        return "the model keeps FP8 state, which update_in_backward=True does not take yet"
    if not isinstance(stack, LayerStack):
        return (
            "the step's loss is not given as a leanstep.LayerStack (embed, layers, head), which the update inside "
            "the backward pass needs: leanstep verify gives the built-in transformer's (transformer_stack), no "
            "other model's; verify(..., layer_stack=...) gives one"
        )
    contract = getattr(setup, "loss", None)
    if contract is not None and (contract.has_aux or contract.has_state or contract.uses_rng):
        return "update_in_backward=True does not yet take a loss with aux, model state or a PRNG key"
    return None


def _optimizer() -> optax.GradientTransformation:
    """SGD with momentum and weight decay (module doc), after the identity that records its input
    (``probe_optimizer(-1.0)``): the gradient each leaf was updated with."""
    return optax.chain(probe_optimizer(-1.0), optax.add_decayed_weights(0.1), optax.sgd(0.01, momentum=0.9))


def _run(stack: LayerStack, spec: StepSpec, state: TrainState, batch: Any) -> list[tuple[TrainState, Any]]:
    step = make_train_step(stack, spec)
    out = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        out.append(jax.device_get((state, metrics)))
    return out


def _settled(stack: LayerStack, spec: StepSpec, setup: Any) -> tuple[TrainState, float]:
    """The state the first applied standard step starts from, and that step's gradient norm."""
    state = TrainState.create(setup.params, _optimizer(), spec)
    step = make_train_step(stack, spec)
    for _ in range(SETTLE_STEPS):
        after, metrics = step(state, setup.batch)
        if not bool(metrics.skipped):
            break
        state = after
    return state, float(metrics.grad_norm)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b| / max |a|`` (0 where bit-equal; inf where the difference is NaN)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0 or np.array_equal(a, b, equal_nan=True):
        return 0.0
    difference = float(np.max(np.abs(a - b)))
    return math.inf if math.isnan(difference) else difference / max(float(np.max(np.abs(a))), 1e-30)


def _worst(standard: list[Any], layerwise: list[Any]) -> tuple[float, str]:
    """The largest relative difference of any leaf of any step's state or metrics, and where."""
    largest, where = 0.0, "-"
    for t, (a, b) in enumerate(zip(standard, layerwise, strict=True), start=1):
        for part, x, y in (("state", a[0], b[0]), ("metrics", a[1], b[1])):
            right = dict(named_leaves(y))
            for name, leaf in named_leaves(x):
                error = _relative(leaf, right[name]) if name in right else math.inf
                if error > largest:
                    largest, where = error, f"step {t}: {part}/{name}"
    return largest, where


def _diagnosis(stack: str, standard: TrainState, layerwise: TrainState) -> str:
    """What a difference in the first step's recorded gradients is the signature of (the module doc)."""
    want, got = (to_float64(seen_gradient(s.opt_state)) for s in (standard, layerwise))
    stacked = [name for name in want if name.startswith(f"{stack}/") and _relative(want[name], got[name]) > 0]
    for name in stacked:
        a, b = want[name], got[name]
        if np.vdot(a, a) > 0 and abs(np.vdot(a, b) / np.vdot(a, a) - 2.0) < 1e-3:  # the clip factor is 1/2
            return f"{UNCLIPPED} ({name}: twice the standard step's)"
    for name in stacked:
        a, b = want[name], got[name]
        for i in range(len(b)):
            if _relative(a[i], b[i]) > SUM_TOLERANCE:
                others = [j for j in range(len(a)) if j != i and _relative(a[j], b[i]) <= SUM_TOLERANCE]
                if others:
                    return f"{WRONG_ROW} ({name}: row {i} took row {others[0]}'s gradient)"
    return DIFFERENT


def check_in_backward(runs: Runs, num_microbatches: int) -> CheckResult:
    """The update inside the backward pass against the standard step (module doc)."""
    started = time.perf_counter()
    compared = (
        f"update_in_backward=True vs the standard step, {STEPS} steps, M={num_microbatches}, float32, SGD momentum, "
        "clip at half the first norm: every leaf of state and metrics, max |a - b| / max |a|"
    )
    why = _not_applicable(runs.setup)
    if why is not None:
        return CheckResult("in_backward", "n/a", compared, 0.0, 0.0, "-", detail=why)
    setup = runs.setup
    stack: LayerStack = setup.layer_stack  # type: ignore[attr-defined]  # checked by _not_applicable
    spec = StepSpec(
        loss=getattr(setup, "loss", None) or LossContract(),
        accumulation=Accumulation(num_microbatches, setup.split),
        loss_scale=getattr(setup, "loss_scale", LossScaleSpec()),
        donate=False,
    )
    state, norm = _settled(stack, spec, setup)
    if not (math.isfinite(norm) and norm > 0):
        detail = f"the first step's gradient norm is {norm}: no clip to act"
        return CheckResult("in_backward", "n/a", compared, 0.0, 0.0, "-", detail=detail)
    spec = spec.replace(max_grad_norm=norm / 2)
    standard = _run(stack, spec, state, setup.batch)
    layerwise = _run(stack, spec.replace(update_in_backward=True), state, setup.batch)
    largest, where = _worst(standard, layerwise)
    tolerance = (
        "2^-14 of each leaf's largest magnitude: float32 roundoff of two programs (the norm summed layer by layer), "
        f"carried over {STEPS} steps (measured 3.3e-7, the tiny transformer)"
    )
    clipped = ", ".join(str(t) for t, (_, m) in enumerate(standard, start=1) if bool(m.clipped)) or "none"
    detail = f"max_grad_norm {norm / 2:.4g} (||G_1|| / 2); steps clipped (the standard step): {clipped}"
    elapsed = time.perf_counter() - started
    if largest <= SUM_TOLERANCE:  # the metrics' clipped and skipped flags among the leaves: exactly
        return CheckResult(
            "in_backward", "pass", compared, largest, SUM_TOLERANCE, tolerance, detail=detail, seconds=elapsed
        )
    diagnosis = _diagnosis("/".join(map(str, stack.path)), standard[0][0], layerwise[0][0])
    return CheckResult(
        "in_backward", "fail", compared, largest, SUM_TOLERANCE, tolerance, where, diagnosis, detail, seconds=elapsed
    )
