"""Settings as values: LossContract, Accumulation and the step's settings, checked in one place
(what 0.12 removed, the 0.7 keywords and import paths: tests/test_removed.py)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep import Accumulation, LossContract, TrainState, make_train_step
from leanstep.blocks.loss_contract import LossOutput
from leanstep.blocks.microbatches import split_microbatches, split_strided_microbatches
from leanstep.step import ShardingLayer, gradient_stage

CONTRACTS = [LossContract(*flags) for flags in itertools.product((False, True), repeat=4)]


def build_output(contract: LossContract, loss: float, count: int, aux: str, state: dict):
    """What a loss of ``contract`` returns, built by hand from the table in the module doc."""
    out = (jnp.float32(loss), count) if contract.token_weighted else jnp.float32(loss)
    out = (out, aux) if contract.has_aux else out
    return (out, state) if contract.has_state else out


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.flags or "plain")
def test_parse_reads_every_contract_as_its_table_says(contract):
    state = {"n": jnp.int32(0)}
    out = contract.parse(build_output(contract, 2.5, 7, "aux", {"n": 3}), state)
    assert float(out.value) == 2.5 and out.value.dtype == jnp.float32
    assert (out.token_count is None) == (not contract.token_weighted)
    if contract.token_weighted:
        assert float(out.token_count) == 7.0 and out.token_count.dtype == jnp.float32
    assert out.aux == ("aux" if contract.has_aux else None)
    if contract.has_state:  # cast to the old state's dtype (a scan carry keeps its type)
        assert out.model_state["n"].dtype == jnp.int32 and int(out.model_state["n"]) == 3
    else:
        assert out.model_state is None


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.flags or "plain")
def test_arguments_follow_the_contract(contract):
    assert contract.arguments("p", "s", "b", "k") == (
        "p",
        *(("s",) if contract.has_state else ()),
        "b",
        *(("k",) if contract.uses_rng else ()),
    )


def test_expected_names_the_whole_structure():
    assert LossContract().expected == "loss"
    assert LossContract(True, True, True, True).expected == "(((loss_sum, count), aux), new_model_state)"
    assert LossContract(has_aux=True, uses_rng=True).flags == "has_aux=True and uses_rng=True"


@pytest.mark.parametrize(
    ("contract", "out", "error", "pattern"),
    [
        (LossContract(has_aux=True), jnp.float32(1.0), TypeError, r"has_aux=True: loss_fn must return \(loss, aux\)"),
        (
            LossContract(token_weighted=True),
            jnp.float32(1.0),
            TypeError,
            r"token_weighted=True: loss_fn must return \(loss_sum, count\), got a scalar \(a mean\? return",
        ),
        (
            LossContract(has_state=True),
            jnp.float32(1.0),
            TypeError,
            r"has_state=True: loss_fn must return \(out, new_model_state\)",
        ),
        (LossContract(token_weighted=True), (jnp.float32(1.0), "2"), TypeError, "count must be a real scalar, got str"),
        (LossContract(), jnp.ones(2), ValueError, r"loss_fn's loss must be a scalar, got shape \(2,\)"),
        (LossContract(), jnp.int32(1), TypeError, "loss_fn's loss must be a real floating scalar, got dtype int32"),
    ],
)
def test_parse_names_what_is_wrong(contract, out, error, pattern):
    with pytest.raises(error, match=pattern):
        contract.parse(out, {"n": jnp.int32(0)})


def test_a_new_model_state_of_another_structure_is_refused():
    with pytest.raises(TypeError, match="a new model state of the structure it was given"):
        LossContract(has_state=True).parse((jnp.float32(1.0), {"m": 1}), {"n": jnp.int32(0)})


@pytest.mark.parametrize("field", ["has_aux", "token_weighted", "uses_rng", "has_state"])
def test_contract_fields_must_be_bools(field):
    with pytest.raises(TypeError, match=f"{field} must be a bool, got str 'yes'"):
        LossContract(**{field: "yes"})


def test_accumulation_splits_as_its_splitter_does_and_checks_itself():
    batch = {"x": jnp.arange(12).reshape(6, 2)}
    np.testing.assert_array_equal(Accumulation(3).split_batch(batch)["x"], split_microbatches(batch, 3)["x"])
    strided = Accumulation(3, split="strided").split_batch(batch)["x"]
    np.testing.assert_array_equal(strided, split_strided_microbatches(batch, 3)["x"])
    assert not np.array_equal(strided, Accumulation(3).split_batch(batch)["x"])
    with pytest.raises(ValueError, match="num_microbatches"):
        Accumulation(0)
    with pytest.raises(ValueError, match="split"):
        Accumulation(2, split="diagonal")
    with pytest.raises(TypeError, match="unroll must be a bool or an int >= 1, got 0"):
        Accumulation(2, unroll=0)
    assert Accumulation(2).replace(unroll=True).unroll is True


def _aux_loss(params, batch):
    err = batch["x"] @ params["w"] - batch["y"]
    return jnp.mean(err**2), {"max": jnp.max(jnp.abs(err))}


def _params():
    return {"w": jnp.asarray(np.random.default_rng(0).normal(size=(3, 1)), jnp.float32)}


def _batch():
    rng = np.random.default_rng(1)
    return {
        "x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(8, 1)), jnp.float32),
    }


def test_the_gradient_stage_s_values_give_the_full_batch_gradient_and_strided_aux():
    stage = gradient_stage(_aux_loss, accumulation=Accumulation(4, split="strided"), loss=LossContract(has_aux=True))
    a = stage(_params(), _batch())
    # The reference: the full batch's gradient, by jax.grad, without leanstep; the aux of the strided rows.
    reference = jax.grad(lambda p: _aux_loss(p, _batch())[0])(_params())
    np.testing.assert_allclose(a.grads["w"], reference["w"], rtol=1e-5, atol=1e-6)
    rows = [_aux_loss(_params(), {k: v[j::4] for k, v in _batch().items()})[1]["max"] for j in range(4)]
    np.testing.assert_allclose(a.aux["max"], np.stack(rows), rtol=1e-6)
    # An int is that many contiguous microbatches.
    contiguous = gradient_stage(_aux_loss, accumulation=4, loss=LossContract(has_aux=True))(_params(), _batch())
    np.testing.assert_allclose(contiguous.grads["w"], reference["w"], rtol=1e-5, atol=1e-6)


def test_the_gradient_stage_refuses_values_of_the_wrong_type():
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_micro'"):
        gradient_stage(_aux_loss, num_micro=2)
    with pytest.raises(TypeError, match="loss must be a leanstep.LossContract, got dict"):
        gradient_stage(_aux_loss, loss={"has_aux": True})
    with pytest.raises(TypeError, match="accumulation must be a leanstep.Accumulation or a number"):
        gradient_stage(_aux_loss, accumulation="2")


def test_make_train_step_takes_the_values_or_the_short_keywords_and_they_agree():
    state = lambda: TrainState.create(_params(), optax.adam(0.1))
    short = make_train_step(_aux_loss, num_microbatches=2, has_aux=True, max_grad_norm=1.0)
    values = make_train_step(
        _aux_loss, accumulation=Accumulation(2), loss=LossContract(has_aux=True), max_grad_norm=1.0
    )
    (s1, m1), (s2, m2) = short(state(), _batch()), values(state(), _batch())
    np.testing.assert_array_equal(s1.params["w"], s2.params["w"])
    assert not np.array_equal(s1.params["w"], _params()["w"])  # the step moved the weights
    np.testing.assert_array_equal(m1.aux["max"], m2.aux["max"])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(loss=LossContract(has_aux=True), has_aux=True), ValueError, "inside loss=LossContract"),
        (dict(accumulation=Accumulation(2), num_microbatches=2), ValueError, "inside accumulation=Accumulation"),
        (dict(accumulation=2), TypeError, "accumulation must be a leanstep.Accumulation, got int"),
        (dict(accumulation=Accumulation(2, divide=False)), ValueError, r"Accumulation\(divide=False\) hands on sums"),
        (dict(num_micro=2), TypeError, "unexpected keyword argument 'num_micro'"),
    ],
)
def test_make_train_step_refuses_what_cannot_work_in_one_place(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        make_train_step(_aux_loss, **kwargs)


def test_presplit_on_one_device_is_taken():
    assert callable(make_train_step(_aux_loss, split="presplit", mesh=None))


def test_presplit_on_a_mesh_is_refused_for_either_form():
    layer = ShardingLayer(leanstep.sharding.data_mesh(jax.devices()[:1]))
    for kwargs in (dict(split="presplit"), dict(accumulation=Accumulation(1, split="presplit"))):
        with pytest.raises(ValueError, match="split='presplit' is not supported with a mesh"):
            make_train_step(_aux_loss, mesh=layer, **kwargs)


def test_loss_output_is_a_plain_record():
    assert LossOutput._fields == ("value", "token_count", "aux", "model_state")


# Messages that name the flag (issue 27, item 9): every loss arity against every contract.
ARITIES = {
    2: lambda p, b: jnp.sum(b["x"] @ p["w"]),
    3: lambda p, s, b: jnp.sum(b["x"] @ p["w"]),
    4: lambda p, s, b, k: jnp.sum(b["x"] @ p["w"]),
}


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.flags or "plain")
@pytest.mark.parametrize("arity", sorted(ARITIES))
def test_a_loss_that_cannot_take_the_contract_s_arguments_is_named_at_build(contract, arity):
    wanted = 2 + contract.has_state + contract.uses_rng
    if wanted == arity:
        contract.check_signature(ARITIES[arity])  # fits: nothing to say
        return
    with pytest.raises(TypeError, match=r"cannot be called as loss_fn\(params, .*has_state=True passes .*uses_rng"):
        gradient_stage(ARITIES[arity], loss=contract)


def test_a_loss_with_a_default_or_star_args_fits_and_a_builtin_is_let_through():
    LossContract(uses_rng=True).check_signature(lambda p, b, key=None: 0.0)
    LossContract(uses_rng=True, has_state=True).check_signature(lambda *args: 0.0)
    LossContract().check_signature(max)


@pytest.mark.parametrize("contract", [c for c in CONTRACTS if not (c.has_aux and c.token_weighted and c.has_state)])
def test_a_tuple_the_contract_does_not_expect_names_the_fields_that_would(contract):
    """A pair where the contract expects a scalar: the message names each unset field and its shape."""
    out = (jnp.float32(1.0), jnp.float32(2.0))
    # Wrapped as deep as the contract unpacks, so that the bare pair sits where the loss (or loss_sum) goes.
    value = (out, 1) if contract.token_weighted else out
    value = (value, "aux") if contract.has_aux else value
    value = (value, {"n": jnp.int32(0)}) if contract.has_state else value
    with pytest.raises(TypeError, match="got a tuple of 2") as caught:
        contract.parse(value, {"n": jnp.int32(0)})
    for field in ("has_aux", "token_weighted", "has_state"):
        assert (f"needs {field}=True" in str(caught.value)) == (not getattr(contract, field)), caught.value


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        ("linen", r"params is a Linen module \(Dense\), which holds no parameters: initialize it"),
        ("linen_inside", r"params\['model'\] is a Linen module \(Dense\)"),
        ("equinox_state", r"params\[1\] is an eqx.nn.State .* model_state=state"),
    ],
)
def test_a_framework_object_given_as_params_is_named_with_its_fix(make, pattern):
    import equinox as eqx
    import flax.linen as nn

    model, eqx_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    params = {
        "linen": lambda: nn.Dense(2),
        "linen_inside": lambda: {"model": nn.Dense(2), "w": jnp.ones(2)},
        "equinox_state": lambda: (eqx.filter(model, eqx.is_inexact_array), eqx_state),
    }[make]()
    with pytest.raises(TypeError, match=pattern):
        TrainState.create(params, optax.sgd(0.1))


def test_a_plain_mesh_becomes_a_layer_reducing_per_microbatch_with_a_model_state():
    from leanstep.step.settings import step_settings

    mesh = leanstep.sharding.data_mesh(jax.devices()[:1])
    short = dict(num_microbatches=2, mesh=mesh)
    stateful = leanstep.StepSpec.from_keywords(**short, has_state=True)
    plain = leanstep.StepSpec.from_keywords(**short)
    assert (stateful.sharding.reduce, plain.sharding.reduce) == ("microbatch", "auto")
    assert step_settings(stateful, mesh).layer.reduce == "microbatch"
    assert step_settings(stateful, mesh).layer.mesh is mesh and stateful.accumulation.split == "strided"
    layer = ShardingLayer(mesh, reduce="step")
    assert step_settings(leanstep.StepSpec.from_keywords(mesh=layer), layer).layer is layer
