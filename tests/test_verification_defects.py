"""Issue 41, items 1-5 and 14: verify's false alarms on correct setups, its blind spot for errors by one
factor everywhere, and its raw errors.

Every correct setup here must pass: leanstep's own step and the hand-written optax step of
:mod:`handwritten_steps` on padded token-weighted batches (unequal counts, an empty microbatch), with
batch statistics per microbatch or shared by the microbatches. The bugs must be flagged by name.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from helpers.covering import Pair, covering, pairs
from helpers.handwritten_steps import HandwrittenStep, padded_batch
from helpers.token_losses import make_token_loss
from leanstep.cli.main import main
from leanstep.frameworks import equinox as leqx
from leanstep.planning.search_options import SearchSpace
from leanstep.verification import VerifiableStep

GRADIENT_CHECKS = ("accumulation", "full_batch", "reference", "token_weighting", "clip")


def padded_lm_batch(rows: int = 8, tokens: int = 6, empty: int = 1, num_microbatches: int = 4) -> dict:
    """A token-weighted regression batch: random lengths, contiguous microbatch ``empty`` without tokens."""
    rng = np.random.default_rng(3)
    mask = (np.arange(tokens)[None, :] < rng.integers(1, tokens + 1, size=rows)[:, None]).astype(np.float32)
    size = rows // num_microbatches
    mask[empty * size : (empty + 1) * size] = 0
    return {
        "x": rng.normal(size=(rows, tokens, 3)).astype(np.float32),
        "y": rng.normal(size=(rows, tokens, 2)).astype(np.float32),
        "mask": mask,
    }


PARAMS = {"w1": jnp.full((3, 5), 0.3), "w2": jnp.linspace(-0.5, 0.5, 10).reshape(5, 2)}


# --- item 1: microbatches weighed by their token counts ----------------------------------------------


@pytest.mark.parametrize("precision", ["float32", "params=float32,compute=bfloat16,output=float32"])
def test_leanstep_step_on_a_padded_batch_with_an_empty_microbatch_passes(precision):
    batch = padded_lm_batch()
    report = leanstep.verification.verify(
        make_token_loss, PARAMS, batch, num_microbatches=4, token_weighted=True, mask="mask", precision=precision,
        loss_scale="dynamic", checks=(*GRADIENT_CHECKS, "non_finite"),
    )  # fmt: skip
    assert report.passed, str(report)
    assert "c_j / sum c" in report["accumulation"].compared and report["reference"].status == "pass"


@pytest.mark.parametrize("empty", [1, None], ids=["an-empty-microbatch", "none-empty"])
def test_the_handwritten_step_on_a_padded_batch_passes(empty):
    step = HandwrittenStep(batch=padded_batch(4, empty=empty))
    report = leanstep.verification.verify_step(step, num_microbatches=4, checks=(*GRADIENT_CHECKS, "non_finite"))
    assert report.passed, str(report)
    assert report["accumulation"].largest < 2.0**-14


def test_the_per_microbatch_mean_is_flagged_by_name_on_a_padded_batch():
    for empty, where in ((None, "microbatch 0 weighs 0.25"), (1, "metrics/skipped")):
        step = HandwrittenStep("loss_per_microbatch", batch=padded_batch(4, empty=empty))
        report = leanstep.verification.verify_step(step, num_microbatches=4, checks=("accumulation", "reference"))
        result = report["accumulation"]
        assert result.status == "fail" and "loss normalised per microbatch" in result.diagnosis, str(report)
        assert where in result.where, str(report)
        assert report["reference"].status == "fail"
        if empty is None:  # its fitted microbatch weights are 1/M: named
            assert "loss normalised per microbatch" in report["reference"].diagnosis, str(report)


# --- item 2: batch statistics shared by the microbatches -------------------------------------------


def test_batch_statistics_shared_by_the_microbatches_pass_accumulation_and_full_batch():
    step = HandwrittenStep(batch=padded_batch(4), batch_stat="shared")
    report = leanstep.verification.verify_step(step, num_microbatches=4, checks=GRADIENT_CHECKS)
    assert report.passed, str(report)
    assert report["full_batch"].status == "pass" and "shared by the microbatches" in report["accumulation"].tolerance
    # per-microbatch statistics: M microbatches are not one by design, full_batch does not apply
    own = leanstep.verification.verify_step(
        HandwrittenStep(batch=padded_batch(4)), num_microbatches=4, checks=("full_batch",)
    )
    assert own["full_batch"].status == "n/a" and "its own rows" in own["full_batch"].detail


# --- item 3: the independent reference ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("bug", "named"),
    [
        ("loss_scale_twice", "the loss scale (1024) divided out twice"),
        ("divided_by_m_twice", "gradients divided by M=4 twice"),
    ],
)
def test_an_error_by_one_factor_everywhere_is_flagged_by_the_reference_alone(bug, named):
    step = HandwrittenStep(bug, batch=padded_batch(4))
    report = leanstep.verification.verify_step(step, num_microbatches=4, checks=GRADIENT_CHECKS)
    # the checks that compare the step with its own programs cannot see it
    assert all(report[name].status in ("pass", "n/a") for name in GRADIENT_CHECKS if name != "reference"), str(report)
    assert report["reference"].status == "fail" and named in report["reference"].diagnosis, str(report)


def test_the_reference_names_an_update_that_is_not_the_optimizers():
    class TwiceApplied(HandwrittenStep):
        def step(self, state, batch, num_microbatches):
            after, metrics = super().step(state, batch, num_microbatches)
            arrays = dict(after.arrays)
            moved = jax.tree.map(lambda new, old: 2 * new - old, arrays["params"], state.arrays["params"])
            arrays["params"] = moved
            return type(after)(arrays, after.settings), metrics

    report = leanstep.verification.verify_step(TwiceApplied(), num_microbatches=4, checks=("reference",))
    assert report["reference"].status == "fail" and report["reference"].where == "params (the update)", str(report)


def test_a_step_without_a_reference_loss_is_not_applicable():
    class NoReference(HandwrittenStep):
        reference_loss = None

    report = leanstep.verification.verify_step(NoReference(), num_microbatches=4, checks=("reference",))
    assert report["reference"].status == "n/a" and "reference_loss" in report["reference"].detail


# --- item 4: an Equinox module in the state; remat that renames the params ---------------------------


def test_a_state_holding_an_equinox_module_with_a_string_field_is_audited():
    import equinox as eqx

    class Head(eqx.Module):
        weight: jax.Array
        activation: str = "tanh"  # a leaf for jax.jit: a str

    class WithModule(HandwrittenStep):
        def init(self, optimizer, **kwargs):
            state = super().init(optimizer, **kwargs)
            return type(state)({**state.arrays, "head": Head(jnp.ones(2))}, state.settings)

        def step(self, state, batch, num_microbatches):
            head = state.arrays["head"]
            inner = type(state)({k: v for k, v in state.arrays.items() if k != "head"}, state.settings)
            after, metrics = super().step(inner, batch, num_microbatches)
            return type(after)({**after.arrays, "head": head}, after.settings), metrics

    report = leanstep.verification.verify_step(WithModule(), num_microbatches=4, checks=("compute_dtype",))
    assert report["compute_dtype"].status == "pass", str(report)


def _renaming_model():
    from flax import linen as nn

    class Model(nn.Module):
        policy: str = "none"

        @nn.compact
        def __call__(self, x):
            dense = nn.remat(nn.Dense) if self.policy != "none" else nn.Dense  # renamed CheckpointDense_0
            return jnp.tanh(dense(2)(x))

    def make_loss(policy):
        return lambda p, b: jnp.mean((Model(policy).apply({"params": p}, b["x"]) - b["y"]) ** 2)

    def params(policy):
        return Model(policy).init(jax.random.key(0), jnp.ones((1, 3)))["params"]

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(4, 3)).astype(np.float32), "y": rng.normal(size=(4, 2)).astype(np.float32)}
    return make_loss, params, batch


def test_a_remat_that_renames_the_params_is_refused_in_one_line_and_a_builder_is_taken():
    make_loss, params, batch = _renaming_model()
    with pytest.raises(ValueError, match=r"^the loss under remat policy 'full' does not take the params given"):
        leanstep.verification.verify(make_loss, params("none"), batch, num_microbatches=2, remat="full")
    report = leanstep.verification.verify(
        make_loss, params, batch, num_microbatches=2, remat="full", checks=("accumulation", "remat")
    )
    assert report["accumulation"].status == "pass" and report["remat"].status in ("pass", "fail"), str(report)
    assert "does not take" not in str(report)


# --- issue 57, item 6: a stateful Equinox model, one params tree, a remat that changes its structure ----


class _NormBlock(eqx.Module):
    linear: eqx.nn.Linear
    norm1: eqx.nn.BatchNorm

    def __call__(self, x, state):
        h, state = self.norm1(jnp.tanh(self.linear(x)), state)
        return x + h, state


class _NormNet(eqx.Module):
    block: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x, state):
        h, state = self.block(x, state)
        return self.head(h), state


def _norm_net(policy):
    """The model and its ``eqx.nn.State``, its block remat'd with ``policy`` (an ``eqx.filter_checkpoint``
    wrapper in the tree: another structure than without remat)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    block = _NormBlock(eqx.nn.Linear(3, 3, key=k1), eqx.nn.BatchNorm(3, "batch", mode="ema"))
    net, state = eqx.nn.make_with_state(_NormNet)(block, eqx.nn.Linear(3, 1, key=k2))
    return eqx.tree_at(lambda m: m.block, net, leanstep.blocks.remat(net.block, policy)), state


