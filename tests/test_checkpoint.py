"""Tests for leanstep.checkpoints.checkpointer: bit-exact round trips, retention, corruption fallback, errors."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstep.checkpoints.checkpointer import (
    MANIFEST_NAME,
    Checkpointer,
    CheckpointError,
    RestoreResult,
)
from leanstep.checkpoints.layout import (
    STAGING,
    remove_unfinished_saves,
    unfinished_saves,
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["loss_scale", "good_steps"],
    meta_fields=["growth_interval", "growth_factor"],
)
@dataclasses.dataclass(frozen=True)
class FakeLossScale:
    loss_scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = 2000
    growth_factor: float = 2.0


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "loss_scale", "rng", "consecutive_skips"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class FakeTrainState:
    """Same shape as leanstep.step.train_step.TrainState (a stand-in while step.py's imports are in flux)."""

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: Any
    rng: jax.Array
    consecutive_skips: jax.Array


OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Arbitrary bit patterns, NaN payloads, infinities, -0.0 and subnormals included."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return jnp.asarray(np.frombuffer(rng.bytes(nbytes), dtype=dtype).reshape(shape))


def make_state(seed: int, step: int = 0, growth_interval: int = 2000) -> FakeTrainState:
    rng = np.random.default_rng(seed)
    params = {"w": random_bits(rng, (3, 4), np.float32), "b": random_bits(rng, (4,), np.float32)}
    opt_state = OPTIMIZER.init(params)
    # Non-trivial moments and count, so a restore that zeroed them would be caught.
    opt_state = jax.tree.map(lambda x: random_bits(rng, x.shape, np.dtype(x.dtype)), opt_state)
    return FakeTrainState(
        step=jnp.asarray(step, jnp.int32),
        params=params,
        opt_state=opt_state,
        loss_scale=FakeLossScale(
            random_bits(rng, (), np.float32), random_bits(rng, (), np.int32), growth_interval=growth_interval
        ),
        rng=random_bits(rng, (2,), np.uint32),
        consecutive_skips=jnp.asarray(rng.integers(0, 5), jnp.int32),
    )


def assert_bit_equal(actual: Any, expected: Any) -> None:
    """Same tree structure (node types and static fields too) and identical bytes per leaf."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), jax.tree_util.keystr(path)
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def largest_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    return max(files, key=lambda p: (p.stat().st_size, str(p)))


@pytest.fixture()
def ckpt(tmp_path):
    with Checkpointer(tmp_path / "ckpt", max_to_keep=3) as checkpointer:
        yield checkpointer


def save_steps(ckpt: Checkpointer, steps: list[int]) -> dict[int, FakeTrainState]:
    states = {s: make_state(seed=s, step=s) for s in steps}
    for s in steps:
        ckpt.save(s, states[s], extra={"step": s})
    return states


# --- round trips ---------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_round_trip_is_bit_exact(tmp_path_factory, seed):
    state = make_state(seed, step=seed % 1000)
    with Checkpointer(tmp_path_factory.mktemp("rt")) as ckpt:
        ckpt.save(7, state)
        result = ckpt.restore(make_state(seed + 1))
    assert isinstance(result, RestoreResult)
    assert (result.step, result.extra, result.skipped) == (7, {}, ())
    assert_bit_equal(result.state, state)
    assert isinstance(result.state.opt_state[1][0], optax.ScaleByAdamState)


def test_round_trip_keeps_other_dtypes_and_typed_keys(ckpt):
    rng = np.random.default_rng(0)
    state = {
        "bf16": random_bits(rng, (5,), jnp.bfloat16),
        "i8": random_bits(rng, (3,), np.int8),
        "bool": jnp.asarray([True, False]),
        "host": np.asarray([1.5, -0.0], np.float32),
        "key": jax.random.key(3),
    }
    ckpt.save(1, state)
    restored = ckpt.restore(state).state
    for name in ("bf16", "i8", "bool"):
        assert_bit_equal(restored[name], state[name])
    assert_bit_equal(restored["host"], state["host"])
    assert restored["key"].dtype == state["key"].dtype
    assert_bit_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))


def test_static_fields_and_node_types_come_from_the_template(ckpt):
    saved = make_state(1, growth_interval=2000)
    ckpt.save(1, saved)
    restored = ckpt.restore(make_state(2, growth_interval=7)).state
    assert restored.loss_scale.growth_interval == 7
    assert_bit_equal(restored.loss_scale.loss_scale, saved.loss_scale.loss_scale)
    assert type(restored.opt_state[0]).__name__ == "EmptyState"


def test_abstract_template_from_eval_shape(ckpt):
    saved = make_state(4, step=3)
    ckpt.save(3, saved)
    template = jax.eval_shape(lambda: make_state(0))
    assert isinstance(jax.tree.leaves(template)[0], jax.ShapeDtypeStruct)
    assert_bit_equal(ckpt.restore(template).state, saved)


def test_restored_arrays_keep_the_template_sharding(ckpt):
    ckpt.save(1, make_state(1))
    template = make_state(2)
    restored = ckpt.restore(template).state
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(template)):
        assert a.sharding == b.sharding


def test_extra_round_trip(ckpt):
    extra = {
        "data_position": 12345,
        "config_hash": "ab12",
        "metrics": {"loss": 0.1 + 0.2, "nan_loss": float("nan"), "lr": [1e-3, 5e-4]},
        "flags": {"resumed": True, "note": None},
    }
    ckpt.save(2, make_state(0), extra=extra)
    restored = ckpt.restore(make_state(0)).extra
    assert json.dumps(restored, sort_keys=True) == json.dumps(extra, sort_keys=True)
    assert restored["metrics"]["loss"] == 0.1 + 0.2


def test_real_train_state_round_trip(tmp_path):
    from leanstep.step.state import TrainState

    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    optimizer = optax.adam(1e-3)  # the run's: the template carries the same (static) optimizer
    state = TrainState.create(params, optimizer, loss_scale="dynamic", seed=3)
    state = dataclasses.replace(state, step=jnp.asarray(17, jnp.int32))
    template = TrainState.create(params, optimizer, loss_scale="dynamic", seed=0)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(17, state)
        assert_bit_equal(ckpt.restore(template).state, state)


@pytest.mark.parametrize(("saved", "wanted"), [("float32", "int8"), ("int8", "float32"), ("bfloat16", "int8")])
def test_moments_restored_into_another_format_name_both_and_the_argument(tmp_path, saved, wanted):
    from leanstep.step.state import TrainState

    params = {"w": jnp.arange(600.0).reshape(2, 300), "b": jnp.ones(3)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, TrainState.create(params, optax.adam(1e-3), moments=saved))
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(TrainState.create(params, optax.adam(1e-3), moments=wanted))
    message = str(info.value)
    assert (
        f"the checkpoint's optimizer moments are {saved}, the template's {wanted}; restore it into a state built "
        f"with moments={saved!r} (TrainState.create(..., moments=...) or StepSpec.moments; --moments in leanstep "
        "train)" in message
    )
    assert "flat index" not in message and len(message.splitlines()) == 1


# --- steps and retention -------------------------------------------------------------------------


def test_latest_step_and_keep_last_n(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        states = save_steps(ckpt, [1, 3, 5, 8])
        assert ckpt.all_steps() == [5, 8] and ckpt.latest_step() == 8
        assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "8"]
        for s in (5, 8):
            result = ckpt.restore(make_state(0), step=s)
            assert result.extra == {"step": s}
            assert_bit_equal(result.state, states[s])


def test_a_reopened_directory_restores_the_same_checkpoint(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        states = save_steps(ckpt, [1, 2])
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        assert_bit_equal(ckpt.restore(make_state(0)).state, states[2])
        # Restoring wrote nothing: the manifest still matches.
        assert ckpt.restore(make_state(0)).skipped == ()


def test_manifest_lists_every_file_with_its_sha256(ckpt):
    ckpt.save(4, make_state(0))
    step_dir = ckpt.directory / "4"
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    expected = {
        p.relative_to(step_dir).as_posix(): [p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()]
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    }
    assert manifest["files"] == expected
    assert any(name.startswith("state/") for name in expected)
    assert any(name.startswith("extra/") for name in expected)
    assert not list(step_dir.glob(MANIFEST_NAME + ".tmp"))


def test_integer_scalar_steps_are_accepted(ckpt):
    state = make_state(0, step=12)
    ckpt.save(state.step, state)  # a jax int32 scalar
    ckpt.save(np.int64(13), state)
    assert ckpt.all_steps() == [12, 13]
    assert ckpt.restore(state, step=np.int32(12)).step == 12
    with pytest.raises(ValueError, match="got -1"):
        ckpt.restore(state, step=-1)
    with pytest.raises(ValueError, match="got 1.5"):
        ckpt.delete_newer_than(1.5)


def test_save_refuses_a_step_not_after_the_latest(ckpt):
    save_steps(ckpt, [5, 10])
    with pytest.raises(CheckpointError, match=r"already holds step\(s\) \[10\]"):
        ckpt.save(7, make_state(0))
    with pytest.raises(CheckpointError, match=r"\[5, 10\]"):
        ckpt.save(5, make_state(0))
    assert ckpt.delete_newer_than(5) == [10]
    ckpt.save(7, make_state(7))
    assert ckpt.all_steps() == [5, 7]


def test_async_save_survives_donated_arrays(ckpt):
    state = make_state(9, step=9)
    expected = jax.tree.map(np.array, state)
    ckpt.save(9, state, wait=False)
    for leaf in jax.tree.leaves(state):
        leaf.delete()  # what donation does to the buffers once the step runs
    ckpt.wait_until_finished()
    assert (ckpt.directory / "9" / MANIFEST_NAME).is_file()
    assert_bit_equal(jax.tree.map(np.asarray, ckpt.restore(make_state(0)).state), expected)


def _poll_until(ckpt: Checkpointer, seconds: float = 120.0) -> list[int]:
    """Polls as a training loop does between steps, until a step is committed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        committed = ckpt.poll()
        if committed:
            return committed
        time.sleep(0.005)
    raise AssertionError(f"no commit within {seconds} s")


def test_poll_commits_a_background_save_once_orbax_has_written_it(ckpt):
    states = save_steps(ckpt, [1])
    ckpt.save(2, make_state(2, step=2), wait=False, extra={"step": 2})
    assert ckpt.saving() == [2]
    assert _poll_until(ckpt) == [2]  # committed by the poll: no save, wait or close since
    assert ckpt.saving() == [] and ckpt.poll() == [] and ckpt.all_steps() == [1, 2]
    assert (ckpt.directory / "2" / MANIFEST_NAME).is_file() and unfinished_saves(ckpt.directory) == []
    assert_bit_equal(ckpt.restore(make_state(0), step=1).state, states[1])
    assert_bit_equal(ckpt.restore(make_state(0)).state, make_state(2, step=2))


def test_poll_reports_a_failed_background_write_and_keeps_the_earlier_steps(ckpt):
    states = save_steps(ckpt, [1])
    ckpt.save(2, {"a": jnp.zeros(4, jnp.uint2)}, wait=False)  # tensorstore fails it in the background
    with pytest.raises(CheckpointError, match=rf"step\(s\) \[2\] to {ckpt.directory} failed: .*uint2"):
        _poll_until(ckpt)
    assert ckpt.saving() == [] and ckpt.all_steps() == [1]
    result = ckpt.restore(make_state(0))
    assert result.step == 1 and result.skipped == ()
    assert_bit_equal(result.state, states[1])


def test_normal_use_prints_nothing(tmp_path, capfd):
    with Checkpointer(tmp_path) as ckpt:
        save_steps(ckpt, [1, 2])
        ckpt.restore(make_state(0))
    assert capfd.readouterr() == ("", "")


# --- corruption and fallback ---------------------------------------------------------------------


def truncate(step_dir: Path) -> None:
    path = largest_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(step_dir: Path) -> None:
    path = largest_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def delete_data_file(step_dir: Path) -> None:
    largest_file(step_dir).unlink()


def delete_extra(step_dir: Path) -> None:
    (step_dir / "extra" / "metadata").unlink()


def add_file(step_dir: Path) -> None:
    (step_dir / "state" / "stray").write_bytes(b"x")


def delete_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST_NAME).unlink()


