"""leanstep.planning.plan with a BatchNorm CNN (issue 41, item 17): a model state renamed under remat, and
microbatches too small for batch statistics.

* The Linen ResNet that docs/planning.md names (unnamed blocks, renamed ``ResNetBlock_0`` ->
  ``CheckpointResNetBlock_0`` under remat) renames its ``batch_stats`` with its params: a params
  builder alone failed with the loss contract's "loss_fn must return a new model state of the
  structure it was given", which blames the loss. Now ``model_state`` takes a builder too, and one
  model-state tree for such a policy is one ``ValueError`` naming the cause and ``model_state=``.
* By default the plan tried, and under a tight budget chose, 32 microbatches of one image for a
  batch of 32: BatchNorm's statistics over one image are degenerate. Now a ``SearchSpace`` leaves
  out microbatches of fewer than ``min_microbatch_rows`` rows, 16 by default for a model with a
  model state (1 without), and a budget only smaller microbatches fit is a ``BudgetError`` naming it.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import leanstep
from leanstep.frameworks import linen as llinen
from leanstep.planning.one_device import BudgetError, plan
from leanstep.planning.search_options import SearchOptions, SearchSpace

ROWS = 32
BATCH = {"x": jnp.ones((ROWS, 6, 6, 1)), "y": jnp.zeros((ROWS,), jnp.int32)}
OPT = optax.sgd(0.1)
EXHAUSTIVE = SearchOptions(exhaustive=True)
MIN_ROWS = 16  # the default fewest rows a microbatch of a model with batch statistics


class ResNetBlock(nn.Module):
    """flax's imagenet ResNet block, small: two convolutions, each with its BatchNorm."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.relu(norm()(nn.Conv(4, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(4, (3, 3), use_bias=False)(y))
        return nn.relu(x + y)


class ResNet(nn.Module):
    remat: str = "none"

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3))(x)
        block = leanstep.blocks.remat(ResNetBlock, self.remat, static_argnums=(2,))
        x = block()(x, train)  # unnamed: renamed under remat
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


def make_loss(policy):
    def loss_fn(params, model_state, batch):
        logits, model_state = llinen.apply(ResNet(policy), params, model_state, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), model_state

    return loss_fn


@functools.cache
def variables(policy):
    return llinen.split(ResNet(policy).init(jax.random.key(0), BATCH["x"], train=False))


params_for = lambda policy: variables(policy)[0]
state_for = lambda policy: variables(policy)[1]


def _plan(params, model_state, **kwargs):
    return plan(
        make_loss,
        params,
        BATCH,
        OPT,
        leanstep.StepSpec(loss=leanstep.LossContract(has_state=True)),
        model_state=model_state,
        **kwargs,
    )


# --- a model state renamed under remat ----------------------------------------------------------------


def test_the_model_s_batch_stats_are_renamed_under_remat():
    """The premise: the policy renames the block's batch_stats with its params."""
    assert "ResNetBlock_0" in state_for("none")["batch_stats"]
    assert "CheckpointResNetBlock_0" in state_for("full")["batch_stats"]
    assert "ResNetBlock_0" not in state_for("full")["batch_stats"]


def test_a_model_state_builder_plans_every_policy_with_its_own_model_state():
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1])
    found = _plan(params_for, state_for, budget_bytes="1GiB", candidates=space, search=EXHAUSTIVE)
    by_policy = {c.setting.remat: c for c in found.candidates}
    assert set(by_policy) == {"none", "full"} and all(c.compiled for c in by_policy.values())
    # The reference: each policy planned alone, with the trees of its own model (no builder needed).
    for policy, candidate in by_policy.items():
        alone = _plan(
            params_for(policy),
            state_for(policy),
            budget_bytes="1GiB",
            candidates=SearchSpace(remat_policies=[policy], microbatches=[1]),
        )
        assert (candidate.peak_bytes, candidate.flops) == (alone.chosen.peak_bytes, alone.chosen.flops), policy


def test_one_model_state_for_a_policy_that_renames_it_is_refused_naming_model_state():
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1])
    with pytest.raises(ValueError) as info:
        _plan(params_for, state_for("none"), budget_bytes="1GiB", candidates=space)
    text = str(info.value)
    assert info.type is ValueError and "\n" not in text, text
    assert text.startswith("under remat policy 'full' the model state's structure changes"), text
    assert "pass model_state as a builder too, model_state=lambda policy:" in text, text
    assert "loss_fn must return" not in text, text  # the loss is not to blame