def _norm_loss(model, model_state, batch):
    out, model_state = jax.vmap(model, (0, None), (0, None), axis_name="batch")(batch["x"], model_state)
    return jnp.mean((out - batch["y"]) ** 2), model_state


def _make_norm_loss(policy):
    return leqx.stateful_loss(leqx.split(_norm_net(policy)[0])[1], _norm_loss)


def _norm_trees(policy):
    model, model_state = _norm_net(policy)
    return leqx.split(model)[0], model_state


NORM_BATCH = {
    "x": np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32),
    "y": np.random.default_rng(1).normal(size=(8, 1)).astype(np.float32),
}


def _plan_refusal(trees_policy, policy):
    params, model_state = _norm_trees(trees_policy)
    with pytest.raises(ValueError) as planned:
        leanstep.planning.plan(
            _make_norm_loss, params, NORM_BATCH, optax.sgd(0.1), leanstep.StepSpec(loss=leanstep.LossContract(has_state=True)),
            budget_bytes="1GiB", model_state=model_state, candidates=SearchSpace(remat_policies=[policy], microbatches=[1]),
        )  # fmt: skip
    return str(planned.value)


def test_verify_refuses_a_stateful_equinox_model_remat_changes_in_plan_s_one_line():
    params, model_state = _norm_trees("none")
    with pytest.raises(ValueError) as verified:
        leanstep.verification.verify(
            _make_norm_loss, params, NORM_BATCH, num_microbatches=2, remat="full", has_state=True,
            model_state=model_state,
        )  # fmt: skip
    line = str(verified.value)
    assert "\n" not in line and line == _plan_refusal("none", "full"), line
    assert "pass params and model_state as builders, params=lambda policy:" in line, line


