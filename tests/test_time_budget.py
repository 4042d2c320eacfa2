"""--time-budget (a run sized to wall-clock), its schedule in the optimizer state, --precision auto."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstep.checkpoints.checkpointer import Checkpointer
from leanstep.cli.main import main
from leanstep.training import (
    Note,
    RunConfig,
    RunStopped,
    auto_precision,
    budget,
    build_run,
    train,
)
from leanstep.training.budget import parse_duration, plan_steps
from leanstep.training.schedule import (
    make_schedule,
    scale_by_run_schedule,
    set_total_steps,
)

# The MLP compiles in a few seconds: the budgeted runs below spend their budget on steps.
FAST = dict(
    model="mlp",
    size="tiny",
    batch_size=4,
    seq_len=8,
    microbatches=2,
    eval_every=25,
    eval_batches=2,
    checkpoint_every=1000,
    progress=False,
    chart=False,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("budget-corpus")
    rng = np.random.default_rng(0)
    for i in range(3):
        (root / f"f{i}.py").write_bytes(bytes(rng.integers(32, 127, 6000, dtype=np.uint8)))
    return root


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


# --- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3m", 180.0),
        ("90s", 90.0),
        ("1.5h", 5400.0),
        ("2m30s", 150.0),
        ("45", 45.0),
        (" 10 min ", 600.0),
        (".5m", 30.0),
    ],
)
def test_durations_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "3x", "m", "-3m", "0", "0s", "3m 5", "inf", "nan", "1e3", "3mm"])
def test_bad_durations_name_the_flag(text):
    with pytest.raises(ValueError, match="--time-budget"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "5", "--time-budget", "1m"], "--steps and --time-budget: give one"),
        (["--time-budget", "soon"], "--time-budget must be a duration"),
        (["--time-budget", "31d"], "--time-budget must be a duration"),
        (["--time-budget", "9999h"], "--time-budget must be a duration in"),
    ],
)
def test_cli_refuses_bad_budgets(tmp_path, corpus, capsys, flags, message):
    code = main(
        [
            "train",
            "--model",
            "mlp",
            "--size",
            "tiny",
            "--data",
            str(corpus),
            "--out",
            str(tmp_path / "r"),
            "--no-progress",
            "--no-chart",
            *flags,
        ]
    )
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r" / "config.json").exists()


# --- the plan --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1, 1e5),
    st.floats(0, 100),
    st.floats(1e-4, 10),
    st.floats(0, 5),
    st.integers(1, 1000),
    st.floats(0, 5),
    st.integers(1, 1000),
    st.floats(0, 5),
)
def test_the_plan_fits_the_budget_and_one_more_step_would_not(
    budget_s, spent, step, ev, every, ckpt, ckpt_every, finish
):
    n = plan_steps(budget_s, spent, step, ev, every, ckpt, ckpt_every, finish)

    def cost(k: int) -> float:  # a plain model of a k-step run: steps, evaluations, checkpoints, the finish
        return spent + k * step + (k // every + 1) * ev + (k // ckpt_every + 1) * ckpt + finish

    assert n >= 0
    if n > 0:
        assert cost(n) <= budget_s * (1 + 1e-9)
    assert spent + (n + 1) * (step + ev / every + ckpt / ckpt_every) + ev + ckpt + finish > budget_s * (1 - 1e-9)


# --- the schedule ----------------------------------------------------------------------------


@pytest.mark.parametrize("total", [1, 2, 7, 30, 31, 500])
@pytest.mark.parametrize("name", ["constant", "cosine", "warmup-cosine"])
def test_the_schedule_is_optaxs_for_every_length(name, total):
    lr, warmup = 3e-3, 30
    reference = {
        "constant": optax.constant_schedule(lr),
        "cosine": optax.cosine_decay_schedule(lr, total, alpha=0.1),
        "warmup-cosine": optax.warmup_cosine_decay_schedule(
            0.0, lr, min(warmup, max(total - 1, 0)), max(total, min(warmup, max(total - 1, 0)) + 1), end_value=0.1 * lr
        ),
    }[name]
    mine = make_schedule(name, lr, warmup)
    counts = np.arange(0, total + 3)
    expected = [float(reference(c)) for c in counts]
    np.testing.assert_allclose([float(mine(c, total)) for c in counts], expected, rtol=2e-6, atol=1e-12)
    np.testing.assert_allclose([float(mine(c, total, np)) for c in counts], expected, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("total", [1, 2, 5, 7, 31, 99, 100, 1001, 1732])
def test_warmup_stable_decay_is_the_piecewise_schedule_it_says(total):
    lr, warmup = 3e-3, 30

    def reference(c: int) -> float:  # plain Python, float64
        w = min(warmup, max(total - 1, 0))
        stable_end = max(total - total // 5, w)
        if c < w:
            return lr * c / max(w, 1)
        return 0.1 * lr + 0.9 * lr * min(max((total - c) / max(total - stable_end, 1), 0.0), 1.0)

    schedule = make_schedule("warmup-stable-decay", lr, warmup)
    counts = range(total + 3)
    for xp in (jnp, np):
        np.testing.assert_allclose(
            [float(schedule(c, total, xp)) for c in counts], [reference(c) for c in counts], rtol=1e-5, atol=1e-9
        )
    # Up to the start of the decay the rate does not depend on the length (once the length is
    # past the warmup): the replan's premise.
    if total <= warmup:
        return
    longer = [float(schedule(c, 2 * total + 10, np)) for c in range(total - total // 5)]
    assert longer == [float(schedule(c, total, np)) for c in range(total - total // 5)]


def test_a_replan_never_moves_the_decay_before_the_step_it_is_made_at():
    from leanstep.training.budget import BudgetPlan, replan

    config = RunConfig(schedule="warmup-stable-decay", warmup_steps=5, steps=100)
    plan = BudgetPlan(
        budget_s=10.0,
        planned_at_s=1.0,
        compile_s=1.0,
        step_s=0.01,
        step_times_s=(0.01,) * 4,
        eval_s=0.0,
        checkpoint_s=0.0,
        finish_s=0.0,
        steps=100,
        replan_at=75,
        calibrated_steps=100,
    )
    slow = replan(plan, config, 75, elapsed_s=9.9, step_times_s=[1.0] * 75)  # out of time: one more step fits
    assert slow.steps - slow.steps // 5 > 75 and slow.loop_step_s == 1.0
    fast = replan(plan, config, 75, elapsed_s=2.0, step_times_s=[0.5] * 40 + [0.01] * 35)  # the recent pace
    assert fast.steps == 75 + math.floor(8.0 / 0.01) and fast.loop_step_s == 0.01


def test_adamw_with_the_length_in_its_state_equals_optax_adamw():
    config = RunConfig(
        size="tiny", optimizer="adamw", steps=40, warmup_steps=5, lr=1e-2, weight_decay=0.1, schedule="warmup-cosine"
    )
    mine, _ = build_run(config).optimizer, None
    reference = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 40, end_value=1e-3), b1=0.9, b2=0.95, weight_decay=0.1
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
    a, b = mine.init(params), reference.init(params)
    p, q = params, params
    for i in range(12):
        grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), p)
        ua, a = mine.update(grads, a, p)
        ub, b = reference.update(jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), q), b, q)
        p, q = optax.apply_updates(p, ua), optax.apply_updates(q, ub)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), p, q)


def test_the_length_is_a_value_of_the_state_not_of_the_compiled_update():
    tx = scale_by_run_schedule(make_schedule("cosine", 1.0, 0), total=10)
    update = jax.jit(tx.update)
    grads = {"w": jnp.ones(3)}
    state = tx.init(grads)
    first, _ = update(grads, set_total_steps(state, 10))
    update(grads, set_total_steps(state, 1000))
    assert update._cache_size() == 1  # one program for every length
    assert float(first["w"][0]) == -1.0


# --- budgeted runs ---------------------------------------------------------------------------


@pytest.mark.slow  # a budget of 8 s or more: the budget is the point
def test_a_budgeted_run_stops_within_the_budget_plus_one_step_and_records_its_plan(tmp_path, corpus):
    # The budget is sized to this machine, now: a few times what a 2-step run takes in all.
    start = time.perf_counter()
    train(RunConfig(**FAST, data=str(corpus), out=str(tmp_path / "probe"), steps=2))
    out, budget_s = tmp_path / "budgeted", round(max(8.0, 2.5 * (time.perf_counter() - start)), 1)
    start, notes = time.perf_counter(), []
    train(
        RunConfig(**FAST, data=str(corpus), out=str(out), time_budget=budget_s),
        on_record=lambda *records: notes.extend(r.message for r in records if isinstance(r, Note)),
    )
    wall = time.perf_counter() - start
    saved = json.loads((out / "config.json").read_text())
    plan, steps = saved["time_budget_plan"], saved["run"]["steps"]
    assert plan["budget_s"] == budget_s and plan["steps"] == steps >= 1
    assert plan["step_s"] > 0 and len(plan["step_times_s"]) == 4 and plan["planned_at_s"] < budget_s
    records = _records(out, "train")
    step_times = [4 * 8 / r["tokens_per_sec"] for r in records]
    # Every step ran (or the run says the budget ran out first), and the last one ended within
    # the budget plus one step.
    ran_out = [note for note in notes if "time budget ran out" in note]
    assert len(records) == steps or (ran_out and len(records) < steps), notes
    assert records[-1]["elapsed_s"] <= budget_s + max(step_times), (records[-1]["elapsed_s"], wall, plan)
    assert _records(out, "eval")[-1]["step"] == records[-1]["step"]
    # The end, the summary and chart written, on the budget's clock: after the last step, within the call.
    summary = json.loads((out / "summary.json").read_text())
    assert records[-1]["elapsed_s"] < summary["ended_s"] < wall, (summary, wall)
    if plan["replan_at"] is not None and len(records) == steps:
        # Planned again after the warmup, from the loop's own times: the run is the run of
        # --steps N, bit for bit.
        assert plan["loop_step_s"] > 0 and plan["calibrated_steps"] >= 1
        fixed = tmp_path / "fixed"
        train(RunConfig(**FAST, data=str(corpus), out=str(fixed), steps=steps))
        assert [r["loss"] for r in _records(fixed, "train")] == [r["loss"] for r in records]


def _fixed_calibration(step_s: float):
    real = budget.calibrate

    def calibrate(*args, **kwargs):
        measured = real(*args, **kwargs)  # really runs (and compiles) the step, then says a step takes step_s
        return {**measured, "step_s": step_s, "step_times_s": (step_s,) * 4}

    return calibrate


def _final_state(out: Path, config: RunConfig):
    run = build_run(dataclasses_replace(config, steps=1))
    with Checkpointer(out / "checkpoints") as checkpointer:
        restored = checkpointer.restore(run.init_state())
    return restored.step, restored.state


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_a_budgeted_run_stopped_and_resumed_is_bit_identical_to_one_of_its_planned_steps(tmp_path, corpus, monkeypatch):
    # The plan's timing is fixed (a step "takes" 40 s of a 600 s budget), so the run plans a
    # dozen steps whatever this machine's speed, and never runs out of time.
    monkeypatch.setattr(budget, "calibrate", _fixed_calibration(40.0))
    base = RunConfig(**{**FAST, "eval_every": 3}, data=str(corpus), time_budget=600.0)
    stopped = dataclasses_replace(base, out=str(tmp_path / "stopped"), stop_at=4)
    with pytest.raises(RunStopped, match="--stop-at") as caught:
        train(stopped)
    assert caught.value.exit_code == 0
    planned = json.loads((tmp_path / "stopped" / "config.json").read_text())["run"]["steps"]
    assert 10 <= planned <= 14
    monkeypatch.setattr(budget, "calibrate", _fixed_calibration(1.0))  # a resume must not plan again
    train(dataclasses_replace(stopped, stop_at=None), resume=True)
    fixed = dataclasses_replace(base, out=str(tmp_path / "fixed"), steps=planned, time_budget=None)
    train(fixed)
    (step_a, a), (step_b, b) = _final_state(tmp_path / "stopped", base), _final_state(tmp_path / "fixed", base)
    assert step_a == step_b == planned
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params, b.params)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.opt_state, b.opt_state)
    losses = [[r["loss"] for r in _records(tmp_path / name, "train")] for name in ("stopped", "fixed")]
    assert losses[0] == losses[1] and len(losses[0]) == planned


def test_a_budget_too_short_for_one_step_is_refused_before_anything_is_written(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(budget, "calibrate", _fixed_calibration(500.0))
    with pytest.raises(ValueError, match="--time-budget 100s leaves no time for a step"):
        train(RunConfig(**FAST, data=str(corpus), out=str(tmp_path / "short"), time_budget=100.0))
    assert not (tmp_path / "short" / "config.json").exists()


# --- --precision auto ------------------------------------------------------------------------

AVX2_CPU = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
AMX_CPU = "processor\t: 0\nmodel name\t: Intel Xeon Platinum 8480+\nflags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16\n"


@pytest.mark.parametrize(("cpuinfo", "says"), [
    (AVX2_CPU, "without AMX"),
    (AMX_CPU, "a CPU with amx_bf16 and avx512_bf16, which XLA:CPU does not multiply bfloat16 on"),
    (None, "cannot be read"),
])  # fmt: skip
def test_auto_precision_computes_in_float32_on_any_cpu_and_records_why(tmp_path, corpus, monkeypatch, cpuinfo, says):
    monkeypatch.setattr(auto_precision, "cpuinfo_text", lambda: cpuinfo)
    out = tmp_path / "auto"
    train(RunConfig(**FAST, data=str(corpus), out=str(out), steps=2))
    saved = json.loads((out / "config.json").read_text())
    assert saved["run"]["precision"] == auto_precision.FLOAT32
    assert says in saved["precision_reason"]


@pytest.mark.parametrize(("platform", "capability", "compute"), [
    ("cuda", "9.0", "bfloat16"), ("cuda", "7.5", "float32"), ("rocm", None, "bfloat16"), ("tpu", None, "bfloat16"),
])  # fmt: skip
def test_auto_precision_on_accelerators_goes_by_their_bfloat16_units(platform, capability, compute):
    chosen, _ = auto_precision.choose_precision(platform, compute_capability=capability)
    assert chosen == f"params=float32,compute={compute},output=float32"


def test_auto_precision_on_this_machine_is_float32_on_a_cpu_and_says_why():
    run = build_run(RunConfig(size="tiny", steps=1))
    if jax.default_backend() == "cpu":
        assert run.config.precision == auto_precision.FLOAT32 and run.precision_reason.startswith("a CPU")
    else:
        assert run.config.precision == auto_precision.BFLOAT16 or "no bfloat16" in run.precision_reason


def test_a_resumed_auto_run_keeps_the_precision_it_chose(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(auto_precision, "cpuinfo_text", lambda: AVX2_CPU)
    config = RunConfig(**FAST, data=str(corpus), out=str(tmp_path / "keep"), steps=4, stop_at=2)
    with pytest.raises(RunStopped):
        train(config)
    # "another machine" now, one where auto would choose bfloat16
    monkeypatch.setattr(auto_precision, "device_precision", lambda: (auto_precision.BFLOAT16, "a stand-in"))
    assert auto_precision.resolve_precision("auto")[0] == auto_precision.BFLOAT16
    train(dataclasses_replace(config, stop_at=None), resume=True)
    saved = json.loads((tmp_path / "keep" / "config.json").read_text())
    assert saved["run"]["precision"] == auto_precision.FLOAT32
    assert math.isfinite(_records(tmp_path / "keep", "train")[-1]["loss"])


def test_a_run_checkpointed_by_leanstep_0_5_resumes_bit_identically(tmp_path, corpus):
    # 0.5's optimizer state ended in optax.ScaleByScheduleState(count) (optax.adamw of an optax
    # schedule); such a checkpoint is made here from a real one, then resumed.
    from leanstep.training.legacy_state import to_legacy

    config = RunConfig(**FAST, optimizer="adamw", data=str(corpus), steps=6)  # 0.5 trained AdamW
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(dataclasses_replace(config, out=str(straight)))
    with pytest.raises(RunStopped):
        train(dataclasses_replace(config, out=str(stopped), stop_at=3))
    template = build_run(config).init_state()
    with Checkpointer(stopped / "checkpoints") as checkpointer:
        restored = checkpointer.restore(template)
        assert restored.step == 3
        checkpointer.delete_newer_than(2)
        legacy = restored.state.replace(opt_state=to_legacy(restored.state.opt_state))
        assert isinstance(legacy.opt_state[2], optax.ScaleByScheduleState)  # what optax.adamw's state ends in
        checkpointer.save(3, legacy, extra=restored.extra)
    with Checkpointer(stopped / "checkpoints") as checkpointer, pytest.raises(Exception, match="total"):
        checkpointer.restore(template)  # only the 0.5-style step is there
    train(dataclasses_replace(config, out=str(stopped)), resume=True)
    (_, a), (_, b) = _final_state(straight, config), _final_state(stopped, config)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params, b.params)