def edit_manifest(step_dir: Path) -> None:
    path = step_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["leaves"][0][1] = [99]
    path.write_text(json.dumps(manifest))


def garble_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST_NAME).write_text("{not json")


CORRUPTIONS = {
    truncate: "bytes, expected",
    flip_byte: "wrong sha256",
    delete_data_file: "missing",
    delete_extra: "extra/metadata missing",
    add_file: "state/stray unexpected",
    delete_manifest: "no manifest",
    edit_manifest: "manifest is corrupted",
    garble_manifest: "manifest unreadable",
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=lambda f: f.__name__)
def test_corrupted_latest_falls_back_to_the_previous_good_one(ckpt, corrupt):
    states = save_steps(ckpt, [1, 2, 3])
    corrupt(ckpt.directory / "3")
    result = ckpt.restore(make_state(0))
    assert result.step == 2 and result.extra == {"step": 2}
    assert_bit_equal(result.state, states[2])
    assert len(result.skipped) == 1
    assert result.skipped[0].startswith("step 3: ") and CORRUPTIONS[corrupt] in result.skipped[0]
    with pytest.raises(CheckpointError, match="step 3: .*" + CORRUPTIONS[corrupt]):
        ckpt.restore(make_state(0), step=3)


def test_every_checkpoint_corrupt_raises_with_each_reason(ckpt):
    save_steps(ckpt, [1, 2])
    flip_byte(ckpt.directory / "2")
    delete_manifest(ckpt.directory / "1")
    (ckpt.directory / "3.orbax-checkpoint-tmp").mkdir()
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(make_state(0))
    message = str(info.value)
    assert str(ckpt.directory) in message
    assert "step 2: files do not match the manifest" in message and "step 1: no manifest" in message
    assert "3.orbax-checkpoint-tmp" in message