def test_verify_takes_the_trees_of_the_remat_model_and_says_why_it_cannot_compare_with_no_remat():
    """One params tree and model state of the model built under remat: every check but the comparison
    with no remat runs; that one is n/a, with plan's line for the policy it would need."""
    params, model_state = _norm_trees("full")
    report = leanstep.verification.verify(
        _make_norm_loss, params, NORM_BATCH, num_microbatches=2, remat="full", has_state=True,
        model_state=model_state, checks=("accumulation", "remat"),
    )  # fmt: skip
    assert report["accumulation"].status == "pass", str(report)
    assert report["remat"].status == "n/a" and report["remat"].detail == _plan_refusal("full", "none"), str(report)


# --- item 5: the texts ---------------------------------------------------------------------------------


def test_non_finite_names_a_model_state_that_leaks_from_a_skipped_step():
    class Leaky(HandwrittenStep):
        def step(self, state, batch, num_microbatches):
            after, metrics = super().step(state, batch, num_microbatches)
            arrays = dict(after.arrays)
            x = jnp.asarray(batch["x"])
            arrays["model_state"] = {"running_mean": after.arrays["model_state"]["running_mean"] + jnp.sum(x) * 0}
            return type(after)(arrays, after.settings), metrics

    result = leanstep.verification.verify_step(Leaky(), num_microbatches=4, checks=("non_finite",))["non_finite"]
    assert result.status == "fail" and result.where.startswith("model_state/running_mean"), result
    assert (
        "model state of a skipped step was kept" in result.diagnosis and "no finiteness guard" not in result.diagnosis
    )


