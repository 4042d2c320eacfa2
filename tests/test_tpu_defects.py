"""Issue 41, items 10, 11, 19 and 20: the precision warning's count, FP8 state on a mesh, the budget's
evaluation cost (the TPU items' mechanisms, checked on the CPU)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.workers import run_worker
from leanstep.blocks.compute_dtype_check import unused_compute_dtype
from leanstep.blocks.fp8_agreement import fp8_state_agreement
from leanstep.inspection import audit
from leanstep.training.budget import calibrate, plan_steps


class _State(NamedTuple):
    params: jax.Array


def _step(state, batch):
    return _State(state.params + 1), {"loss": jnp.float32(batch)}


def test_a_slow_first_evaluation_is_not_the_planned_evaluation_cost():
    # On a TPU v5e the first evaluation call took 1.73 s (it compiled) and the plan reserved that
    # for each of 30 evaluations: a 60 s budget trained for 28 s. Here the first call sleeps 0.5 s.
    first_call_s, calls = 0.5, []

    def evaluate(params):
        if not calls:
            time.sleep(first_call_s)
        calls.append(params)
        return jnp.float32(0.0)

    # The trainer's call: its evaluation was compiled ahead (on a thread), so one evaluation is timed.
    timing = calibrate(_step, _State(jnp.int32(0)), lambda i: i, evaluate, timed_steps=2, evaluations=1)
    assert timing["eval_s"] < first_call_s / 10
    assert timing["eval_first_s"] >= first_call_s  # recorded apart
    # What that is worth in a 60 s budget with 30 evaluations and 10 ms steps: the first call
    # taken as the cost would leave (60 - 30 * 0.5 - ...) / 0.01 steps, 1,500 fewer.
    planned = plan_steps(60.0, 5.0, 0.01, timing["eval_s"], 100, 0.5, 1000, 2.0)
    reference = plan_steps(60.0, 5.0, 0.01, 0.0, 100, 0.5, 1000, 2.0)
    assert planned >= 0.98 * reference


# --- item 10: a mixed bf16 x float32 matmul runs in float32 ------------------------------------------


def test_the_precision_warning_counts_a_mixed_matmul_as_the_audit_does():
    # The Equinox example: a bf16 activation times a float32 weight. jnp.matmul hands both to one
    # dot_general that computes in float32; the warning said "1 of 7 ... 0.0% of FLOPs" were off.
    x = jnp.ones((4, 8), jnp.bfloat16)
    w_mixed = jnp.ones((8, 16), jnp.float32)  # 4 * 8 * 16 * 2 = 1,024 FLOPs in float32
    w_bf16 = jnp.ones((16, 2), jnp.bfloat16)  # 4 * 16 * 2 * 2 = 256 FLOPs in bf16

    def loss(x, w_mixed, w_bf16):
        return jnp.sum((x @ w_mixed).astype(jnp.bfloat16) @ w_bf16)

    # The independent reference: the audit's record of each matmul's operand dtypes.
    matmuls = audit(loss, x, w_mixed, w_bf16).matmuls
    off = [m for m in matmuls if m.lhs[1] != "bfloat16" or m.rhs[1] != "bfloat16"]
    assert [(m.lhs[1], m.rhs[1]) for m in off] == [("bfloat16", "float32")]
    share = 100 * sum(m.flops for m in off) / sum(m.flops for m in matmuls)
    assert share == 100 * 1024 / (1024 + 256)
    message = unused_compute_dtype(loss, (x, w_mixed, w_bf16), jnp.bfloat16)
    assert message is not None
    assert (
        f"1 of the loss's 2 matmuls and convolutions do not run in it (bfloat16 x float32: 1, {share:.1f}%" in message
    )


# --- item 11: the built-in transformer's FP8 state on data=2 against one device ----------------------


def worker(out: Path) -> None:
    """Two steps of ``leanstep train --model transformer --size mini --fp8 delayed`` on one device and
    on ``--mesh data=2`` (two simulated CPU devices): both FP8 states, leaf by leaf."""
    jax.config.update("jax_num_cpu_devices", 2)
    from leanstep.blocks.fp8_state import split_fp8
    from leanstep.sharding.distributed import device_mesh
    from leanstep.sharding.meshes import shard_batch
    from leanstep.step.state_sharding import shard_train_state
    from leanstep.training.build import build_run
    from leanstep.training.config import RunConfig
    from leanstep.training.data import BatchSampler, load_corpus

    config = RunConfig(model="transformer", size="mini", batch_size=8, seq_len=32, fp8="delayed", steps=2)
    run = build_run(config)
    sampler = BatchSampler(load_corpus(None, seq_len=config.seq_len).train, 8, 32, config.seed)
    batches = [sampler.batch_at(i) for i in range(2)]
    state, step = run.init_state(), run.make_step()
    for batch in batches:
        state, _ = step(state, batch)
    mesh = device_mesh(shape={"data": 2})
    sharded, sharded_step = shard_train_state(run.init_state(), mesh, rules=run.model.rules), run.make_step(mesh=mesh)
    for batch in batches:
        sharded, _ = sharded_step(sharded, shard_batch(batch, mesh))
    states = {
        name: [(jax.tree_util.keystr(path), np.asarray(leaf).tolist()) for path, leaf in flat]
        for name, flat in (
            ("one", jax.tree_util.tree_flatten_with_path(split_fp8(state.params)[1])[0]),
            ("data2", jax.tree_util.tree_flatten_with_path(split_fp8(sharded.params)[1])[0]),
        )
    }
    (out / "fp8_states.json").write_text(json.dumps(states))


@pytest.fixture(scope="module")
def fp8_states(tmp_path_factory) -> dict:
    raw = run_worker(__file__, tmp_path_factory.mktemp("fp8_data2"), "fp8_states.json")
    return {name: {path: np.asarray(leaf, np.float32) for path, leaf in leaves} for name, leaves in raw.items()}


#: verify's layout tolerance for two devices' float32 sums, max(2**-14, 4 sqrt(3) 2**-24) (mesh_check).
LAYOUT_TOLERANCE = 2.0**-14


def test_the_fp8_state_on_data2_is_within_the_stated_bound_of_one_devices(fp8_states):
    one, data2 = fp8_states["one"], fp8_states["data2"]
    assert one.keys() == data2.keys() and len(one) >= 4
    assert any(np.any((leaf != 0) & (leaf != 1)) for leaf in one.values())  # the state moved: amaxes recorded
    agreement = fp8_state_agreement(one, data2, LAYOUT_TOLERANCE)
    # The independent reference: float64 NumPy, entry by entry.
    largest = max(
        float(np.max(np.abs(data2[k].astype(np.float64) - v) / np.where(v != 0, np.abs(v), 1.0), initial=0.0))
        for k, v in one.items()
    )
    assert agreement.largest == pytest.approx(largest, rel=1e-12, abs=0.0)
    assert agreement.within, agreement


def test_an_fp8_state_off_by_more_than_the_bound_is_named(fp8_states):
    one = fp8_states["one"]
    history = next(k for k, v in one.items() if k.endswith("_history") and np.any(v > 0))
    # A device's own maximum in place of the batch's (no pmax): 3% below, in the newest entry.
    planted = dict(one)
    entry = int(np.argmax(one[history] > 0))
    planted[history] = one[history].copy()
    planted[history].flat[entry] *= np.float32(0.97)
    agreement = fp8_state_agreement(one, planted, LAYOUT_TOLERANCE)
    assert not agreement.within and agreement.leaf == f"[{history!r}]"
    assert agreement.largest == pytest.approx(0.03, rel=1e-5)


@pytest.mark.parametrize(
    ("have", "tolerance", "message"),
    [
        ({"b": np.ones(2)}, 0.1, "have: an FP8 state of another structure"),
        ({"a": np.ones(3)}, 0.1, r"have: FP8 leaf \['a'\] has shape \(3,\), want's has \(2,\)"),
        ({"a": np.ones(2)}, -1.0, "tolerance must be a finite relative difference >= 0, got -1.0"),
        ({"a": np.ones(2)}, float("nan"), "tolerance must be a finite"),
    ],
)
def test_the_fp8_comparison_refuses_what_it_cannot_compare_in_one_line(have, tolerance, message):
    with pytest.raises(ValueError, match=message):
        fp8_state_agreement({"a": np.ones(2)}, have, tolerance)


def test_the_fp8_comparison_takes_equal_non_finite_entries_and_no_zero_moving():
    want = {"a": np.array([0.0, np.inf, 2.0])}
    assert fp8_state_agreement(want, {"a": np.array([0.0, np.inf, 2.0])}, 0.0) == (0.0, None, True)
    assert fp8_state_agreement(want, {"a": np.array([1e-30, np.inf, 2.0])}, 0.5) == (np.inf, "['a']", False)
    assert fp8_state_agreement(want, {"a": np.array([0.0, np.nan, 2.0])}, 0.5).largest == np.inf


if __name__ == "__main__" and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]))
