"""The spike guard's decisions and window, against a plain-Python model of it, bit for bit, over
5 x 10,000 adversarial steps run in one ``lax.scan`` (issue 30), as the loss scale was tested."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.blocks.spike_guard import SpikeGuard

F32 = np.float32


def _tree_sum(values: list[np.float32]) -> np.float32:
    while len(values) > 1:
        half = len(values) // 2
        values = [F32(a + b) for a, b in zip(values[:half], values[half:])]
    return values[0]


class Model:
    """The guard in plain Python: float32 scalars, one rounding per operation."""

    def __init__(self, guard: SpikeGuard):
        self.guard, self.buffer = guard, 1 << (guard.window - 1).bit_length()
        self.values = [[F32(0)] * self.buffer for _ in guard.watch]
        self.recorded, self.spikes, self.streak = 0, 0, 0

    def decide(self, xs: list[np.float32], finite: bool) -> bool:
        with np.errstate(all="ignore"):  # inf - inf and NaN, as float32 arithmetic gives them
            return self._decide(xs, finite)

    def _decide(self, xs: list[np.float32], finite: bool) -> bool:
        g, n = self.guard, min(self.recorded, self.guard.window)
        count = F32(max(n, 1))
        judged = self.recorded >= g.warmup
        kept, spike_any = [], False
        for j, x in enumerate(xs):
            row = self.values[j]
            mean = F32(_tree_sum([row[i] if i < n else F32(0) for i in range(self.buffer)]) / count)
            squares = [F32(F32(row[i] - mean) * F32(row[i] - mean)) if i < n else F32(0) for i in range(self.buffer)]
            variance = F32(_tree_sum(squares) / count)
            spread = F32(F32(g.k) * np.sqrt(variance))
            over = judged and bool(np.isfinite(x)) and bool(F32(x - mean) > spread)
            spike_any |= over
            clip = over and self.streak < max(g.window // 2, 1)  # at its threshold, unless the streak is long
            kept.append(F32(mean + spread) if clip else F32(x))
        spike = finite and spike_any
        if finite:
            slot = self.recorded % g.window
            for j, value in enumerate(kept):
                self.values[j][slot] = value
            self.recorded += 1
            self.streak = self.streak + 1 if spike else 0
        self.spikes += int(spike)
        return spike


def _sequences(rng: np.random.Generator, steps: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    t = np.arange(steps)
    walk = np.exp(np.cumsum(rng.normal(0, 0.01, steps))) * 3.0
    bursts = walk.copy()
    for start in rng.integers(200, steps - 20, 40):
        bursts[start : start + rng.integers(1, 8)] *= rng.uniform(1.5, 6.0)  # several moderately bad steps
    constant = np.full(steps, 2.5)
    constant[rng.integers(0, steps, 30)] += rng.choice([1e-6, 0.5, -0.5], 30)  # a flat window, then a nudge
    special = walk.copy()
    special[rng.integers(0, steps, 60)] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0], 60)
    decaying = 5.0 * np.exp(-t / 3000.0) + rng.normal(0, 0.05, steps) + (rng.random(steps) < 0.01) * 4.0
    finite = lambda p: rng.random(steps) > p
    return [
        ("a noisy random walk", walk, finite(0.0)),
        ("bursts of moderately bad steps", bursts, finite(0.01)),
        ("a constant window nudged", constant, finite(0.0)),
        ("non-finite and extreme values, non-finite steps", special, finite(0.05)),
        ("a decaying loss with spikes", decaying, finite(0.002)),
    ]


@pytest.mark.parametrize("index", range(5))
def test_decisions_and_window_equal_the_plain_python_model_over_10000_steps(index):
    steps = 10_000
    name, loss, finite = _sequences(np.random.default_rng(index), steps)[index]
    norm = np.abs(loss[::-1]) * 0.3 + 1.0  # a second watched value, its own history
    guard = SpikeGuard(window=37, k=3.0, warmup=20, watch=("loss", "grad_norm"))  # a ring that wraps: 37
    xs = np.stack([loss, norm], axis=1).astype(F32)

    def body(state, inputs):
        x, ok = inputs
        spike, state = guard.decide(state, {"loss": x[0], "grad_norm": x[1]}, ok)
        return state, (spike, state.values, state.recorded)

    final, (spikes, _, _) = jax.jit(lambda xs, ok: jax.lax.scan(body, guard.init(), (xs, ok)))(
        jnp.asarray(xs), jnp.asarray(finite)
    )
    model = Model(guard)
    expected = [model.decide(list(x), bool(ok)) for x, ok in zip(xs, finite)]
    np.testing.assert_array_equal(np.asarray(spikes), expected, err_msg=name)
    assert int(final.spikes) == model.spikes and int(final.recorded) == model.recorded
    assert int(final.streak) == model.streak
    np.testing.assert_array_equal(np.asarray(final.values), np.asarray(model.values, F32))
    assert 5 < model.spikes < steps // 10, (name, model.spikes)  # the guard acted, and is no lock-out


def test_nothing_is_judged_during_warmup_and_a_spike_is_recorded_so_that_no_loss_locks_it_out():
    guard = SpikeGuard(window=4, k=1.0, warmup=3, watch=("loss",))
    state = guard.init()
    for loss in (1.0, 100.0, 1.0):  # warm-up: recorded, even the 100
        spike, state = guard.decide(state, {"loss": jnp.float32(loss)}, jnp.array(True))
        assert not bool(spike)
    mean = (1.0 + 100.0 + 1.0) / 3
    threshold = mean + 1.0 * math.sqrt((2 * (mean - 1.0) ** 2 + (100.0 - mean) ** 2) / 3)
    spike, after = guard.decide(state, {"loss": jnp.float32(1e4)}, jnp.array(True))
    assert bool(spike) and int(after.recorded) == 4 and int(after.spikes) == 1
    # Recorded at the threshold it crossed, not at 1e4: the window climbs towards a loss that stays.
    assert float(after.values[0, 3]) == pytest.approx(threshold, rel=1e-6)
    decisions = []
    for _ in range(60):
        spike, after = guard.decide(after, {"loss": jnp.float32(1e4)}, jnp.array(True))
        decisions.append(bool(spike))
    first_pass = decisions.index(False)
    # A burst stays visible (the patience: half the window), then the loss that stayed is taken.
    assert first_pass >= guard.patience - 1 and not any(decisions[first_pass:])
    assert int(after.spikes) == 1 + sum(decisions)


def test_a_burst_stays_visible_where_recording_it_whole_would_hide_it():
    """Eight bad steps after a calm window: each is a spike (a window that took the first whole would
    pass the rest: its spread would dwarf them)."""
    guard = SpikeGuard(window=16, k=6.0, warmup=8, watch=("loss",))
    state = guard.init()
    rng = np.random.default_rng(0)
    for loss in 2.0 + 0.01 * rng.standard_normal(16):
        _, state = guard.decide(state, {"loss": jnp.float32(loss)}, jnp.array(True))
    burst = []
    for _ in range(8):
        spike, state = guard.decide(state, {"loss": jnp.float32(5.0)}, jnp.array(True))
        burst.append(bool(spike))
    assert burst == [True] * 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"window": 1}, "window"), ({"k": 0}, "k"), ({"warmup": 1}, "warmup"), ({"watch": ("loss", "lr")}, "watch")],
)
def test_bad_settings_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=f"SpikeGuard.{match}"):
        SpikeGuard(**kwargs)


# --- in the step ---------------------------------------------------------------------------------------


def _batches(steps: int, spike_at: tuple[int, ...]):
    rng = np.random.default_rng(0)
    for t in range(steps):
        x = rng.normal(size=(16, 4)).astype(F32)
        y = x.sum(1, keepdims=True) * (40.0 if t in spike_at else 1.0)
        yield {"x": x, "y": y.astype(F32)}


def _linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


@pytest.mark.parametrize("num_mb", [1, 2])
def test_a_spike_is_skipped_with_params_and_optimizer_state_bit_identical(num_mb):
    guard = SpikeGuard(window=16, k=6.0, warmup=8)
    state = leanstep.TrainState.create(
        {"w": jnp.zeros((4, 1))}, optax.adam(0.05), loss_scale="dynamic", spike_guard=guard
    )
    step = leanstep.make_train_step(_linear_loss, num_microbatches=num_mb, max_grad_norm=1.0, spike_guard=guard)
    spiked = []
    for t, batch in enumerate(_batches(40, spike_at=(14, 33))):  # the first left the window before the second
        before = [np.asarray(x).copy() for x in jax.tree.leaves((state.params, state.opt_state))]
        state, metrics = step(state, batch)
        spiked.append(bool(metrics.spiked))
        if bool(metrics.spiked):
            after = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
            assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after)), t
            assert not bool(metrics.skipped) and not bool(metrics.clipped)
    assert [t for t, s in enumerate(spiked) if s] == [14, 33]
    assert int(state.spike.spikes) == 2 and int(state.spike.recorded) == 40


def test_the_step_takes_the_guard_from_the_state_it_is_given():
    """The state carries its guard (a static field, beside the optimizer): a step built without one
    guards a guarded state's steps, and a step whose spec names a guard leaves an unguarded state
    unguarded (the spec's guard is TrainState.create's); nothing is checked for agreement."""
    guard = SpikeGuard(window=16, k=6.0, warmup=8)
    make = lambda guard: leanstep.TrainState.create({"w": jnp.zeros((4, 1))}, optax.sgd(0.05), spike_guard=guard)
    assert make(guard).spike_guard == guard and make(None).spike_guard is None
    for state, step, skips in (
        (make(guard), leanstep.make_train_step(_linear_loss), [14]),
        (make(None), leanstep.make_train_step(_linear_loss, spike_guard=guard), []),
    ):
        spiked = []
        for batch in _batches(20, spike_at=(14,)):
            state, metrics = step(state, batch)
            spiked.append(bool(metrics.spiked))
        assert [t for t, s in enumerate(spiked) if s] == skips
    with pytest.raises(
        TypeError, match=r"guarded_update\(spike_guard=\) was removed in leanstep 0.12: the state carries"
    ):
        leanstep.step.guarded_update(make(guard), {"w": jnp.ones((4, 1))}, loss=jnp.float32(1.0), spike_guard=guard)


def test_a_guard_without_its_window_is_named():
    guard = SpikeGuard(window=16, k=6.0, warmup=8)
    state = leanstep.TrainState.create({"w": jnp.zeros((4, 1))}, optax.sgd(0.1), spike_guard=guard)
    step = leanstep.make_train_step(_linear_loss)
    for broken in (state.replace(spike=None), state.replace(spike=SpikeGuard(window=8).init())):
        with pytest.raises(
            ValueError, match=r"has no window of its own.*TrainState.create\(\.\.\., spike_guard=guard\)"
        ):
            step(broken, next(_batches(1, ())))
    with pytest.raises(ValueError, match="the state's spike guard judges the step's loss: pass loss="):
        leanstep.step.guarded_update(state, {"w": jnp.ones((4, 1))})


def test_the_guard_needs_no_host_sync():
    guard = SpikeGuard(window=16, k=6.0, warmup=8)
    state = leanstep.TrainState.create({"w": jnp.zeros((4, 1))}, optax.sgd(0.1), spike_guard=guard)
    step = leanstep.make_train_step(_linear_loss, spike_guard=guard)
    assert not leanstep.inspection.audit(step, state, next(_batches(1, ()))).host_syncs