def test_token_weighting_says_the_mask_is_missing_when_the_loss_is_token_weighted():
    batch = padded_lm_batch()
    checks = ("token_weighting", "accumulation", "reference")
    report = leanstep.verification.verify(
        make_token_loss, PARAMS, batch, num_microbatches=4, token_weighted=True, checks=checks
    )
    # without the mask the microbatches are still weighed by the loss's own counts
    assert report["accumulation"].status == "pass" and report["reference"].status == "pass", str(report)
    detail = report["token_weighting"].detail
    assert report["token_weighting"].status == "n/a" and "token_weighted=True" in detail and "mask=" in detail
    assert "not token-weighted" not in detail


def test_the_protocol_documents_every_part_name():
    for part in leanstep.verification.PARTS:
        assert f'"{part}"' in VerifiableStep.__doc__, part


# --- item 14: raw errors ---------------------------------------------------------------------------------


def test_a_step_that_returns_only_its_state_is_refused_in_one_line():
    class StateOnly(HandwrittenStep):
        def step(self, state, batch, num_microbatches):
            return super().step(state, batch, num_microbatches)[0].arrays

    with pytest.raises(TypeError, match=r"^step: VerifiableStep.step\(state, batch, num_microbatches\) must return"):
        leanstep.verification.verify_step(StateOnly(), num_microbatches=4, checks=("accumulation",))


def test_the_cli_refuses_a_device_count_the_microbatches_cannot_split(capsys):
    flags = ["--size", "tiny", "--seq-len", "16", "--batch-size", "8", "--microbatches", "2", "--devices", "3"]
    assert main(["verify", *flags, "--checks", "meshes", "--no-resume"]) == 2
    err = capsys.readouterr().err
    assert "--devices 3" in err and "--batch-size" in err and len(err.strip().splitlines()) == 1, err


# --- the 10 covering padded configurations (slow) -------------------------------------------------------


def make_batch_norm_loss(policy):
    """A token-weighted loss with a batch statistic: hidden units centred by the microbatch's mean, a running mean."""

    def loss(params, state, batch):
        h = batch["x"] @ params["w1"]
        mean = jnp.mean(jax.lax.stop_gradient(h).astype(jnp.float32), axis=(0, 1))
        out = jnp.tanh(h - mean.astype(h.dtype)[None, None, :]) @ params["w2"]
        error = jnp.sum((out.astype(jnp.float32) - batch["y"]) ** 2, axis=-1)
        new_state = {"running_mean": 0.9 * state["running_mean"] + 0.1 * mean}
        return (jnp.sum(error * batch["mask"]), jnp.sum(batch["mask"])), new_state

    return loss


