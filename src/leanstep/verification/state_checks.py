r"""The state checks: a forced non-finite step, the microbatches' random keys, the FP8 state.

.. code-block:: text

    non_finite   one row of one middle microbatch made non-finite: params, optimizer state, model
                 state and FP8 state after the step equal those before, bit for bit
    keys         the same step twice: bit-identical (reproducible); another seed: different (the
                 step draws random numbers at all); one microbatch's rows twice, as M=2, against
                 them once, as M=1: different (each microbatch draws its own numbers)
    fp8          the FP8 state after M microbatches equals the elementwise max of each
                 microbatch's alone (in both microbatch orders, so the last is not always the
                 largest), bit for bit; and a clipped step leaves it as an unclipped one does

Each comparison is bit for bit: a skipped step, a max and an unclipped value involve no
arithmetic that could round.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from leanstep.verification.batches import batch_rows, microbatch_rows, rows_of
from leanstep.verification.bounds import TINY, gamma
from leanstep.verification.gradient_checks import clip_threshold, microbatch_references
from leanstep.verification.protocol import PARTS
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Runs
from leanstep.verification.trees import first_difference, to_float64, worst_excess

__all__ = ["check_fp8", "check_keys", "check_non_finite"]

_BITWISE = "bit for bit"


def check_non_finite(runs: Runs, num_microbatches: int) -> CheckResult:
    """A NaN in one row of microbatch ``M // 2``: the step changes nothing it carries."""
    started = time.perf_counter()
    rows = microbatch_rows(batch_rows(runs.batches["batch"]), num_microbatches, runs.setup.split)
    bad = num_microbatches // 2
    if "poisoned" not in runs.batches:
        runs.register("poisoned", runs.setup.poison(runs.batches["batch"], rows[bad][0]))
    outcome = runs.step("poisoned", num_microbatches)
    compared = f"state after vs before a step with a NaN in microbatch {bad}"
    elapsed = time.perf_counter() - started
    for part in PARTS:
        before, after = outcome.before.get(part), outcome.after.get(part)
        if before is None and after is None:
            continue
        found = first_difference(after, before)
        if found is None:
            continue
        leaf, index = found
        changed = to_float64(after).get(leaf)
        went_non_finite = changed is not None and not np.isfinite(changed).all()
        if went_non_finite and part in ("model_state", "fp8"):
            diagnosis = (
                f"the {part.replace('_', ' ')} of a skipped step was kept: it took the non-finite values while the "
                "parameters' update was guarded (the guard must restore every part of the state)"
            )
        elif went_non_finite:
            diagnosis = (
                "the non-finite gradient was applied: the step has no finiteness guard (or it ran after the update)"
            )
        elif part == "model_state":
            diagnosis = "the model state of a skipped step was kept (only the parameters' update was guarded)"
        else:
            diagnosis = (
                "a non-finite microbatch was dropped and the step applied the others: the finiteness guard runs per "
                "microbatch, not on the step (as optax.apply_if_finite around optax.MultiSteps)"
            )
        where = f"{part}/{leaf}[{index}]; the NaN was in microbatch {bad} of {num_microbatches} (row {rows[bad][0]})"
        return CheckResult(
            "non_finite", "fail", compared, float("inf"), 0.0, _BITWISE, where, diagnosis, seconds=elapsed
        )
    skipped = outcome.metrics.get("skipped")
    if skipped is None or bool(np.asarray(skipped)):
        return CheckResult("non_finite", "pass", compared, 0.0, 0.0, _BITWISE, seconds=elapsed)
    return CheckResult(
        "non_finite", "fail", compared, 0.0, 0.0, _BITWISE, None,
        "the step changed nothing but did not say it skipped", "the step did not report skipped=True", elapsed,
    )  # fmt: skip


