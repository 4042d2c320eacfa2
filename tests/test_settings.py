"""Settings as values: LossContract, Accumulation and the step's settings, checked in one place;
and the 0.7 keywords and import paths, still working through 0.8 with a DeprecationWarning."""

from __future__ import annotations

import importlib
import itertools
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep import Accumulation, LossContract, ShardingLayer, TrainState, gradient_stage, make_train_step
from leanstep._moved import MOVED
from leanstep.blocks.loss_contract import LossOutput
from leanstep.blocks.microbatches import split_microbatches, split_strided_microbatches

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
            r"token_weighted=True: loss_fn must return \(loss_sum, count\), got ArrayImpl",
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


def test_the_gradient_stage_s_old_keywords_warn_and_give_the_same_result_as_the_values():
    new = gradient_stage(_aux_loss, accumulation=Accumulation(4, split="strided"), loss=LossContract(has_aux=True))
    with pytest.warns(DeprecationWarning, match=r"gradient_stage\(has_aux=, num_microbatches=, split=\) is deprecated"):
        old = gradient_stage(_aux_loss, num_microbatches=4, split="strided", has_aux=True)
    a, b = new(_params(), _batch()), old(_params(), _batch())
    np.testing.assert_array_equal(a.grads["w"], b.grads["w"])
    np.testing.assert_array_equal(a.aux["max"], b.aux["max"])
    # The reference: the full batch's gradient, by jax.grad, without leanstep.
    reference = jax.grad(lambda p: _aux_loss(p, _batch())[0])(_params())
    np.testing.assert_allclose(a.grads["w"], reference["w"], rtol=1e-5, atol=1e-6)


def test_the_gradient_stage_refuses_a_value_and_its_keyword_together():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="inside loss=LossContract"):
        gradient_stage(_aux_loss, loss=LossContract(has_aux=True), has_aux=True)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="inside accumulation=Accumulation"):
        gradient_stage(_aux_loss, accumulation=Accumulation(2), split="strided")
    with pytest.raises(TypeError, match=r"gradient_stage\(\) got unexpected keyword argument\(s\): num_micro"):
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
        (dict(num_micro=2), TypeError, r"make_train_step\(\) got unexpected keyword argument\(s\): num_micro"),
    ],
)
def test_make_train_step_refuses_what_cannot_work_in_one_place(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        make_train_step(_aux_loss, **kwargs)


def test_presplit_on_one_device_is_taken():
    assert callable(make_train_step(_aux_loss, split="presplit", mesh=None))


def test_presplit_on_a_mesh_is_refused_for_either_form():
    layer = ShardingLayer(leanstep.data_mesh(jax.devices()[:1]))
    for kwargs in (dict(split="presplit"), dict(accumulation=Accumulation(1, split="presplit"))):
        with pytest.raises(ValueError, match="split='presplit' is not supported with a mesh"):
            make_train_step(_aux_loss, mesh=layer, **kwargs)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_0_7_module_path_imports_with_a_warning_and_forwards(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]} in leanstep 0.8"):
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    public = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert public and all(getattr(module, name) is getattr(new, name) for name in public)
    assert set(public) <= set(dir(module))
    sys.modules.pop(old, None)


def test_the_warning_points_at_the_importer():
    sys.modules.pop("leanstep.gradients", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from leanstep.gradients import gradient_stage as moved  # noqa: F401

    assert [w.filename for w in caught if issubclass(w.category, DeprecationWarning)] == [__file__]
    sys.modules.pop("leanstep.gradients", None)


def test_names_that_left_the_sharding_package_still_resolve_with_a_warning():
    with pytest.warns(DeprecationWarning, match="leanstep.sharding.shard_train_state moved to leanstep.step"):
        moved = leanstep.sharding.shard_train_state
    assert moved is leanstep.shard_train_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        leanstep.sharding.state_shardings  # noqa: B018
    assert [w.filename for w in caught] == [__file__]
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        leanstep.sharding.nothing  # noqa: B018


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
