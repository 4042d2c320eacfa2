"""What a run does before its first step: one compiled initialization, the evaluation compiled beside the step."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leanstep.step.state import TrainState
from leanstep.training import RunConfig
from leanstep.training.budget import calibrate
from leanstep.training.build import build_run
from leanstep.training.step_loop import in_background


@pytest.mark.parametrize(
    "changes", [{}, {"model": "mlp", "size": "tiny", "seq_len": 8, "batch_size": 4}, {"seed": 7, "loss_scale": "none"}]
)
def test_the_compiled_initial_state_is_the_op_by_op_one(changes):
    run = build_run(RunConfig(steps=10, **changes))
    compiled = run.init_state()
    by_ops = TrainState.create(run.init_params(), run.optimizer, loss_scale=run.loss_scale, seed=run.config.seed)
    assert jax.tree.structure(compiled) == jax.tree.structure(by_ops)
    for a, b in zip(jax.tree.leaves(compiled), jax.tree.leaves(by_ops)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


class _CompileEvents:
    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        del duration, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_a_background_compile_is_the_one_the_call_uses():
    scale = np.float32(3.0)
    fn = jax.jit(lambda x, batch: jnp.sum(x * batch["tokens"]) * scale)
    x = jnp.arange(6.0).reshape(2, 3)
    batch = {"tokens": np.ones((2, 3), np.float32)}
    with _CompileEvents() as events:
        wait = in_background(lambda: fn.lower(jax.ShapeDtypeStruct(x.shape, x.dtype), batch).compile())
        wait()
        compiled_in_background = events.count
        assert float(fn(x, batch)) == 45.0
    assert compiled_in_background == 1 and events.count == 1  # the call found the executable


def test_a_background_compile_that_fails_is_raised_by_the_call_itself_and_the_next_call_still_runs():
    fn = jax.jit(lambda x: x @ x)  # (2, 3) @ (2, 3) cannot be traced
    ran = []
    wait = in_background(
        lambda: fn.lower(jax.ShapeDtypeStruct((2, 3), jnp.float32)).compile(), lambda: ran.append(True)
    )
    wait()  # the thread's error is dropped, the next call runs ...
    assert ran == [True]
    with pytest.raises(TypeError, match="dot_general"):
        fn(jnp.ones((2, 3)))  # ... and the real call reports the error


class _State(NamedTuple):
    params: jax.Array


def test_calibrate_times_the_evaluations_after_the_first_call():
    calls = []

    def step(state, batch):
        return _State(state.params + 1), {"loss": jnp.float32(batch)}

    def evaluate(params):
        calls.append(params)
        return 0.0

    state = _State(jnp.int32(0))
    timing = calibrate(step, state, lambda i: i, evaluate, timed_steps=2, evaluations=1)
    assert len(calls) == 2 and len(timing["step_times_s"]) == 2 and timing["eval_s"] >= 0
    calibrate(step, state, lambda i: i, evaluate, timed_steps=1, evaluations=3)
    assert len(calls) == 6  # the first call (which may compile) apart, then the three timed
    with pytest.raises(ValueError, match="evaluations=0"):
        calibrate(step, state, lambda i: i, evaluate, evaluations=0)
