"""auditing: the seeds' traced-program rules, remat policies, dtypes, host syncs, a run's step, the CLI.

The FLOP counts are tested in test_flops.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback

from leanstep import tasks
from leanstep.blocks.accumulation import microbatched_value_and_grad
from leanstep.blocks.moments import compress_moments
from leanstep.blocks.rematerialization import REMAT_POLICIES, checkpoint_name, remat
from leanstep.inspection.auditing import audit, audit_jaxpr, policy_name
from leanstep.inspection.flops import count_flops
from leanstep.inspection.residuals import saved_residuals_report
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step
from leanstep.step.update import guarded_update
from leanstep.training import RunConfig
from leanstep.training.analysis import audit_run

# --- the gradient-accumulation rules ------------------------------------------------------------


def _mlp(d=3, h=5, k=2, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(size=(d, h)).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": rng.normal(size=(h, k)).astype(np.float32),
        "b2": np.zeros(k, np.float32),
    }


def _loss(p, batch):
    out = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None, :]) @ p["w2"] + p["b2"][None, :]
    return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=-1))


@pytest.mark.parametrize(("batch", "num_microbatches"), [(4, 2), (6, 3), (8, 8), (3, 1)])
def test_the_seed_accumulation_passes_the_rules(batch, num_microbatches):
    params = _mlp()
    x, y = np.ones((batch, 3), np.float32), np.ones((batch, 2), np.float32)
    report = audit(functools.partial(tasks.accumulate_gradients, num_microbatches=num_microbatches), params, x, y)
    assert report.accumulation_violations(num_microbatches, params=params) == []
    (scan,) = report.top_level_scans
    assert (scan.length, scan.reverse, scan.matmuls) == (num_microbatches, False, 5)
    assert report.matmuls_outside_scans == ()


def _grad_through_the_scan(params, x, y, num_microbatches):
    """Wrong: the loss is summed over microbatches in a scan and differentiated from outside."""

    def total(p):
        xs, ys = x.reshape(num_microbatches, -1, 3), y.reshape(num_microbatches, -1, 2)
        body = lambda c, m: (c + _loss(p, {"x": m[0], "y": m[1]}), None)
        return jax.lax.scan(body, 0.0, (xs, ys))[0] / num_microbatches

    return jax.value_and_grad(total)(params)


def _full_batch_loss_outside(params, x, y, num_microbatches):
    """Wrong: the gradient is accumulated correctly, but the loss is a second, full-batch forward pass."""
    _, grads = microbatched_value_and_grad(_loss, num_microbatches)(params, {"x": x, "y": y})
    return _loss(params, {"x": x, "y": y}), grads


def _no_accumulation(params, x, y, num_microbatches):
    """Wrong: one full-batch value_and_grad, no scan at all."""
    return jax.value_and_grad(_loss)(params, {"x": x, "y": y})


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (_grad_through_the_scan, "found 2"),
        (_full_batch_loss_outside, "outside any scan"),
        (_no_accumulation, "found 0"),
    ],
)
def test_wrong_accumulations_break_the_rules(wrong, message):
    params, x, y = _mlp(), np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)
    problems = audit(functools.partial(wrong, num_microbatches=2), params, x, y).accumulation_violations(
        2, params=params
    )
    assert any(message in p for p in problems), problems


def test_a_scan_of_the_wrong_length_or_direction_is_reported():
    params, x, y = _mlp(), np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)
    report = audit(functools.partial(tasks.accumulate_gradients, num_microbatches=4), params, x, y)
    assert report.accumulation_violations(2) == ["the scan has length 4; expected num_microbatches=2"]
    report = audit(functools.partial(_grad_through_the_scan, num_microbatches=2), params, x, y)
    assert [s.reverse for s in report.top_level_scans] == [False, True]


def test_a_carry_without_the_gradient_accumulator_is_reported():
    params, x = _mlp(), np.ones((4, 3), np.float32)
    # Accumulates only the loss: the gradient is not in the carry.
    report = audit(
        lambda p, x: jax.lax.scan(lambda c, r: (c + jnp.sum(jnp.tanh(r @ p["w1"])), None), 0.0, x.reshape(2, 2, 3))[0],
        params,
        x,
    )
    problems = report.accumulation_violations(2, params=params)
    assert any("no non-scalar carry" in p for p in problems)
    assert any("no gradient accumulator for parameter shapes" in p for p in problems)


# --- remat --------------------------------------------------------------------------------------


def _block_args(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(2, 3)).astype(np.float32),
        "b1": np.zeros(3, np.float32),
        "w2": rng.normal(size=(3, 2)).astype(np.float32),
        "b2": np.zeros(2, np.float32),
    }
    return params, rng.normal(size=(5, 2)).astype(np.float32), np.zeros((5, 2), np.float32)


def test_the_seed_checkpointed_block_passes_the_remat_rules():
    params, x, y = _block_args()
    report = audit(
        tasks.checkpointed_residual_block, params, x, y, loss_fn=tasks._checkpointed_block, loss_args=(params, x)
    )
    assert report.remat_violations("dots", recomputed=("tanh",)) == []
    assert [(r.policy, r.differentiated) for r in report.remat_regions] == [("dots", True)]
    assert report.residuals == saved_residuals_report(tasks._checkpointed_block, params, x)


def _tagged_block(p, x):
    h = checkpoint_name(jnp.tanh(x @ p["w1"] + p["b1"][None, :]), "h")
    return x + h @ p["w2"] + p["b2"][None, :]


@pytest.mark.parametrize(
    ("block", "messages"),
    [
        (remat(tasks._residual_block, "full"), ["remat regions with policy ['full']; expected only 'dots'"]),
        (remat(_tagged_block, "save:h"), ["remat regions with policy ['save:h']; expected only 'dots'"]),
        (
            tasks._residual_block,
            [
                "no jax.checkpoint (remat2) region in the traced program",
                "tanh is not recomputed in the backward pass (in no differentiated remat region)",
                "the output of tanh is saved for the backward pass",
            ],
        ),
    ],
)
def test_wrong_checkpointing_breaks_the_remat_rules(block, messages):
    params, x, y = _block_args()
    report = audit(jax.grad(lambda p: jnp.mean((block(p, x) - y) ** 2)), params, loss_fn=block, loss_args=(params, x))
    assert report.remat_violations("dots", recomputed=("tanh",)) == messages


def _two_tag_block(p, x):
    pre = checkpoint_name(x @ p["w1"] + p["b1"][None, :], "a")
    return x + checkpoint_name(jnp.tanh(pre), "h") @ p["w2"] + p["b2"][None, :]


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"] + ["save:a,h"])
def test_remat_policies_map_back_to_their_names(policy):
    params, x, _ = _block_args()
    report = audit(jax.grad(lambda p: jnp.sum(remat(_two_tag_block, policy)(p, x))), params)
    assert {r.policy for r in report.remat_regions} == {policy}


def test_policies_without_a_leanstep_name_keep_their_own():
    assert policy_name(jax.checkpoint_policies.everything_saveable) == "everything_saveable"


# --- matmul dtypes, host syncs, nesting ------------------------------------------------------------


def test_matmul_dtypes_of_a_bf16_step_with_float32_masters():
    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"]).astype(jnp.float32) ** 2)

    opt = optax.sgd(0.1)
    state = TrainState.create({"w": jnp.ones((4, 3))}, opt)
    step = make_train_step(loss_fn, precision="compute=bfloat16", num_microbatches=2)
    report = audit(step, state, {"x": jnp.ones((6, 4))})
    # One forward matmul and its weight gradient (x is data: no input gradient), both in the scan.
    assert report.matmul_dtypes == {("bfloat16", "bfloat16", "bfloat16"): 2}
    assert [(m.lhs[0], m.rhs[0]) for m in report.matmuls] == [((3, 4), (4, 3)), ((3, 3), (3, 4))]
    assert all(m.scan_depth == 1 for m in report.matmuls)
    assert report.host_syncs == ()
    assert report.accumulation_violations(2, params=state.params) == []


def test_host_syncs_are_listed():
    def f(x):
        jax.debug.print("sum {}", x.sum())
        y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        io_callback(lambda a: None, None, y)
        return jax.lax.scan(lambda c, r: (c + r, None), y[0], y)[0]

    report = audit(jax.jit(f), jnp.ones((3, 2)))
    assert [h.primitive for h in report.host_syncs] == ["debug_print", "pure_callback", "io_callback"]
    assert report.host_syncs[1].callback == "sin"
    assert "host syncs: 3" in str(report)


def test_nested_scans_report_depth_and_lengths():
    def f(w, x):
        inner = lambda h, wi: (jnp.tanh(h @ wi), None)
        return jax.lax.scan(lambda h, _: (jax.lax.scan(inner, h, w)[0], None), x, None, length=3)[0]

    report = audit(f, jnp.ones((4, 2, 2)), jnp.ones((1, 2)))
    assert [(s.length, s.depth, s.matmuls) for s in report.scans] == [(3, 0, 1), (4, 1, 1)]
    assert report.matmuls[0].flops == 3 * 4 * 2 * 2 * 2
    assert report.flops == count_flops(jax.make_jaxpr(f)(jnp.ones((4, 2, 2)), jnp.ones((1, 2))))


def test_bad_input():
    with pytest.raises(TypeError, match="step_or_fn must be callable"):
        audit(3)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        audit(jnp.sin, 1.0, loss_fn=4)
    with pytest.raises(TypeError, match="must be a jaxpr"):
        audit_jaxpr("not a jaxpr")


# --- a run's step and the CLI -------------------------------------------------------------------

TINY = dict(
    model="mlp",
    size="tiny",
    batch_size=4,
    seq_len=8,
    microbatches=2,
    remat="dots",
    precision="params=float32,compute=bfloat16,output=float32",
)


def test_audit_run_reports_the_run_settings():
    report = audit_run(RunConfig(**TINY))
    assert [s.length for s in report.top_level_scans] == [2]
    assert report.accumulation_violations(2) == [] and report.remat_violations("dots") == []
    assert {m.dtypes[:2] for m in report.matmuls} == {("bfloat16", "bfloat16")}
    # The residuals are one microbatch's: 2 sequences of 8 tokens, 16 rows of logits.
    assert any(e.shape == (16, 256) for e in report.residuals.entries)


def test_cli_audit_prints_the_report_and_the_rules(cli):
    argv = [
        "audit",
        "--model",
        "mlp",
        "--size",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "8",
        "--microbatches",
        "2",
        "--remat",
        "full",
    ]
    result = cli(*argv)
    assert result.code == 0, result.err
    out = result.out
    # Forward: 2 per layer and the head; backward: the head's 2, and per layer 4 plus x @ w1 recomputed.
    assert "length 2, 10 matmuls in the body" in out and "policy full, backward pass" in out
    assert out.rstrip().endswith("remat policy full): ok")


def test_cli_audit_rejects_bad_flags(cli):
    result = cli("audit", "--model", "mlp", "--size", "tiny", "--batch-size", "5", "--microbatches", "2")
    assert result.code == 2 and "--batch-size 5 is not divisible by --microbatches 2" in result.err, result.err
    result = cli("audit", "--model", "mlp", "--size", "tiny", "--remat", "sometimes")
    assert result.code == 2 and "leanstep audit: error: --remat" in result.err, result.err


# --- the optimizer's own scans (8-bit moments' searchsorted, chunked updates) are not the loop ----


@pytest.mark.parametrize(
    "extra",
    [
        ["--model", "mlp"],
        ["--model", "transformer"],
        # small, not tiny: offloading a state of a few KiB cannot lower a peak of MiBs (the rule refuses it)
        ["--model", "mlp", "--offload", "opt_state", "--master", "bfloat16-sr", "--size", "small"],
    ],
)
def test_cli_audit_with_int8_moments_passes_the_rules(extra, cli):
    argv = ["audit", "--size", "tiny", "--batch-size", "8", "--seq-len", "16", "--moments", "int8", *extra]
    result = cli(*argv)
    assert result.code == 0, result.err
    out = result.out
    # The 8-bit codec's searchsorted loops are in the program, in the optimizer's update.
    assert "length 8, 0 matmuls in the body" in out
    assert "remat policy dots): ok" in out


def test_cli_audit_of_the_update_inside_the_backward_pass_keeps_its_own_rules(cli):
    """Its two reversed scans over the layers are its passes, not a gradient taken through a scan."""
    argv = ["audit", "--model", "transformer", "--size", "tiny", "--batch-size", "8", "--seq-len", "16"]
    result = cli(*argv, "--update-in-backward", "on")
    assert result.code == 0, result.err
    assert "rules (two reversed scans over the layers, no matmul outside a scan; remat n/a): ok" in result.out
    # the standard step, held to them, has no such passes
    report = audit_run(RunConfig(model="transformer", size="tiny", batch_size=8, seq_len=16, optimizer="adamw"))
    assert report.in_backward_violations()[0].startswith("expected two reversed top-level scans over the layers")


def _int8_state(params):
    return TrainState.create(jax.tree.map(jnp.asarray, params), compress_moments(optax.adamw(1e-3), "int8"))


def _one_loop(params, batch):
    return microbatched_value_and_grad(_loss, 2)(params, batch)[1]


def _two_loops(params, batch):
    """Wrong: two microbatch loops, each over half the batch."""
    halves = [jax.tree.map(lambda a, i=i: a[4 * i : 4 * i + 4], batch) for i in range(2)]
    grads = [microbatched_value_and_grad(_loss, 2)(params, half)[1] for half in halves]
    return jax.tree.map(lambda a, b: (a + b) / 2, *grads)


def _no_loop(params, batch):
    """Wrong: one full-batch value_and_grad."""
    return jax.grad(_loss)(params, batch)


@pytest.mark.parametrize(
    ("grads_of", "expected"),
    [
        (_one_loop, []),
        (_two_loops, ["expected exactly one top-level lax.scan over the microbatches, found 2"]),
        (
            _no_loop,
            [
                "expected exactly one top-level lax.scan over the microbatches, found 0",
                "5 dot_general(s) outside any scan",
            ],
        ),
    ],
)
def test_the_loop_is_told_from_the_scans_of_an_int8_update(grads_of, expected):
    state = _int8_state(_mlp())
    batch = {"x": np.ones((8, 3), np.float32), "y": np.ones((8, 2), np.float32)}
    report = audit(lambda s, b: guarded_update(s, grads_of(s.params, b))[0], state, batch)
    assert sum(s.depth == 0 and s.length == 8 and s.matmuls == 0 for s in report.scans) >= 4  # the codec's
    problems = report.accumulation_violations(2, params=state.params)
    assert [p.split(" (lengths")[0].split(":")[0] for p in problems] == expected


def _stacked_loss(p, batch):
    h = batch["x"] @ p["v"] if "v" in p else batch["x"]
    for i in range(p["w"].shape[0]):
        h = jnp.tanh(h @ p["w"][i])
    return jnp.mean(h**2)


@pytest.mark.parametrize(
    ("optimizer", "update_chunk", "leaves"),
    [
        (optax.adamw(1e-3), 64, ("w",)),  # the stacked leaf is updated in a loop over its rows
        (compress_moments(optax.adamw(1e-3), "int8"), None, ("w",)),  # the codec's searchsorted loops
        (optax.contrib.muon(1e-3), None, ("v", "w")),  # Newton-Schulz loops on the matrix v, with matmuls
    ],
)
def test_the_optimizer_loops_of_a_leanstep_step_are_not_the_microbatch_loop(optimizer, update_chunk, leaves):
    shapes = {"v": (8, 8), "w": (4, 8, 8)}
    params = {name: 0.1 * jnp.ones(shapes[name]) for name in leaves}
    state = TrainState.create(params, optimizer)
    step = make_train_step(_stacked_loss, num_microbatches=2, update_chunk=update_chunk)
    report = audit(step, state, {"x": jnp.ones((6, 8))})
    assert report.accumulation_violations(2, params=params) == []
    assert len(report.top_level_scans) > 1 and [s.length for s in report.loop_candidates] == [2]
