"""leanstep.planning.plan with a model state (batch statistics change with microbatching; the microbatch bound)
and with remat policies that change the params' structure (a params builder, or a clear refusal)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.frameworks import equinox as leq
from leanstep.planning.cluster_grid import Layout, families_of
from leanstep.planning.cost_model import get_accelerator
from leanstep.planning.one_device import BudgetError, plan
from leanstep.planning.records import Plan
from leanstep.planning.search_options import SearchOptions, SearchSpace

D, BATCH = 8, 8
OPT = optax.sgd(0.1)


def make_stateful_loss(policy):
    """A BatchNorm-like loss: normalises by its (micro)batch's mean, keeps a running mean."""

    def loss_fn(params, model_state, batch):
        h = jnp.tanh(batch["x"] @ params["w"])
        mean = jnp.mean(h, axis=0, keepdims=True)
        out = jnp.mean((h - mean) ** 2)
        return out, {"mean": 0.9 * model_state["mean"] + 0.1 * jax.lax.stop_gradient(mean[0])}

    return loss_fn


PARAMS = {"w": jnp.ones((D, D)) / D}
STATE = {"mean": jnp.zeros((D,))}
BATCH_TREE = {"x": jnp.ones((BATCH, D))}


def _plan(budget="1GiB", **kwargs):
    return plan(
        make_stateful_loss,
        PARAMS,
        BATCH_TREE,
        OPT,
        leanstep.StepSpec(loss=leanstep.LossContract(has_state=True)),
        budget_bytes=budget,
        model_state=STATE,
        **kwargs,
    )


def test_a_model_state_plan_notes_that_microbatching_changes_batch_statistics():
    one = _plan(candidates=[(1, "none", "float32")])
    assert one.chosen.setting.num_microbatches == 1
    assert len(one.notes) == 1 and "microbatching changes batch statistics" in one.notes[0]
    assert "max_microbatches" in one.notes[0]
    two = _plan(candidates=[(2, "none", "float32")])
    assert "the chosen 2 microbatches" in two.notes[0] and "over 4 rows, not over the batch of 8" in two.notes[0]
    assert "note: microbatching changes batch statistics" in str(two)
    assert Plan.from_json(two.to_json()).notes == two.notes
    stateless = plan(
        lambda policy: lambda p, b: jnp.mean(b["x"] @ p["w"]),
        PARAMS,
        BATCH_TREE,
        OPT,
        budget_bytes="1GiB",
        candidates=[(2, "none", "float32")],
    )
    assert stateless.notes == ()


def test_the_microbatch_bound_is_honoured():
    # min_microbatch_rows=1: this batch of 8 rows is below the default 16 rows a microbatch (issue 41, item 17)
    space = SearchSpace(remat_policies=["none"], max_microbatches=2, min_microbatch_rows=1)
    found = _plan(candidates=space, search=SearchOptions(exhaustive=True))
    assert {c.setting.num_microbatches for c in found.candidates} == {1, 2}
    assert found.chosen.setting.num_microbatches <= 2


def test_the_microbatch_bound_refuses_clearly():
    with pytest.raises(ValueError, match=r"SearchSpace.max_microbatches must be a positive int or None, got 0"):
        SearchSpace(max_microbatches=0)
    with pytest.raises(ValueError, match=r"SearchSpace.max_microbatches must be a positive int or None"):
        SearchSpace(max_microbatches=1.5)
    with pytest.raises(ValueError, match=r"no microbatch count .* within SearchSpace.max_microbatches=2"):
        _plan(candidates=SearchSpace(remat_policies=["none"], microbatches=[4, 8], max_microbatches=2))
    with pytest.raises(BudgetError, match=r"no setting with at most SearchSpace.max_microbatches=1 fits the budget"):
        _plan(budget="1KiB", candidates=SearchSpace(remat_policies=["none"], max_microbatches=1))


def test_a_cluster_space_honours_the_microbatch_bound():
    layout = Layout({"data": 2}, rows=8, argument_bytes=100, sizes={"shard": 0.0})
    found, _ = families_of(
        layout, SearchSpace(["none"], max_microbatches=2), "float32", {"none": 0.0}, get_accelerator("h100")
    )
    assert [c.setting.num_microbatches for c in found] == [1, 2]


class _Block(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class _Model(eqx.Module):
    block: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(self.block(x))


def _model(policy):
    k1, k2 = jax.random.split(jax.random.key(0))
    model = _Model(_Block(eqx.nn.Linear(D, D, key=k1)), eqx.nn.Linear(D, 1, key=k2))
    return eqx.tree_at(lambda m: m.block, model, leanstep.blocks.remat(model.block, policy))


def _make_eqx_loss(policy):
    _, static = leq.split(_model(policy))
    return leq.loss(static, lambda model, batch: jnp.mean(jax.vmap(model)(batch["x"]) ** 2))


def test_a_remat_that_changes_the_params_structure_is_refused_naming_the_params_builder():
    params, _ = leq.split(_model("none"))
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1])
    with pytest.raises(
        ValueError, match=r"remat policy 'full' .*pass params as a params builder, params=lambda policy"
    ):
        plan(_make_eqx_loss, params, BATCH_TREE, OPT, budget_bytes="1GiB", candidates=space)


def test_a_params_builder_plans_every_policy():
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1])
    found = plan(
        _make_eqx_loss,
        lambda policy: leq.split(_model(policy))[0],
        BATCH_TREE,
        OPT,
        budget_bytes="1GiB",
        candidates=space,
        search=SearchOptions(exhaustive=True),
    )
    assert {c.setting.remat for c in found.candidates if c.compiled} == {"none", "full"}
    assert np.isfinite(found.chosen.flops)