def check_keys(runs: Runs, num_microbatches: int) -> CheckResult:
    """Random numbers: reproducible, drawn at all, and drawn anew for each microbatch."""
    started = time.perf_counter()
    compared = "a rerun; seed 1; a microbatch's rows twice (M=2) vs once"
    first = runs.step("batch", num_microbatches, randomness=True)
    second = runs.step("batch", num_microbatches, randomness=True, again=1)
    found = first_difference(second.gradient, first.gradient)
    if found is not None:
        elapsed = time.perf_counter() - started
        return CheckResult(
            "keys", "fail", compared, float("inf"), 0.0, _BITWISE, f"{found[0]}[{found[1]}]",
            "the step is not reproducible: the same state and batch gave different gradients (on a GPU, "
            "XLA's scatter-adds sum in any order: run with XLA_FLAGS=--xla_gpu_deterministic_ops=true, "
            "as leanstep verify does)", seconds=elapsed,
        )  # fmt: skip
    other = runs.step("batch", num_microbatches, randomness=True, seed=1)
    plain = runs.step("batch", num_microbatches)
    same = (
        first_difference(other.gradient, first.gradient) is None
        and first_difference(plain.gradient, first.gradient) is None
    )
    if same:
        return CheckResult(
            "keys", "n/a", compared, 0.0, 0.0, _BITWISE, seconds=time.perf_counter() - started,
            detail="another seed, and the step without randomness, give the same gradient bit for bit: the step "
            "draws no random numbers",
        )  # fmt: skip
    batch = runs.batches["batch"]
    rows = microbatch_rows(batch_rows(batch), num_microbatches, runs.setup.split)
    size = len(rows[0])
    if "twice" not in runs.batches:
        one = rows_of(batch, rows[0])
        pair_rows = microbatch_rows(2 * size, 2, runs.setup.split)
        order = np.empty(2 * size, np.int64)
        for microbatch in pair_rows:
            order[microbatch] = np.arange(size)
        runs.register("once", one)
        runs.register("twice", jax.tree.map(lambda leaf: np.asarray(leaf)[order], one))
    twice = runs.step("twice", 2, randomness=True)
    once = runs.step("once", 1, randomness=True)
    magnitude = {leaf: np.abs(v) for leaf, v in once.gradient.items()}
    bound = {leaf: gamma(4) * m + 4 * TINY for leaf, m in magnitude.items()}
    apart = worst_excess(twice.gradient, once.gradient, bound)
    elapsed = time.perf_counter() - started
    tolerance = "distinct: differ by more than gamma_4 |g| somewhere"
    if apart.ratio > 1:
        return CheckResult("keys", "pass", compared, apart.difference, apart.bound, tolerance, seconds=elapsed)
    return CheckResult(
        "keys", "fail", compared, apart.difference, apart.bound, tolerance,
        "microbatches 0 and 1 of the same rows gave the gradient of one microbatch: every leaf",
        "every microbatch draws the same random numbers: dropout keys reused across microbatches "
        "(a step key not folded with the microbatch index)",
        seconds=elapsed,
    )  # fmt: skip


def _reversed(batch: Any, rows: list[list[int]]) -> Any:
    """``batch`` with the microbatches in reverse order (microbatch ``j`` gets ``M - 1 - j``'s rows)."""
    order = np.empty(sum(len(r) for r in rows), np.int64)
    for j, microbatch in enumerate(rows):
        order[microbatch] = rows[len(rows) - 1 - j]
    return jax.tree.map(lambda leaf: np.asarray(leaf)[order], batch)


def _elementwise_max(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: np.maximum.reduce([np.asarray(x) for x in leaves]), *trees)


def check_fp8(runs: Runs, num_microbatches: int) -> CheckResult:
    """The FP8 state: the max over microbatches, and untouched by clipping (see the module doc)."""
    started = time.perf_counter()
    compared = "FP8 state vs the max of each microbatch's; clipped vs not"
    unclipped = runs.step("batch", num_microbatches)
    if unclipped.after.get("fp8") is None:
        return CheckResult("fp8", "n/a", compared, 0.0, 0.0, _BITWISE, detail="the state has no FP8 state")
    batch = runs.batches["batch"]
    rows = microbatch_rows(batch_rows(batch), num_microbatches, runs.setup.split)
    if "reversed" not in runs.batches:
        runs.register("reversed", _reversed(batch, rows))
    for name, order in (("batch", list(range(num_microbatches))), ("reversed", list(range(num_microbatches))[::-1])):
        got = runs.step(name, num_microbatches).after["fp8"]
        references = microbatch_references(runs, name, num_microbatches, chained=False)
        alone = [r.after["fp8"] for r in references if r is not None]
        want = _elementwise_max(alone)
        found = first_difference(got, want)
        if found is None:
            continue
        kept = [j for j, state in enumerate(alone) if first_difference(got, state) is None]
        if kept:
            diagnosis = (
                f"the FP8 state was kept from microbatch {order[kept[-1]]} (the last of the step), not the max over "
                "microbatches (as marin-community/marin#7659: gradient accumulation keeping the last microbatch's amax history)"
            )
        else:
            diagnosis = "the FP8 state is not the max over microbatches (summed or averaged as a gradient?)"
        where = f"fp8/{found[0]}[{found[1]}] with microbatches in order {order}"
        elapsed = time.perf_counter() - started
        return CheckResult("fp8", "fail", compared, float("inf"), 0.0, _BITWISE, where, diagnosis, seconds=elapsed)
    threshold = clip_threshold(runs, num_microbatches)
    if threshold is None:
        return CheckResult(
            "fp8",
            "pass",
            compared,
            0.0,
            0.0,
            _BITWISE,
            seconds=time.perf_counter() - started,
            detail="not checked under clipping: the full-batch gradient has no finite norm",
        )
    clipped = runs.step("batch", num_microbatches, max_grad_norm=threshold)
    found = first_difference(clipped.after["fp8"], unclipped.after["fp8"])
    elapsed = time.perf_counter() - started
    if found is not None:
        return CheckResult(
            "fp8", "fail", compared, float("inf"), 0.0, _BITWISE, f"fp8/{found[0]}[{found[1]}] after a clipped step",
            "the FP8 state was clipped as if it were a gradient (as AI-Hypercomputer/maxtext#672: FP8 scales "
            "clipped with the gradients)",
            seconds=elapsed,
        )  # fmt: skip
    return CheckResult("fp8", "pass", compared, 0.0, 0.0, _BITWISE, seconds=elapsed)