def test_one_params_and_one_model_state_for_a_renaming_policy_name_both_builders():
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1])
    with pytest.raises(ValueError) as info:
        _plan(params_for("none"), state_for("none"), budget_bytes="1GiB", candidates=space)
    text = str(info.value)
    assert info.type is ValueError and "\n" not in text, text
    assert "remat policy 'full' does not take the params and model_state given" in text, text
    assert "pass params and model_state as builders, params=lambda policy: <the params" in text, text
    assert "and model_state=lambda policy: <the model state of the model built under that policy>" in text, text


# --- microbatches too small for batch statistics -------------------------------------------------------


@functools.cache
def _every_count_planned():
    """The reference: every divisor of the batch, compiled (min_microbatch_rows=1, 0.11's default)."""
    space = SearchSpace(remat_policies=["none"], min_microbatch_rows=1)
    return _plan(params_for("none"), state_for("none"), budget_bytes="1GiB", candidates=space, search=EXHAUSTIVE)


def test_a_batchnorm_cnn_is_planned_with_at_least_16_rows_a_microbatch_by_default():
    found = _plan(
        params_for("none"),
        state_for("none"),
        budget_bytes="1GiB",
        candidates=SearchSpace(remat_policies=["none"]),
        search=EXHAUSTIVE,
    )
    from leanstep.planning.search_options import BATCH_STATISTICS_ROWS

    assert BATCH_STATISTICS_ROWS == MIN_ROWS
    assert sorted(c.setting.num_microbatches for c in found.candidates) == [1, 2]  # 32 and 16 rows
    assert "microbatches of fewer than 16 rows were not planned (SearchSpace.min_microbatch_rows" in found.notes[0]
    every = sorted(c.setting.num_microbatches for c in _every_count_planned().candidates)
    assert every == [1, 2, 4, 8, 16, 32]


def test_a_budget_only_one_image_microbatches_fit_is_refused_naming_the_minimum():
    peaks = {c.setting.num_microbatches: c.peak_bytes for c in _every_count_planned().candidates}
    budget = peaks[32]  # the smallest microbatches' peak: 0.11 chose them, one image each
    assert min(peaks[1], peaks[2]) > budget  # the premise: no microbatch of 16 rows or more fits it
    before = _plan(
        params_for("none"),
        state_for("none"),
        budget_bytes=budget,
        candidates=SearchSpace(remat_policies=["none"], min_microbatch_rows=1),
    )
    assert ROWS // before.chosen.setting.num_microbatches < MIN_ROWS
    with pytest.raises(BudgetError) as info:
        _plan(
            params_for("none"), state_for("none"), budget_bytes=budget, candidates=SearchSpace(remat_policies=["none"])
        )
    assert "lower SearchSpace.min_microbatch_rows=16 (microbatches of fewer rows were not planned" in str(info.value)
    assert "\n" not in str(info.value)


def test_the_minimum_is_a_setting_for_any_model():
    stateless = plan(
        lambda policy: lambda p, b: jnp.mean(jnp.tanh(b["x"].reshape(b["x"].shape[0], -1) @ p["w"]) ** 2),
        {"w": jnp.ones((36, 4))},
        BATCH,
        OPT,
        budget_bytes="1GiB",
        search=EXHAUSTIVE,
        candidates=SearchSpace(remat_policies=["none"]),
    )
    assert sorted(c.setting.num_microbatches for c in stateless.candidates) == [1, 2, 4, 8, 16, 32]
    bounded = SearchSpace(remat_policies=["none"], min_microbatch_rows=8)
    assert [m for m in (1, 2, 4, 8, 16, 32) if bounded.allows(m, ROWS)] == [1, 2, 4]
    with pytest.raises(ValueError, match=r"SearchSpace.min_microbatch_rows must be a positive int or None, got 0"):
        SearchSpace(min_microbatch_rows=0)
    with pytest.raises(ValueError, match=r"leaves at least 16 rows a microbatch \(SearchSpace.min_microbatch_rows"):
        _plan(
            params_for("none"),
            state_for("none"),
            budget_bytes="1GiB",
            candidates=SearchSpace(remat_policies=["none"], microbatches=[4, 8]),
        )