def test_a_linen_model_whose_unnamed_blocks_are_renamed_under_remat_is_refused():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + jnp.tanh(nn.Dense(D)(x))

    class Net(nn.Module):
        policy: str

        @nn.compact
        def __call__(self, x):
            return leanstep.blocks.remat(Block, self.policy)()(x)  # unnamed: Block_0, or CheckpointBlock_0 under remat

    def make_loss(policy):
        return lambda p, b: jnp.mean(Net(policy).apply(p, b["x"]) ** 2)

    params = Net("none").init(jax.random.key(0), BATCH_TREE["x"])
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1])
    with pytest.raises(ValueError, match=r"remat policy 'full' .*params builder"):
        plan(make_loss, params, BATCH_TREE, OPT, budget_bytes="1GiB", candidates=space)
    builder = lambda policy: Net(policy).init(jax.random.key(0), BATCH_TREE["x"])
    found = plan(make_loss, builder, BATCH_TREE, OPT, budget_bytes="1GiB", candidates=space)
    assert found.chosen.fits


def test_cli_plan_takes_max_microbatches(tmp_path):
    import argparse
    import json

    from leanstep.cli import plan as cli

    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers())
    out = tmp_path / "plan.json"
    tiny = ["--model", "mlp", "--size", "tiny", "--batch-size", "4", "--seq-len", "8", "--remat-policies", "none"]
    args = parser.parse_args(
        ["plan", "--budget", "64MiB", *tiny, "--max-microbatches", "2", "--all", "--json", str(out)]
    )
    assert args.run(args) == 0
    saved = json.loads(out.read_text())
    assert {c["num_microbatches"] for c in saved["candidates"]} == {1, 2} and saved["notes"] == []


def test_a_cluster_plan_refuses_a_params_builder():
    with pytest.raises(ValueError, match=r"a params builder \(params=policy -> params\) plans one device"):
        plan(
            _make_eqx_loss,
            lambda policy: leq.split(_model(policy))[0],
            BATCH_TREE,
            OPT,
            budget_bytes="1GiB",
            num_devices=1,
        )


# --- issue 57, item 9: a model state with no leaves holds no batch statistics ----------------------------


def make_stateless_nnx_loss(policy):
    from flax import nnx

    from leanstep.frameworks import nnx as lnnx

    graphdef, _, _ = lnnx.split(_nnx_mlp(nnx))
    return lnnx.loss(graphdef, lambda model, batch: jnp.mean(model(batch["x"]) ** 2))


def _nnx_mlp(nnx):
    return nnx.Sequential(nnx.Linear(D, 4 * D, rngs=nnx.Rngs(0)), nnx.Linear(4 * D, 1, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("empty", ["nnx", "dict"])
def test_an_empty_model_state_is_planned_as_no_model_state(empty):
    """The empty model state leanstep.frameworks.nnx.loss took for every NNX model (has_state=True): no
    batch-statistics note, no 16-row floor; the plan is the one without a model state."""
    from flax import nnx

    from leanstep.frameworks import nnx as lnnx

    _, params, model_state = lnnx.split(_nnx_mlp(nnx))
    assert jax.tree.leaves(model_state) == []
    model_state = model_state if empty == "nnx" else {}
    make_loss = make_stateless_nnx_loss if empty == "nnx" else lambda policy: lambda p, s, b: (jnp.mean(b["x"]), s)
    space = SearchSpace(remat_policies=["none"])
    found = plan(
        make_loss, params, BATCH_TREE, OPT, leanstep.StepSpec(loss=leanstep.LossContract(has_state=True)), budget_bytes="1GiB", model_state=model_state,
        candidates=space, search=SearchOptions(exhaustive=True),
    )  # fmt: skip
    assert found.notes == ()
    assert {c.setting.num_microbatches for c in found.candidates} == {1, 2, 4, 8}
    # The reference: the same loss planned without a model state (the new spelling for NNX).
    stateless = plan(
        make_stateless_nnx_loss, params, BATCH_TREE, OPT, budget_bytes="1GiB", candidates=space,
        search=SearchOptions(exhaustive=True),
    )  # fmt: skip
    assert {c.setting.num_microbatches for c in stateless.candidates} == {1, 2, 4, 8} and stateless.notes == ()


def test_an_empty_model_state_takes_the_microbatches_that_fit():
    """Gemma's case: only more microbatches fit the budget; a 16-row floor would leave none."""
    from flax import nnx

    from leanstep.frameworks import nnx as lnnx

    _, params, model_state = lnnx.split(_nnx_mlp(nnx))
    batch = {"x": jnp.ones((8, 256, D))}  # 8 rows of 256 positions: activations outweigh the params
    space = SearchSpace(remat_policies=["none"], microbatches=[1, 2])
    kwargs = dict(model_state=model_state, candidates=space, search=SearchOptions(exhaustive=True))
    stateful = leanstep.StepSpec(loss=leanstep.LossContract(has_state=True))
    one, two = (
        plan(make_stateless_nnx_loss, params, batch, OPT, stateful, budget_bytes="1GiB", **kwargs).candidates[i]
        for i in (0, 1)
    )
    assert one.peak_bytes > two.peak_bytes
    found = plan(make_stateless_nnx_loss, params, batch, OPT, stateful, budget_bytes=two.peak_bytes, **kwargs)
    assert found.chosen.setting.num_microbatches == 2
    # No batch-statistics note; the budget is the peak itself, so the one note is that the params
    # held beside an eagerly made state would not fit (leanstep.planning.eager_state).
    assert len(found.notes) == 1 and found.notes[0].startswith("the step fits with the state made in one program")
