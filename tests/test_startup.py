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


class _Lowered:
    """The names of the programs lowered to StableHLO while it is open (a program compiled again is lowered again)."""

    def __init__(self):
        self.names = []

    def __call__(self, event, duration, **kwargs):
        del duration
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.names.append(kwargs.get("fun_name"))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def _slow_corpus(monkeypatch, seconds: float = 0.4) -> list:
    """``load_corpus`` made ``seconds`` slower (a corpus a TPU host reads for seconds); returns the early compiles."""
    import time

    from leanstep.training import corpus_load, trainer

    load, compile_early, early = corpus_load.load_corpus, trainer.compile_early, []

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return load(*args, **kwargs)

    def recorded(*args, **kwargs):
        early.append(compile_early(*args, **kwargs))
        return early[-1]

    monkeypatch.setattr(corpus_load, "load_corpus", slow)
    monkeypatch.setattr(trainer, "compile_early", recorded)
    monkeypatch.setattr(trainer, "QUICK_S", 0.05)
    return early


def _finished(out):
    import json

    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [
        {k: v for k, v in json.loads(line).items() if k not in ("tokens_per_sec", "elapsed_s")} for line in lines
    ]
    return records, json.loads((out / "config.json").read_text())


def test_a_slow_corpus_is_read_while_the_step_compiles_and_the_run_is_the_same(tmp_path, monkeypatch):
    import sysconfig
    from pathlib import Path

    from leanstep.training import train

    data = tmp_path / "data"
    data.mkdir()
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        (data / name).write_bytes((Path(sysconfig.get_paths()["stdlib"]) / name).read_bytes())
    fields = dict(model="mlp", size="tiny", batch_size=4, seq_len=8, microbatches=2, steps=4, eval_every=2)
    fields |= dict(eval_batches=1, progress=False, chart=False, data=str(data))
    train(RunConfig(**fields, out=str(tmp_path / "warm")))  # the eager programs every run shares, compiled once
    with _Lowered() as before:
        train(RunConfig(**fields, out=str(tmp_path / "before")))
    early = _slow_corpus(monkeypatch)
    with _Lowered() as overlapped:
        train(RunConfig(**fields, out=str(tmp_path / "overlapped")))
    assert len(early) == 1  # the step compiled before the corpus was read ...
    assert sorted(overlapped.names) == sorted(before.names)  # ... and not again at the first step
    (records, config), (records_before, config_before) = (
        _finished(tmp_path / "overlapped"),
        _finished(tmp_path / "before"),
    )
    assert records == records_before and config["corpus"] == config_before["corpus"]
    assert config["compile_cache"]["step"] == early[0].compiled and early[0].compiled["seconds"] > 0


def test_a_slow_corpus_that_fails_leaves_no_run_directory(tmp_path, monkeypatch):
    from leanstep.training import train

    data = tmp_path / "data"
    data.mkdir()
    (data / "blob.bin").write_bytes(b"\0\1\2")
    early = _slow_corpus(monkeypatch)
    config = RunConfig(
        model="mlp", size="tiny", batch_size=4, seq_len=8, steps=2, data=str(data), out=str(tmp_path / "run")
    )
    with pytest.raises(ValueError, match=r"--data folder .* holds no readable, non-empty text file"):
        train(config)
    assert len(early) == 1 and not (tmp_path / "run").exists()