def padded_draws(count: int, seed: int) -> list[dict]:
    """``count`` correct setups drawn at random: leanstep's step or the hand-written one, padded, an
    empty microbatch or none."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        num_microbatches = rng.choice([2, 4])
        out.append(
            dict(
                step=rng.choice(["leanstep", "handwritten"]),
                num_microbatches=num_microbatches,
                empty=rng.choice([None, *range(num_microbatches)]),
                batch_stat=rng.choice([False, True, "shared"]),
                precision=rng.choice(["float32", "params=float32,compute=bfloat16,output=float32"]),
                loss_scale=rng.choice(["none", "dynamic"]),
                seed=rng.randrange(1000),
            )
        )
    return out


def _padded_pairs(case: dict) -> set[Pair]:
    """The pairs of settings ``case`` holds; the empty microbatch as none, the first or a later one."""
    values = {**case, "empty": "none" if case["empty"] is None else "first" if case["empty"] == 0 else "later"}
    return pairs(values, ("step", "num_microbatches", "empty", "batch_stat", "precision", "loss_scale"))


PADDED_POOL = 2000  # the draws the padded setups are chosen from


def padded_configurations(count: int = 10) -> list[dict]:
    """``count`` of 2,000 :func:`padded_draws`, each the first that adds the most pairs of settings not
    yet covered (tests/helpers/covering.py): 10 cover 80 of the 81 pairs that occur, as the 20 first draws,
    this test's setups until 0.12, did."""
    return covering(padded_draws(PADDED_POOL, seed=1), _padded_pairs, count)


def verify_configuration(case: dict) -> leanstep.verification.VerifyReport:
    checks = (*GRADIENT_CHECKS, "non_finite")
    m = case["num_microbatches"]
    if case["step"] == "handwritten":
        batch = padded_batch(m, empty=case["empty"], seed=case["seed"])
        dtype = jnp.float32 if case["precision"] == "float32" else jnp.bfloat16
        step = HandwrittenStep(batch=batch, batch_stat=case["batch_stat"], compute_dtype=dtype)
        return leanstep.verification.verify_step(step, num_microbatches=m, checks=checks, name=str(case))
    batch = padded_lm_batch(rows=8, empty=case["empty"] if case["empty"] is not None else m, num_microbatches=m)
    stateful = case["batch_stat"] is True  # leanstep's own microbatches each normalise by their own rows
    extra = dict(model_state={"running_mean": jnp.zeros(5)}, has_state=True) if stateful else {}
    return leanstep.verification.verify(
        make_batch_norm_loss if stateful else make_token_loss, PARAMS, batch, num_microbatches=m, token_weighted=True,
        mask="mask", precision=case["precision"], loss_scale=case["loss_scale"], checks=checks, name=str(case), **extra,
    )  # fmt: skip


def test_the_padded_setups_hold_both_steps_an_empty_microbatch_and_all_pairs_but_one():
    cases = padded_configurations()
    assert {c["step"] for c in cases} == {"leanstep", "handwritten"} and any(c["empty"] is not None for c in cases)
    covered = set().union(*map(_padded_pairs, cases))
    possible = set().union(*map(_padded_pairs, padded_draws(PADDED_POOL, seed=1)))
    assert len(covered) >= len(possible) - 1, possible - covered  # as many as the 20 random draws covered


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ten_covering_padded_configurations_pass_every_gradient_check():
    cases = padded_configurations()
    failed = [str(report) for report in map(verify_configuration, cases) if not report.passed]
    assert not failed, "\n\n".join(failed)


def test_the_cli_names_every_check_the_library_runs():
    """``leanstep verify --checks`` keeps its own list (no JAX import to build the parser): the same names, in order."""
    from leanstep.cli.verify import _check_names
    from leanstep.verification.runner import CHECKS

    assert _check_names() == list(CHECKS)