def test_empty_directory_restore_raises(ckpt):
    with pytest.raises(CheckpointError, match="no finished checkpoints"):
        ckpt.restore(make_state(0))
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 4 .* found steps \[\]"):
        ckpt.restore(make_state(0), step=4)


def test_template_mismatch_is_rejected_not_cast(ckpt):
    state = {"w": jnp.arange(3.0), "n": jnp.zeros((), jnp.int32)}
    ckpt.save(1, state)
    # Orbax alone would silently cast float32 -> bfloat16 here.
    with pytest.raises(CheckpointError, match=r"\['w'\] is float32\[3\] in the checkpoint, bfloat16\[3\]"):
        ckpt.restore({"w": jnp.zeros(3, jnp.bfloat16), "n": jnp.zeros((), jnp.int32)})
    with pytest.raises(CheckpointError, match=r"\['n'\] in the checkpoint but not in the template"):
        ckpt.restore({"w": jnp.zeros(3)})


def test_an_interrupted_save_is_never_listed(ckpt):
    states = save_steps(ckpt, [1])
    # What a crash mid-write leaves: a staged step (maybe orbax's own temporary directory in it),
    # never renamed to its final name; and a legacy orbax temporary directory.
    staged = ckpt.directory / STAGING / "2"
    (staged / "state").mkdir(parents=True)
    (ckpt.directory / STAGING / "2.orbax-checkpoint-tmp-123").mkdir()
    (ckpt.directory / "3.orbax-checkpoint-tmp").mkdir()
    assert ckpt.all_steps() == [1]
    result = ckpt.restore(make_state(0))
    assert result.step == 1 and result.skipped == ()
    assert_bit_equal(result.state, states[1])
    ckpt.save(2, make_state(2))  # a new save of the same step replaces what was staged
    assert ckpt.all_steps() == [1, 2] and not staged.exists()
    assert (ckpt.directory / "2" / MANIFEST_NAME).is_file()
    assert unfinished_saves(ckpt.directory) == ["3.orbax-checkpoint-tmp"]
    assert remove_unfinished_saves(ckpt.directory) == ["removed an unfinished checkpoint write: 3.orbax-checkpoint-tmp"]
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["1", "2"]


