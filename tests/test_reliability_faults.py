"""Reliability under faults: non-finite numbers, stuck runs, killed runs, corrupt checkpoints, full disks.

References: a plain-Python model of the dynamic loss scale that also predicts, from the injected
fault alone, which steps overflow; float64 NumPy for the one applied gradient; bit patterns for
"unchanged"; and, for killed runs, an uninterrupted run of the same length that keeps every
checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import leanstep.checkpoints.checkpointer
import leanstep.training.curves
from helpers.tiny_runs import QUIET, TINY_MLP
from leanstep.blocks.loss_scale import DynamicLossScale, all_finite
from leanstep.checkpoints.checkpointer import MANIFEST_NAME, Checkpointer
from leanstep.checkpoints.layout import unfinished_saves
from leanstep.cli.main import main
from leanstep.models import build_model
from leanstep.step.train_step import TrainState, make_train_step
from leanstep.training import RunConfig, build, build_optimizer, trainer

# --- a linear model whose gradients the batch controls ---------------------------------------


@jax.custom_vjp
def _poke(value: jax.Array, delta: jax.Array) -> jax.Array:
    """The identity; its gradient gets ``delta`` added, so one leaf's gradient can be poisoned alone."""
    return value


def _poke_fwd(value: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    return value, delta


def _poke_bwd(delta: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cotangent + delta.astype(cotangent.dtype), jnp.zeros_like(delta)


_poke.defvjp(_poke_fwd, _poke_bwd)


def linear_loss(params: dict, batch: dict) -> jax.Array:
    """``mean(x @ w + t * b + poison)``: grad w = mean(x), grad b = mean(t) + sum(delta), whatever the params.

    ``poison`` reaches the loss only, ``delta`` the gradient of ``b`` only, ``x`` both.
    """
    b = _poke(params["b"], jnp.sum(batch["delta"]))
    return jnp.mean(batch["x"] @ params["w"] + batch["t"] * b + batch["poison"])


ROWS, MICROBATCHES = 4, 2
F16 = "params=float32,compute=float16,output=float32"


def clean_batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
    # Multiples of 1/16 in [-1, 1]: every float16 sum and power-of-two scaling below is exact.
    return {
        "x": rng.integers(-16, 17, (ROWS, 3)).astype(np.float32) / 16,
        "t": rng.integers(-16, 17, (ROWS,)).astype(np.float32) / 16,
        "poison": np.zeros(ROWS, np.float32),
        "delta": np.zeros(ROWS, np.float32),
    }


def init_state(optimizer: optax.GradientTransformation, loss_scale: Any) -> TrainState:
    return TrainState.create(
        {"w": jnp.array([0.125, -0.25, 0.375]), "b": jnp.float32(0.5)}, optimizer, loss_scale=loss_scale
    )


def host(tree: Any) -> list[np.ndarray]:
    """A host copy of every leaf (the step donates its input state)."""
    return [np.array(leaf) for leaf in jax.tree.leaves(tree)]


def assert_bits_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# --- 2. non-finite numbers: each injection, one step ------------------------------------------

# (id, where, row, value, loss stays finite, needs a patch in step.py)
INJECTIONS = [
    ("nan_in_input", "x", 0, np.nan, False, False),
    ("inf_in_input", "x", 1, np.inf, False, False),
    ("minus_inf_in_second_microbatch_only", "x", 3, -np.inf, False, False),
    ("nan_in_gradient_of_one_leaf", "delta", 2, np.nan, True, False),
    ("inf_in_gradient_of_one_leaf", "delta", 3, np.inf, True, False),
    ("nan_in_loss_only", "poison", 1, np.nan, False, True),
    ("inf_in_loss_only", "poison", 2, np.inf, False, True),
]


@pytest.fixture(scope="module")
def jitted_steps() -> dict[str, Any]:
    """One compiled step per precision, shared by every injection (batches differ, shapes do not)."""
    optimizer = optax.adam(1e-2)
    return {
        precision: (
            make_train_step(linear_loss, precision=precision, num_microbatches=MICROBATCHES, max_grad_norm=1.0),
            optimizer,
        )
        for precision in ("float32", "params=float32,compute=bfloat16,output=float32", F16)
    }


def _injection_params() -> list[Any]:
    cases = []
    for name, where, row, value, loss_finite, _ in INJECTIONS:
        cases.append(pytest.param(where, row, value, loss_finite, id=name))
    return cases


@pytest.mark.parametrize(
    "precision", ["float32", "params=float32,compute=bfloat16,output=float32", F16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize(("where", "row", "value", "loss_finite"), _injection_params())
def test_a_non_finite_step_is_skipped_and_leaves_the_state_bit_identical(
    jitted_steps, precision, where, row, value, loss_finite
):
    step, optimizer = jitted_steps[precision]
    rng = np.random.default_rng(row)
    state = init_state(optimizer, DynamicLossScale.create(2.0**12, growth_interval=3))
    before = host((state.params, state.opt_state))
    batch = clean_batch(rng)
    batch[where][row, ...] = value
    state, metrics = step(state, batch)
    assert bool(metrics.skipped) and int(metrics.consecutive_skips) == 1 and not bool(metrics.clipped)
    assert_bits_equal(host((state.params, state.opt_state)), before)
    assert float(metrics.loss_scale) == 2.0**12 and float(state.loss_scale.loss_scale) == 2.0**11
    # The metrics say what went wrong: a non-finite gradient norm, and a non-finite loss when it was.
    assert np.isfinite(float(metrics.loss)) == loss_finite
    assert not np.isfinite(float(metrics.grad_norm)) or not np.isfinite(float(metrics.loss))
    # The state is still good: the next clean step is applied.
    state, metrics = step(state, clean_batch(rng))
    assert not bool(metrics.skipped) and int(metrics.consecutive_skips) == 0
    assert all(np.all(np.isfinite(leaf)) for leaf in host(state.params))


def test_overflow_only_under_the_loss_scale_backs_off_then_applies_the_exact_gradient():
    """x = 96 in one row: the float16 scaled gradient S * 96 / 2 overflows for S >= 2**11 only."""
    optimizer = optax.sgd(0.5)
    step = make_train_step(linear_loss, precision=F16, num_microbatches=MICROBATCHES, max_grad_norm=100.0)
    state = init_state(optimizer, DynamicLossScale.create(2.0**15))
    batch = clean_batch(np.random.default_rng(7))
    batch["x"][1, 2] = 96.0
    for i, scale in enumerate([2.0**15, 2.0**14, 2.0**13, 2.0**12, 2.0**11]):
        before = host((state.params, state.opt_state))
        state, metrics = step(state, batch)
        assert bool(metrics.skipped) and float(metrics.loss_scale) == scale
        assert int(metrics.consecutive_skips) == i + 1
        assert np.isfinite(float(metrics.loss))  # the loss itself never overflows
        assert_bits_equal(host((state.params, state.opt_state)), before)
    params = {k: np.asarray(v, np.float64) for k, v in state.params.items()}
    state, metrics = step(state, batch)
    assert not bool(metrics.skipped) and float(metrics.loss_scale) == 2.0**10
    expected_w = params["w"] - 0.5 * batch["x"].astype(np.float64).mean(axis=0)
    expected_b = params["b"] - 0.5 * batch["t"].astype(np.float64).mean()
    np.testing.assert_array_equal(np.asarray(state.params["w"]), expected_w.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(state.params["b"]), np.float32(expected_b))


def test_a_finite_gradient_whose_norm_overflows_float32_is_clipped_and_applied():
    """Its float32 sum of squares overflows; the norm is summed scaled (issue 57, item 3), so the step is
    applied: plain SGD at rate 1 moves the parameters by the clip, 1.0, measured in float64."""
    step = make_train_step(linear_loss, num_microbatches=MICROBATCHES, max_grad_norm=1.0)
    state = init_state(optax.sgd(1.0), "none")  # delta reaches the gradient unscaled: a loss scale would shrink it
    before = host(state.params)
    batch = clean_batch(np.random.default_rng(3))
    batch["delta"][0] = 1e20  # finite in float32; its square is not
    state, metrics = step(state, batch)
    assert not bool(metrics.skipped) and bool(metrics.clipped)
    assert 1e19 < float(metrics.grad_norm) < 1e21
    moved = np.sqrt(sum(np.sum((np.float64(a) - np.float64(b)) ** 2) for a, b in zip(host(state.params), before)))
    assert moved == pytest.approx(1.0, rel=1e-6)


# --- 2. non-finite numbers: 10,000 adversarial steps in one scan ---------------------------

GROWTH, HYSTERESIS, MIN_SCALE, MAX_SCALE, INIT_SCALE = 4, 2, 1.0, 2.0**15, 2.0**10
ADVERSARIAL_STEPS = 10_000
KINDS = ("clean", "input", "grad_leaf", "overflow", "loss")


def _bits(tree: Any) -> list[jax.Array]:
    return [
        jax.lax.bitcast_convert_type(leaf, jnp.uint32) if leaf.dtype == jnp.float32 else leaf
        for leaf in jax.tree.leaves(tree)
    ]


def _same_bits(a: Any, b: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(x == y) for x, y in zip(_bits(a), _bits(b))]))


@pytest.fixture(scope="module")
def adversarial_run() -> Any:
    """The raw step (``jit=False``) scanned over a sequence of batches: one compile for every sequence."""
    optimizer = optax.adam(1e-3)
    step = make_train_step(linear_loss, precision=F16, num_microbatches=MICROBATCHES, max_grad_norm=1.0, jit=False)

    @jax.jit
    def run(state: TrainState, batches: dict) -> dict:
        def body(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
            new, m = step(state, batch)
            return new, {
                "skipped": m.skipped,
                "used": m.loss_scale,
                "next": new.loss_scale.loss_scale,
                "consecutive": m.consecutive_skips,
                "loss": m.loss,
                "norm": m.grad_norm,
                "same_params": _same_bits(new.params, state.params),
                "same_opt": _same_bits(new.opt_state, state.opt_state),
                "finite_params": all_finite(new.params),
            }

        return jax.lax.scan(body, state, batches)[1]

    def go(batches: dict) -> dict:
        state = init_state(
            optimizer,
            DynamicLossScale.create(
                INIT_SCALE,
                growth_interval=GROWTH,
                min_loss_scale=MIN_SCALE,
                max_loss_scale=MAX_SCALE,
                hysteresis=HYSTERESIS,
            ),
        )
        return jax.device_get(run(state, batches))

    return go


def adversarial_batches(
    seed: int, kinds: tuple[str, ...], clean_fraction: float
) -> tuple[dict, np.ndarray, np.ndarray]:
    """Batches with one fault each (in one row, so in one microbatch), and bursts of faults."""
    n, rng = ADVERSARIAL_STEPS, np.random.default_rng(seed)
    x = rng.integers(-16, 17, (n, ROWS, 3)).astype(np.float32) / 16
    t = rng.integers(-16, 17, (n, ROWS)).astype(np.float32) / 16
    poison, delta = np.zeros((n, ROWS), np.float32), np.zeros((n, ROWS), np.float32)
    kind = rng.choice(np.array(kinds), size=n)
    kind[rng.random(n) < clean_fraction] = "clean"
    for start in np.flatnonzero(rng.random(n) < 0.003):  # bursts drive the scale to its minimum
        kind[start : start + 40] = "input"
    # And for certain: a clean stretch up to the maximum scale, then a faulty one down to the minimum.
    kind[:40], kind[40:100] = "clean", "input"
    row, col = rng.integers(0, ROWS, n), rng.integers(0, 3, n)
    value = rng.choice(np.array([np.nan, np.inf, -np.inf]), n)
    exponent = rng.integers(3, 12, n)  # overflow rows hold 1.5 * 2**k
    for i in range(n):
        if kind[i] == "input":
            x[i, row[i], col[i]] = value[i]
        elif kind[i] == "grad_leaf":
            delta[i, row[i]] = value[i]
        elif kind[i] == "loss":
            poison[i, row[i]] = value[i]
        elif kind[i] == "overflow":
            x[i, row[i], col[i]] = 1.5 * 2.0 ** exponent[i]
    return {"x": x, "t": t, "poison": poison, "delta": delta}, kind, exponent


def reference_run(kind: np.ndarray, exponent: np.ndarray) -> dict[str, np.ndarray]:
    """Plain Python: which steps must skip, and the loss scale and skip count each one sees.

    A fault skips; an overflow row 1.5 * 2**k scaled by S = 2**s gives S * 1.5 * 2**k / 2 in the
    float16 gradient, which overflows (> 65504) exactly when k + s >= 17 (the other row adds at
    most S / 2, too little to cross either way for k >= 3).
    """
    scale, good, bad, consecutive = INIT_SCALE, 0, 0, 0
    skipped, used, counts = [], [], []
    for k, e in zip(kind, exponent):
        skip = k in ("input", "grad_leaf", "loss") or (k == "overflow" and e + np.log2(scale) >= 17)
        consecutive = consecutive + 1 if skip else 0
        skipped.append(skip), used.append(scale), counts.append(consecutive)
        if skip:
            good, bad = 0, bad + 1
            if bad >= HYSTERESIS:
                scale, bad = max(scale / 2, MIN_SCALE), 0
        else:
            good, bad = good + 1, 0
            if good >= GROWTH:
                scale, good = min(scale * 2, MAX_SCALE), 0
    return {"skipped": np.array(skipped), "used": np.array(used), "consecutive": np.array(counts)}


def check_adversarial(go: Any, seed: int, kinds: tuple[str, ...], clean_fraction: float) -> None:
    batches, kind, exponent = adversarial_batches(seed, kinds, clean_fraction)
    got, want = go(batches), reference_run(kind, exponent)
    faulty = np.isin(kind, ["input", "grad_leaf", "loss"])
    assert np.all(got["skipped"][faulty]), "a step with a NaN/Inf was applied"
    np.testing.assert_array_equal(got["skipped"], want["skipped"])
    np.testing.assert_array_equal(got["used"], want["used"])
    np.testing.assert_array_equal(got["consecutive"], want["consecutive"])
    skipped = got["skipped"]
    assert np.all(got["same_params"][skipped]) and np.all(got["same_opt"][skipped])
    assert np.all(got["finite_params"])
    for scale in (got["used"], got["next"]):
        assert np.all(np.isfinite(scale)) and np.all((scale >= MIN_SCALE) & (scale <= MAX_SCALE))
    assert np.all(~np.isfinite(got["norm"][skipped]) | ~np.isfinite(got["loss"][skipped]))
    # The sequence exercised what it claims to: both clamps, and overflows skipped and applied.
    overflow = kind == "overflow"
    assert np.any(got["used"] == MIN_SCALE) and np.any(got["used"] == MAX_SCALE)
    assert np.any(skipped & overflow) and np.any(~skipped & overflow)


# No shrinking: every example is 10,000 steps, and a failure names its seed.
@settings(max_examples=4, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(seed=st.integers(0, 2**32 - 1), clean_fraction=st.floats(0.3, 0.7))
def test_10000_adversarial_steps_skip_exactly_the_faulty_ones(adversarial_run, seed, clean_fraction):
    check_adversarial(adversarial_run, seed, KINDS[:4], clean_fraction)


def test_10000_adversarial_steps_with_faults_in_the_loss_too(adversarial_run):
    check_adversarial(adversarial_run, 0, KINDS, 0.5)


# --- shared pieces of the run-level tests ---------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tiny_corpus) -> Path:
    """The tiny run's data (tests/conftest.py): the runs here only read it."""
    return tiny_corpus


# In-process runs: the smallest model in float32, so each run compiles fast.
FAST = [
    *TINY_MLP,
    "--microbatches",
    "2",
    "--precision",
    "float32",
    "--remat",
    "none",
    "--eval-every",
    "1000",
    "--eval-batches",
    "1",
    *QUIET,
    "--schedule",
    "constant",
    "--lr",
    "1e-2",
]
FAST_CONFIG = RunConfig(
    model="mlp", size="tiny", batch_size=4, seq_len=8, precision="float32", remat="none", schedule="constant", lr=1e-2
)


def template_state(config: RunConfig, loss_scale: float = 2.0**15) -> TrainState:
    model = build_model(config.model, config.size, seq_len=config.seq_len)
    optimizer, _ = build_optimizer(config)
    return TrainState.create(
        model.init(jax.random.key(config.seed)),
        optimizer,
        loss_scale=DynamicLossScale.create(loss_scale),
        seed=config.seed,
    )


def restore(run: Path, template: TrainState, step: int | None = None) -> Any:
    with Checkpointer(run / "checkpoints") as checkpointer:
        return checkpointer.restore(template, step=step)


def train_records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def one_line_error(capsys: Any) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("leanstep train:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def no_plot(monkeypatch):
    """The end-of-run chart costs seconds and is not what these tests are about."""
    monkeypatch.setattr(leanstep.training.curves, "plot_curves", lambda metrics, path, **kwargs: path)


# --- 2. a run stuck at the minimum loss scale stops ----------------------------------------


def test_a_run_stuck_at_the_minimum_loss_scale_stops_and_keeps_its_last_good_checkpoint(
    tmp_path, corpus, capsys, monkeypatch, no_plot
):
    """From step 5 on every batch carries a NaN. The scale backs off 16 -> 1 over steps 5-8 (skips
    that are the loss scale doing its job), then sits at 1 for steps 9, 10, 11: stop after 3."""
    real_make_train_step = build.make_train_step

    def make_poisoned_step(loss_fn, *args, **kwargs):
        def loss(params, batch):
            return loss_fn(params, {"tokens": batch["tokens"]}) * (1 + jnp.mean(batch["poison"]))

        return real_make_train_step(loss, *args, **kwargs)

    class PoisonedSampler(trainer.BatchSampler):
        def batch_at(self, step: int) -> dict:
            poison = np.full(self.batch_size, np.nan if step >= 4 else 0.0, np.float32)
            return {**super().batch_at(step), "poison": poison}

    monkeypatch.setattr(build, "make_train_step", make_poisoned_step)
    monkeypatch.setattr(trainer, "BatchSampler", PoisonedSampler)
    run = tmp_path / "stuck"
    code = main(
        [
            "train",
            *FAST,
            "--data",
            str(corpus),
            "--out",
            str(run),
            "--steps",
            "40",
            "--initial-loss-scale",
            "16",
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "10",
            "--max-consecutive-skips",
            "3",
        ]
    )
    assert code == 1
    message = one_line_error(capsys)
    assert "stopped at step 11: the loss scale sat at its minimum (1) for 3 skipped steps in a row" in message
    assert "the last checkpoint (step 8) is intact" in message
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, 12))
    assert [r["skipped"] for r in records] == [False] * 4 + [True] * 7
    assert [r["consecutive_skips"] for r in records] == [0] * 4 + list(range(1, 8))
    assert [r["loss_scale"] for r in records[4:]] == [16, 8, 4, 2, 1, 1, 1]
    assert all(np.isnan(r["loss"]) for r in records[4:]) and all(np.isfinite(r["loss"]) for r in records[:4])
    # Steps skipped at the minimum are never checkpointed; the ones before are whole and verified.
    assert Checkpointer(run / "checkpoints").all_steps() == [2, 4, 6, 8]
    template = template_state(FAST_CONFIG, 16.0)
    last, good = restore(run, template), restore(run, template, step=4)
    assert last.step == 8 and last.skipped == ()
    assert_bits_equal(host(last.state.params), host(good.state.params))
    assert_bits_equal(host(last.state.opt_state), host(good.state.opt_state))
    assert float(last.state.loss_scale.loss_scale) == 1.0


# --- 4. corrupt checkpoints ---------------------------------------------------------------


def _largest_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    return max(files, key=lambda p: (p.stat().st_size, str(p)))


def _truncate(step_dir: Path) -> None:
    path = _largest_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bit(step_dir: Path) -> None:
    path = _largest_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _delete_data_file(step_dir: Path) -> None:
    _largest_file(step_dir).unlink()


def _delete_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST_NAME).unlink()


def _truncate_manifest(step_dir: Path) -> None:
    path = step_dir / MANIFEST_NAME
    path.write_bytes(path.read_bytes()[:40])


def _flip_bit_in_extra(step_dir: Path) -> None:
    path = step_dir / "extra" / "metadata"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# corruption -> what the warning says about it
CORRUPTIONS = {
    _truncate: "bytes, expected",
    _flip_bit: "has the wrong sha256",
    _delete_data_file: "missing",
    _delete_manifest: "no manifest",
    _truncate_manifest: "manifest unreadable",
    _flip_bit_in_extra: "extra/metadata has the wrong sha256",
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus) -> Path:
    """Six steps, checkpoints at 2, 4 and 6."""
    run = tmp_path_factory.mktemp("corrupt") / "base"
    assert (
        main(
            [
                "train",
                *FAST,
                "--data",
                str(corpus),
                "--out",
                str(run),
                "--steps",
                "6",
                "--checkpoint-every",
                "2",
                "--keep-checkpoints",
                "3",
            ]
        )
        == 0
    )
    return run


def _resume(run: Path, corpus: Path, steps: int) -> int:
    # --steps equal to the step it falls back to: the resume restores, reports and stops, no compile.
    return main(
        [
            "train",
            *FAST,
            "--data",
            str(corpus),
            "--out",
            str(run),
            "--steps",
            str(steps),
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "3",
            "--resume",
        ]
    )


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=lambda f: f.__name__.strip("_"))
def test_a_corrupt_latest_checkpoint_is_passed_over_with_a_warning(
    tmp_path, corpus, capsys, finished_run, no_plot, corrupt
):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    corrupt(run / "checkpoints" / "6")
    assert _resume(run, corpus, 4) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: skipped damaged checkpoint step 6: " in err and CORRUPTIONS[corrupt] in err
    assert "warning: resuming from step 4, the newest intact checkpoint" in err
    # The damaged step is gone, the log is cut back to the state, and step 4 is the original.
    assert Checkpointer(run / "checkpoints").all_steps() == [2, 4]
    assert [r["step"] for r in train_records(run)] == [1, 2, 3, 4]
    template = template_state(FAST_CONFIG)
    assert_bits_equal(host(restore(run, template).state), host(restore(finished_run, template, step=4).state))


def test_a_deleted_latest_checkpoint_resumes_from_the_one_before(tmp_path, corpus, capsys, finished_run, no_plot):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints" / "6")
    assert _resume(run, corpus, 4) == 0
    assert [r["step"] for r in train_records(run)] == [1, 2, 3, 4]
    assert Checkpointer(run / "checkpoints").all_steps() == [2, 4]


def test_two_corrupt_checkpoints_fall_back_two_steps(tmp_path, corpus, capsys, finished_run, no_plot):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _flip_bit(run / "checkpoints" / "6")
    _delete_manifest(run / "checkpoints" / "4")
    assert _resume(run, corpus, 2) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped damaged checkpoint step 6: files do not match" in err
    assert "skipped damaged checkpoint step 4: no manifest" in err and "resuming from step 2" in err
    assert Checkpointer(run / "checkpoints").all_steps() == [2]


def test_no_intact_checkpoint_stops_with_a_clear_error_and_deletes_nothing(
    tmp_path, corpus, capsys, finished_run, no_plot
):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for step, corrupt in ((2, _truncate), (4, _delete_manifest), (6, _flip_bit)):
        corrupt(run / "checkpoints" / str(step))
    assert _resume(run, corpus, 6) == 1
    message = one_line_error(capsys)
    assert "--resume: no checkpoint of the run can be restored, so it cannot continue" in message
    for reason in ("step 6: files do not match", "step 4: no manifest", "step 2: files do not match"):
        assert reason in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4", "6"]


def test_resuming_with_fewer_steps_than_the_run_reached_is_a_clear_error(tmp_path, corpus, capsys, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert _resume(run, corpus, 4) == 2
    assert capsys.readouterr().err == (
        "leanstep train: error: --steps 4 is below step 6, which the run has reached; pass --steps 6 or more\n"
    )
    assert Checkpointer(run / "checkpoints").all_steps() == [2, 4, 6]
    assert json.loads((run / "config.json").read_text())["run"]["steps"] == 6


def test_a_checkpoint_written_by_another_config_is_refused(tmp_path, corpus, capsys, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    config = json.loads((run / "config.json").read_text())
    config["run"]["seed"] = 5  # config.json now claims another run, the checkpoints do not
    (run / "config.json").write_text(json.dumps(config))
    assert (
        main(
            [
                "train",
                *FAST,
                "--data",
                str(corpus),
                "--out",
                str(run),
                "--steps",
                "6",
                "--seed",
                "5",
                "--checkpoint-every",
                "2",
                "--keep-checkpoints",
                "3",
                "--resume",
            ]
        )
        == 2
    )
    assert "--resume: checkpoint step 6 in " in capsys.readouterr().err
    assert Checkpointer(run / "checkpoints").all_steps() == [2, 4, 6]


# --- 5. disk full, unwritable output ------------------------------------------------------


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_checkpoint_write_that_hits_a_full_disk_stops_and_keeps_the_earlier_ones(
    tmp_path, corpus, capsys, monkeypatch, no_plot
):
    real_save = leanstep.checkpoints.checkpointer.ocp.AsyncCheckpointer.save

    def save(self, directory, *args, **kwargs):
        if int(Path(directory).name) >= 4:
            raise _enospc()
        return real_save(self, directory, *args, **kwargs)

    monkeypatch.setattr(leanstep.checkpoints.checkpointer.ocp.AsyncCheckpointer, "save", save)
    run = tmp_path / "full"
    assert (
        main(["train", *FAST, "--data", str(corpus), "--out", str(run), "--steps", "10", "--checkpoint-every", "2"])
        == 1
    )
    message = one_line_error(capsys)
    assert "stopped at step 4: its checkpoint could not be written" in message
    assert "No space left on device" in message and "the last checkpoint (step 2) is intact" in message
    restored = restore(run, template_state(FAST_CONFIG))
    assert restored.step == 2 and restored.skipped == ()


class _FullDiskWrite:
    """A commit future of orbax's background write that finds the disk full (after a moment's work)."""

    def result(self, timeout: float | None = None) -> None:
        time.sleep(0.05)
        raise _enospc()


def test_a_background_checkpoint_write_that_hits_a_full_disk_stops_and_keeps_the_earlier_ones(
    tmp_path, corpus, capsys, monkeypatch, no_plot
):
    handler = leanstep.checkpoints.checkpointer.ocp.CompositeCheckpointHandler
    real_async_save = handler.async_save
    seen: list[int] = []

    async def async_save(self, directory, *args, **kwargs):
        futures = await real_async_save(self, directory, *args, **kwargs)
        step = int(Path(directory).name.split(".")[0])  # orbax's temporary folder for the step
        seen.append(step)
        return [*(futures or []), _FullDiskWrite()] if step >= 4 else futures

    monkeypatch.setattr(handler, "async_save", async_save)
    run = tmp_path / "full"
    code = main(["train", *FAST, "--data", str(corpus), "--out", str(run), "--steps", "10", "--checkpoint-every", "2"])
    assert code == 1 and 4 in seen
    message = one_line_error(capsys)
    assert "the checkpoint of step 4 could not be written" in message, message
    assert "No space left on device" in message and "the last checkpoint (step 2) is intact" in message
    assert unfinished_saves(run / "checkpoints") == []  # the failed write's files are gone
    restored = restore(run, template_state(FAST_CONFIG))
    assert restored.step == 2 and restored.skipped == ()
    # the run stopped at the first step after the failure it could see, never past the next save
    assert train_records(run)[-1]["step"] <= 6


def test_a_metrics_write_that_hits_a_full_disk_stops_and_keeps_the_checkpoints(
    tmp_path, corpus, capsys, monkeypatch, no_plot
):
    real_open = Path.open

    class FullAfterThreeWrites:
        def __init__(self, file: Any) -> None:
            self._file, self._writes = file, 0

        def write(self, text: str) -> int:
            self._writes += 1
            if self._writes > 3:
                raise _enospc()
            return self._file.write(text)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

    def open_(self, mode="r", *args, **kwargs):
        file = real_open(self, mode, *args, **kwargs)
        return FullAfterThreeWrites(file) if self.name == "metrics.jsonl" and mode == "a" else file

    monkeypatch.setattr(Path, "open", open_)
    run = tmp_path / "full"
    assert (
        main(["train", *FAST, "--data", str(corpus), "--out", str(run), "--steps", "10", "--checkpoint-every", "2"])
        == 1
    )
    message = one_line_error(capsys)
    assert f"cannot write {run / 'metrics.jsonl'}: [Errno 28] No space left on device" in message
    assert "the last checkpoint (step 2) is intact" in message
    assert restore(run, template_state(FAST_CONFIG)).step == 2


def test_an_output_directory_under_a_regular_file_is_a_clear_error(tmp_path, corpus, capsys):
    regular = tmp_path / "file"
    regular.write_text("x")
    assert main(["train", *FAST, "--data", str(corpus), "--out", str(regular / "run"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"leanstep train: error: --out '{regular / 'run'}' cannot be created: '{regular}' is not a directory\n"
    )
    assert regular.read_text() == "x"


# --- 3. killed runs -------------------------------------------------------------------------

KILL_STEPS = 20
# The default precision (bf16 compute, dynamic loss scale, remat) on the smallest model; a
# checkpoint every step, so that kills land in writes.
KILL_FLAGS = [
    *TINY_MLP,
    "--microbatches",
    "2",
    "--eval-every",
    "8",
    "--eval-batches",
    "1",
    "--checkpoint-every",
    "1",
    *QUIET,
    "--steps",
    str(KILL_STEPS),
]
KILL_CONFIG = RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, steps=KILL_STEPS)
# Two chains of (trigger, signal), run side by side: "ckpt+n" fires once the n-th new checkpoint
# is verified; "write" once a new checkpoint write is under way (after one new checkpoint);
# "delay" a seeded random time (0-0.3 s) after one new checkpoint, wherever the run then is.
KILL_PLANS = [
    [
        ("ckpt+2", signal.SIGKILL),
        ("write", signal.SIGKILL),
        ("ckpt+2", signal.SIGTERM),
        ("delay", signal.SIGKILL),
        ("write", signal.SIGKILL),
        ("delay", signal.SIGKILL),
    ],
    [
        ("delay", signal.SIGKILL),
        ("write", signal.SIGKILL),
        ("ckpt+1", signal.SIGINT),
        ("write", signal.SIGKILL),
        ("ckpt+2", signal.SIGKILL),
        ("delay", signal.SIGKILL),
    ],
]


def _subprocess_env() -> dict[str, str]:
    # The suite's persistent compilation cache (conftest.py): only the first process compiles the step.
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _launch(run: Path, corpus: Path, env: dict[str, str], *extra: str) -> tuple[subprocess.Popen, Path]:
    log = run.with_name(run.name + f".stderr.{time.monotonic_ns()}")
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "leanstep.cli.main",
                "train",
                *KILL_FLAGS,
                "--data",
                str(corpus),
                "--out",
                str(run),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )
    return process, log


def _checkpoint_dir_state(run: Path) -> tuple[int, set[str], list[int]]:
    """(newest step with a manifest, unfinished write directories, step directories without a manifest)."""
    try:
        entries = list(os.scandir(run / "checkpoints"))
    except FileNotFoundError:
        return 0, set(), []
    steps = [int(e.name) for e in entries if e.name.isdigit()]
    verified = [s for s in steps if (run / "checkpoints" / str(s) / MANIFEST_NAME).exists()]
    return max(verified, default=0), set(unfinished_saves(run / "checkpoints")), [s for s in steps if s not in verified]


def _interrupt(process: subprocess.Popen, run: Path, base: int, trigger: str, sig: int, rng: random.Random) -> bool:
    """Sends ``sig`` when ``trigger`` fires; returns whether it did (False: the run ended first)."""
    _, stale, _ = _checkpoint_dir_state(run)
    need = int(trigger.split("+")[1]) if trigger.startswith("ckpt") else 1
    fire_at = None
    while process.poll() is None:
        newest, unfinished, _ = _checkpoint_dir_state(run)
        progressed = newest >= base + need
        if progressed and (trigger.startswith("ckpt") or trigger == "write" and unfinished - stale):
            process.send_signal(sig)
            return True
        if progressed and trigger == "delay":
            fire_at = fire_at or time.monotonic() + rng.uniform(0.0, 0.3)
            if time.monotonic() >= fire_at:
                process.send_signal(sig)
                return True
        time.sleep(0.001)
    return False


def _kill_chain(
    run: Path, plan: list[tuple[str, int]], corpus: Path, env: dict[str, str], seed: int, restore_lock: threading.Lock
) -> dict[str, Any]:
    """Interrupts the run at every point of ``plan``, checking each aftermath, then lets it finish."""
    rng, template = random.Random(seed), template_state(KILL_CONFIG)
    seen: dict[int, list[np.ndarray]] = {}  # step -> the state a resume takes after an interruption
    base, kills, landed_in_write, stops = 0, 0, 0, 0
    for i, (trigger, sig) in enumerate(plan):
        process, log = _launch(run, corpus, env, "--keep-checkpoints", "2", *(["--resume"] if i else []))
        fired = _interrupt(process, run, base, trigger, sig, rng)
        code = process.wait(timeout=300)
        assert fired, f"{run.name}: the run ended before kill point {i} ({trigger})"
        err = log.read_text()
        assert "Traceback" not in err, err
        newest, unfinished, unverified = _checkpoint_dir_state(run)
        assert not unverified, f"steps {unverified} exist under their final name without a manifest"
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL
            kills += 1
            landed_in_write += bool(unfinished)
        else:  # a clean stop: the last step it logged is the checkpoint it saved
            assert code == 128 + sig, err
            assert f"{signal.Signals(sig).name} received: stopped at step" in err and "after saving a checkpoint" in err
            assert newest == train_records(run)[-1]["step"] and not unfinished and not unverified
            stops += 1
        with restore_lock:
            restored = restore(run, template)  # what the next resume takes
        assert restored.step > base
        base = restored.step
        seen[base] = host(restored.state)
    final = subprocess.run(
        [
            sys.executable,
            "-m",
            "leanstep.cli.main",
            "train",
            *KILL_FLAGS,
            "--data",
            str(corpus),
            "--out",
            str(run),
            "--keep-checkpoints",
            "2",
            "--resume",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert final.returncode == 0, final.stderr
    return {"seen": seen, "kills": kills, "landed_in_write": landed_in_write, "stops": stops}


@pytest.mark.slow  # two chains of 6 kills
def test_killed_and_resumed_runs_end_bit_identical_to_an_uninterrupted_run(tmp_path, corpus):
    env = _subprocess_env()
    reference = tmp_path / "reference"
    straight, _ = _launch(reference, corpus, env, "--keep-checkpoints", "100")
    while _checkpoint_dir_state(reference)[0] < 1:  # compiled and cached: the chains can start
        assert straight.poll() is None, "the reference run failed"
        time.sleep(0.01)
    lock = threading.Lock()
    runs = [tmp_path / f"killed-{i}" for i in range(len(KILL_PLANS))]
    with concurrent.futures.ThreadPoolExecutor(len(KILL_PLANS)) as pool:
        futures = [
            pool.submit(_kill_chain, run, plan, corpus, env, seed, lock)
            for seed, (run, plan) in enumerate(zip(runs, KILL_PLANS))
        ]
        chains = [future.result() for future in futures]
    assert straight.wait(timeout=300) == 0
    assert sum(c["kills"] for c in chains) >= 10 and sum(c["stops"] for c in chains) == 2
    assert sum(c["landed_in_write"] for c in chains) >= 2

    template, timing = template_state(KILL_CONFIG), ("tokens_per_sec", "elapsed_s")
    expected = host(restore(reference, template, step=KILL_STEPS).state)
    records = lambda path: [
        {k: v for k, v in json.loads(line).items() if k not in timing}
        for line in (path / "metrics.jsonl").read_text().splitlines()
    ]
    for run, chain in zip(runs, chains):
        # Every checkpoint a resume took is the uninterrupted run's, bit for bit; so is the end.
        for step, state in chain["seen"].items():
            assert_bits_equal(state, host(restore(reference, template, step=step).state))
        assert_bits_equal(host(restore(run, template).state), expected)
        assert records(run) == records(reference)