def test_zero_size_leaves_round_trip(ckpt):
    # Orbax refuses zero-size arrays; the checkpoint holds a placeholder, the manifest the true shape.
    state = {"empty": jnp.zeros((0, 3), jnp.bfloat16), "w": jnp.arange(3.0), "none": np.zeros((2, 0), np.int32)}
    ckpt.save(1, state)
    result = ckpt.restore(
        {"empty": jnp.ones((0, 3), jnp.bfloat16), "w": jnp.zeros(3), "none": np.ones((2, 0), np.int32)}
    )
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(result.state)] == [
        ((0, 3), jnp.bfloat16),
        ((2, 0), np.int32),
        ((3,), np.float32),
    ]
    assert_bit_equal(result.state, state)
    with pytest.raises(CheckpointError, match=r"\['empty'\] is bfloat16\[0, 3\] in the checkpoint, bfloat16\[0, 4\]"):
        ckpt.restore({"empty": jnp.zeros((0, 4), jnp.bfloat16), "w": jnp.zeros(3), "none": np.ones((2, 0), np.int32)})


def test_killed_process_mid_save_leaves_the_previous_checkpoint(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, numpy as np, jax.numpy as jnp
        from leanstep.checkpoints.checkpointer import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save(1, {{"x": jnp.full((1 << 20,), 1.0)}})
        ckpt.save(2, {{"x": jnp.full((1 << 20,), 2.0)}}, wait=False)
        os._exit(0)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    with Checkpointer(tmp_path) as ckpt:
        result = ckpt.restore({"x": jnp.zeros(1 << 20)})
    # Wherever the kill landed, what comes back is a whole checkpoint, never a mix.
    assert result.step in (1, 2)
    np.testing.assert_array_equal(np.asarray(result.state["x"]), np.full(1 << 20, float(result.step)))
    if result.step == 1:
        no_manifest = "step 2: no manifest (the save was interrupted before it was verified)"
        assert result.skipped in ((), (no_manifest,))


# --- errors --------------------------------------------------------------------------------------


def test_directory_under_a_file_is_a_clear_error(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(CheckpointError, match=f"cannot create checkpoint directory {regular / 'sub'}"):
        Checkpointer(regular / "sub")
    with pytest.raises(CheckpointError, match=f"{regular} exists and is not a directory"):
        Checkpointer(regular)
    assert regular.read_text() == "x"


def test_failed_save_keeps_earlier_checkpoints(ckpt):
    states = save_steps(ckpt, [1])
    # tensorstore 0.1.x cannot store uint2, so orbax's background write fails half-way.
    unwritable = {"a": jnp.zeros(4, jnp.uint2)}
    with pytest.raises(CheckpointError, match=rf"step\(s\) \[2\] to {ckpt.directory} failed: .*uint2"):
        ckpt.save(2, unwritable)
    assert ckpt.all_steps() == [1]
    result = ckpt.restore(make_state(0))
    assert result.step == 1 and result.skipped == ()
    assert_bit_equal(result.state, states[1])
    ckpt.save(2, make_state(2))  # the manager is still usable
    assert ckpt.all_steps() == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"extra": {"t": (1, 2)}}, TypeError, r"extra\['t'\] is a tuple"),
        ({"extra": {1: 2}}, TypeError, "key 1 of type int"),
        ({"extra": {"loss": np.float32(1.0)}}, TypeError, r"extra\['loss'\] is a float32"),
        ({"extra": [1]}, TypeError, "extra must be a dict or None, got list"),
        ({"step": -1}, ValueError, "step must be a non-negative integer, got -1"),
        ({"step": True}, ValueError, "got True"),
        ({"step": 2.0}, ValueError, "got 2.0"),
        ({"state": {"a": jnp.zeros(2), "b": "text"}}, TypeError, r"state\['b'\] is a str"),
        (
            {"state": {"a": jax.ShapeDtypeStruct((2,), jnp.float32)}},
            TypeError,
            r"state\['a'\] is a ShapeDtypeStruct; every leaf of state must be a jax.Array or np.ndarray",
        ),
    ],
)
def test_bad_save_arguments_write_nothing(ckpt, kwargs, error, match):
    call = {"step": 1, "state": make_state(0), **kwargs}
    with pytest.raises(error, match=match):
        ckpt.save(call.pop("step"), call.pop("state"), **call)
    assert list(ckpt.directory.iterdir()) == []


def test_bad_max_to_keep(tmp_path):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"max_to_keep must be an int >= 1, got {bad!r}"):
            Checkpointer(tmp_path, max_to_keep=bad)


def test_closed_checkpointer_refuses_work(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.close()
    ckpt.close()
    with pytest.raises(CheckpointError, match="is closed"):
        ckpt.save(1, make_state(0))
    with pytest.raises(CheckpointError, match="is closed"):
        ckpt.restore(make_state(0))


def test_a_step_written_by_leanstep_0_4_restores_and_is_pruned_like_any(tmp_path):
    # 0.4 saved through orbax's CheckpointManager straight to <dir>/<step>, then the manifest.
    import orbax.checkpoint as ocp

    from leanstep.checkpoints.manifest import write_manifest
    from leanstep.checkpoints.trees import leaf_specs

    state = make_state(1)
    manager = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(create=False))
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave({"step": 1})))
    manager.wait_until_finished()
    manager.close()
    write_manifest(tmp_path / "1", 1, leaf_specs(state, "state", abstract_ok=False))
    with Checkpointer(tmp_path, max_to_keep=1) as ckpt:
        result = ckpt.restore(make_state(0))
        assert result.step == 1 and result.extra == {"step": 1} and result.skipped == ()
        assert_bit_equal(result.state, state)
        ckpt.save(2, make_state(2), extra={"step": 2})
        assert ckpt.all_steps() == [2]
