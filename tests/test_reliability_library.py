"""Reliability of the library's settings and inputs: honoured or refused, never silently ignored.

Two classes of defects, one table of cases (the shape of ``test_reliability_input``):

1. a setting accepted and then ignored: a params dtype other than the float32 masters, a
   ``"save:NAME"`` remat policy naming a tag the model never sets, a threshold that is zero,
   denormal or infinite in float32 (the precision it is applied in);
2. an input that JAX, optax or XLA would reject deep inside with a message about itself: an
   optimizer state of another optimizer, a donated state used again, a token count that is
   not a scalar, ``jax.ShapeDtypeStruct`` stand-ins given where arrays are needed.

Each case must raise leanstep's own TypeError/ValueError, naming the argument. The positive
tests after the table check that what is honoured really works and that the new checks accept
everything they should (every optimizer of the existing tests, every tag a model sets).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep import LossContract
from leanstep.blocks import checkpoint_name, remat
from leanstep.blocks.clipping import clip_by_global_norm, clip_by_global_norm_transform
from leanstep.blocks.loss_scale import DynamicLossScale, StaticLossScale
from leanstep.blocks.precision import Precision, check_train_precision, get_precision
from leanstep.blocks.rematerialization import check_saved_names
from leanstep.inspection import audit
from leanstep.models import build_model
from leanstep.step import gradient_stage
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step
from leanstep.step.update import check_opt_state, guarded_update, guarded_update_transform
from test_reliability_input import Case

F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
SGD = optax.sgd(0.1)
ADAM = optax.adam(0.1)

# --- fixtures: one tiny linear model, one tiny remat'd block ----------------------------------


def _loss(params: dict, batch: dict) -> jax.Array:
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _batch(rows: int = 4) -> dict[str, jax.Array]:
    return {"x": jnp.ones((rows, 2)), "y": jnp.ones((rows,))}


def _state(optimizer: optax.GradientTransformation = SGD, **kwargs: Any) -> TrainState:
    return TrainState.create({"w": jnp.zeros(2)}, optimizer, **kwargs)


def _block(params: dict, x: jax.Array) -> jax.Array:
    hidden = checkpoint_name(jnp.tanh(x @ params["w"]), "hidden")
    return hidden @ params["w"]


def _untagged_block(params: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w"]) @ params["w"]


def _remat_loss(policy: Any, block: Callable = _block) -> Callable:
    wrapped = remat(block, policy)
    return lambda params, batch: jnp.mean((wrapped(params, batch["x"]) - batch["y"]) ** 2)


def _block_state(optimizer: optax.GradientTransformation = SGD) -> TrainState:
    return TrainState.create({"w": jnp.eye(2)}, optimizer)


def _block_batch() -> dict[str, jax.Array]:
    return {"x": jnp.ones((4, 2)), "y": jnp.ones((4, 2))}


def _remat_step(policy: Any, block: Callable = _block, **kwargs: Any) -> Any:
    return make_train_step(_remat_loss(policy, block), **kwargs)(_block_state(), _block_batch())


def _token_loss(count: Callable[[dict], Any]) -> Callable:
    return lambda params, batch: (jnp.sum((batch["x"] @ params["w"] - batch["y"]) ** 2), count(batch))


def _token_step(count: Callable[[dict], Any]) -> Any:
    return make_train_step(_token_loss(count), token_weighted=True, num_microbatches=2)(_state(), _batch())


def _accumulate(loss_fn: Callable, **kwargs: Any) -> Any:
    return leanstep.blocks.microbatched_value_and_grad(loss_fn, 2, **kwargs)({"w": jnp.ones(2)}, _batch())


_STEP = make_train_step(_loss)  # jitted, donating: shared by the cases that run it


def _reuse_donated_state() -> Any:
    state = _state()
    _STEP(state, _batch())
    return _STEP(state, _batch())


def _reuse_donated_params() -> Any:
    old = _state()
    new, _ = _STEP(old, _batch())
    return _STEP(new.replace(params=old.params), _batch())  # the new counters, the old (donated) params


def _deleted_batch() -> Any:
    batch = _batch()
    batch["x"].delete()
    return _STEP(_state(), batch)


def _other_optimizer(optimizer: optax.GradientTransformation, applied: optax.GradientTransformation) -> Any:
    """A state built for ``optimizer`` whose step applies ``applied`` (a restored or replaced state)."""
    return _STEP(_state(optimizer).replace(optimizer=applied), _batch())


def _adam_state_of_other_params() -> Any:
    state = _state(ADAM)
    return guarded_update(state.replace(params={"w": jnp.zeros(3)}), {"w": jnp.ones(3)})


_ABSTRACT_STATE = jax.eval_shape(_state)

CASES = [
    # --- 1a. a params dtype other than the float32 masters -------------------------------------
    Case(
        "precision/bf16_masters",
        lambda p: make_train_step(_loss, precision="params=bfloat16,compute=bfloat16,output=float32"),
        ValueError,
        "precision='params=bfloat16,compute=bfloat16,output=float32': params must be float32 (the master "
        "weights), got bfloat16",
    ),
    Case(
        "precision/bare_bf16_sets_the_masters_too",
        lambda p: make_train_step(_loss, precision="bf16"),
        ValueError,
        "use precision='params=float32,compute=bfloat16,output=bfloat16'",
    ),
    Case(
        "precision/f16_masters",
        lambda p: make_train_step(_loss, precision="p=f16,c=f16"),
        ValueError,
        "params must be float32 (the master weights), got float16",
    ),
    Case(
        "precision/f64_masters_object",
        lambda p: make_train_step(_loss, precision=Precision(jnp.float64, jnp.float32, jnp.float32)),
        ValueError,
        "params must be float32 (the master weights), got float64",
    ),
    Case(
        "precision/gradient_stage_bf16_masters",
        lambda p: gradient_stage(_loss, precision="params=bf16"),
        ValueError,
        "params must be float32 (the master weights), got bfloat16",
    ),
    Case(
        "precision/check_train_precision_half",
        lambda p: check_train_precision("half"),
        ValueError,
        "precision='half': params must be float32",
    ),
    Case(
        "precision/state_with_bf16_params",
        lambda p: _STEP(_state().replace(params={"w": jnp.zeros(2, jnp.bfloat16)}), _batch()),
        ValueError,
        "state.params['w'] has dtype bfloat16; the master weights must be float32",
    ),
    # --- 1b. a save:NAME remat policy naming a tag the model never sets -------------------------
    Case(
        "remat/save_misspelled_name",
        lambda p: _remat_step("save:hiden", num_microbatches=2),
        ValueError,
        "remat policy 'save:hiden' saves checkpoint_name tag 'hiden', which loss_fn never sets inside that "
        "jax.checkpoint region, so nothing is saved for it; the tags it sets: ['hidden']",
    ),
    Case(
        "remat/save_one_known_one_unknown",
        lambda p: _remat_step("save:hidden,attn_out"),
        ValueError,
        "saves checkpoint_name tag 'attn_out'",
    ),
    Case(
        "remat/save_two_unknown", lambda p: _remat_step("save:a,b"), ValueError, "saves checkpoint_name tags 'a', 'b'"
    ),
    Case(
        "remat/save_in_an_untagged_model",
        lambda p: _remat_step("save:hidden", _untagged_block),
        ValueError,
        "it sets no checkpoint_name tag",
    ),
    Case(
        "remat/raw_save_only_these_names_policy",
        lambda p: _remat_step(jax.checkpoint_policies.save_only_these_names("nope")),
        ValueError,
        "saves checkpoint_name tag 'nope'",
    ),
    Case(
        "remat/save_unknown_with_bf16_compute",
        lambda p: _remat_step("save:hiden", precision="compute=bf16"),
        ValueError,
        "saves checkpoint_name tag 'hiden'",
    ),
    Case(
        "remat/gradient_stage_save_unknown",
        lambda p: gradient_stage(_remat_loss("save:hiden"))({"w": jnp.eye(2)}, _block_batch()),
        ValueError,
        "saves checkpoint_name tag 'hiden'",
    ),
    Case(
        "remat/audit_of_a_step",
        lambda p: audit(make_train_step(_remat_loss("save:zz")), _block_state(), _block_batch()),
        ValueError,
        "saves checkpoint_name tag 'zz'",
    ),
    Case(
        "remat/audit_of_a_gradient",
        lambda p: audit(jax.grad(lambda w: jnp.sum(remat(_block, "save:zz")(w, jnp.ones((4, 2))))), {"w": jnp.eye(2)}),
        ValueError,
        "saves checkpoint_name tag 'zz', which the audited program never sets",
    ),
    # --- 1c. thresholds that are zero, denormal or infinite in float32 ---------------------------
    Case(
        "threshold/max_grad_norm_denormal",
        lambda p: make_train_step(_loss, max_grad_norm=1e-45),
        ValueError,
        "max_grad_norm must be a positive finite number or None, got 1e-45; it is applied in float32, so it "
        "must be in [1.1754944e-38, 3.4028235e+38]",
    ),
    Case(
        "threshold/max_grad_norm_1e-39",
        lambda p: make_train_step(_loss, max_grad_norm=1e-39),
        ValueError,
        "max_grad_norm must be a positive finite number or None, got 1e-39",
    ),
    Case(
        "threshold/max_grad_norm_inf_in_float32",
        lambda p: make_train_step(_loss, max_grad_norm=1e39),
        ValueError,
        "got 1e+39; it is applied in float32",
    ),
    Case(
        "threshold/guarded_update_max_grad_norm_denormal",
        lambda p: guarded_update(_state(), {"w": jnp.ones(2)}, max_grad_norm=1e-40),
        ValueError,
        "max_grad_norm must be a positive finite",
    ),
    Case(
        "threshold/transform_max_grad_norm_inf",
        lambda p: guarded_update_transform(SGD, max_grad_norm=1e39),
        ValueError,
        "must be in [1.1754944e-38, 3.4028235e+38]",
    ),
    Case(
        "threshold/static_scale_denormal",
        lambda p: leanstep.blocks.get_loss_scale("static", 1e-45),
        ValueError,
        "loss_scale must be finite and > 0 in float32, got 1e-45; expected a normal float32 in "
        "[1.1754944e-38, 3.4028235e+38]",
    ),
    Case(
        "threshold/static_scale_1e-40",
        lambda p: StaticLossScale.create(1e-40),
        ValueError,
        "loss_scale must be finite and > 0 in float32, got 1e-40",
    ),
    Case(
        "threshold/static_scale_inf_in_float32",
        lambda p: StaticLossScale.create(1e39),
        ValueError,
        "got 1e+39; expected a normal float32",
    ),
    Case(
        "threshold/static_scale_zero_array",
        lambda p: StaticLossScale.create(jnp.float32(0)),
        ValueError,
        "loss_scale must be finite and > 0 in float32, got 0.0",
    ),
    Case(
        "threshold/dynamic_initial_denormal",
        lambda p: DynamicLossScale.create(1e-39, min_loss_scale=F32_TINY),
        ValueError,
        "initial_scale must be finite and > 0 in float32, got 1e-39; expected a normal float32",
    ),
    Case(
        "threshold/backoff_denormal",
        lambda p: DynamicLossScale.create(8.0, backoff_factor=1e-40),
        ValueError,
        "backoff_factor must be in (0, 1) in float32, got 1e-40; expected a normal float32 in [1.1754944e-38, 1)",
    ),
    Case(
        "threshold/backoff_smallest_denormal",
        lambda p: DynamicLossScale.create(8.0, backoff_factor=1e-45),
        ValueError,
        "backoff_factor must be in (0, 1) in float32",
    ),
    Case(
        "threshold/growth_factor_rounds_to_one",
        lambda p: DynamicLossScale.create(8.0, growth_factor=1 + 1e-9),
        ValueError,
        "growth_factor must be > 1 in float32",
    ),
    Case(
        "threshold/min_loss_scale_denormal",
        lambda p: DynamicLossScale.create(8.0, min_loss_scale=1e-39),
        ValueError,
        "min_loss_scale must be >= 1.175494e-38 (smallest normal float32)",
    ),
    Case(
        "threshold/max_loss_scale_inf_in_float32",
        lambda p: DynamicLossScale.create(8.0, max_loss_scale=1e39),
        ValueError,
        "max_loss_scale must be finite in float32",
    ),
    Case(
        "threshold/clip_max_norm_denormal",
        lambda p: clip_by_global_norm({"w": jnp.ones(2)}, 1e-45),
        ValueError,
        "max_norm must be finite and > 0, got max_norm=1e-45; it is applied in float32",
    ),
    Case(
        "threshold/clip_transform_max_norm_inf",
        lambda p: clip_by_global_norm_transform(1e39),
        ValueError,
        "max_norm must be finite and > 0, got max_norm=1e+39; it is applied in float32",
    ),
    # --- settings of TrainState.create and make_train_step that were taken and then lost ---------
    Case(
        "state/static_loss_scale_without_a_value",
        lambda p: _state(loss_scale="static"),
        ValueError,
        "loss_scale='static' needs its scale: pass loss_scale=leanstep.StaticLossScale.create(S)",
    ),
    Case(
        "state/loss_scale_a_number",
        lambda p: _state(loss_scale=1024.0),
        TypeError,
        "loss_scale must be 'dynamic', 'static', 'none' or a LossScale",
    ),
    Case("state/seed_negative", lambda p: _state(seed=-1), ValueError, "seed must be an int in [0, 2**32 - 1], got -1"),
    Case(
        "state/seed_wider_than_the_key",
        lambda p: _state(seed=2**32),
        ValueError,
        "seed must be an int in [0, 2**32 - 1], got 4294967296; a PRNG key keeps 32 bits of the seed",
    ),
    Case(
        "step/donate_a_string",
        lambda p: make_train_step(_loss, donate="no"),
        TypeError,
        "donate must be a bool, got str 'no'",
    ),
    Case("step/jit_none", lambda p: make_train_step(_loss, jit=None), TypeError, "jit must be a bool"),
    # --- 2a. an optimizer state of another optimizer, or of other parameters --------------------
    Case(
        "opt_state/sgd_state_adam_step",
        lambda p: _other_optimizer(SGD, ADAM),
        ValueError,
        "state.opt_state does not match the optimizer the step applies: state.opt_state[0] is an EmptyState, "
        "optimizer.init(params)[0] is a ScaleByAdamState",
    ),
    Case(
        "opt_state/adam_state_sgd_step",
        lambda p: _other_optimizer(ADAM, SGD),
        ValueError,
        "state.opt_state[0] is a ScaleByAdamState, optimizer.init(params)[0] is an EmptyState",
    ),
    Case(
        "opt_state/chain_state_plain_adamw",
        lambda p: _other_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1)), optax.adamw(0.1)),
        ValueError,
        "state.opt_state does not match the optimizer the step applies",
    ),
    Case(
        "opt_state/other_param_shapes",
        lambda p: _adam_state_of_other_params(),
        ValueError,
        "state.opt_state[0].mu['w'] is a float32[2] array, optimizer.init(params)[0].mu['w'] is a float32[3] array",
    ),
    Case(
        "update/grads_of_other_params",
        lambda p: guarded_update(_state(), {"v": jnp.ones(2)}),
        ValueError,
        "scaled_grads must have the structure of the params (one gradient per parameter)",
    ),
    Case(
        "update/grads_of_another_shape",
        lambda p: guarded_update(_state(), {"w": jnp.ones(3)}),
        ValueError,
        "scaled_grads['w'] has shape (3,), params['w'] has (2,)",
    ),
    # --- 2b. a donated state used again ------------------------------------------------------------
    Case(
        "step/donated_state_used_again",
        lambda p: _reuse_donated_state(),
        ValueError,
        "has been deleted; the step donates its input state (donate=True)",
    ),
    Case(
        "step/donated_params_in_a_new_state",
        lambda p: _reuse_donated_params(),
        ValueError,
        "state.params['w'] has been deleted; the step donates its input state",
    ),
    Case(
        "step/deleted_batch",
        lambda p: _deleted_batch(),
        ValueError,
        "batch['x'] has been deleted (donated to, or deleted by, an earlier call)",
    ),
    # --- 2c. a token count that is not a scalar ---------------------------------------------------
    Case(
        "tokens/count_a_vector",
        lambda p: _token_step(lambda b: jnp.ones(b["y"].shape[0])),
        ValueError,
        "token_weighted=True: loss_fn's count must be a scalar, got shape (2,); reduce it (e.g. jnp.sum(mask))",
    ),
    Case(
        "tokens/count_complex",
        lambda p: _token_step(lambda b: jnp.complex64(2)),
        TypeError,
        "token_weighted=True: loss_fn's count must be a real scalar, got dtype complex64",
    ),
    Case(
        "tokens/count_a_string",
        lambda p: _token_step(lambda b: "2"),
        TypeError,
        "token_weighted=True: loss_fn's count must be a real scalar, got str",
    ),
    Case(
        "tokens/accumulate_count_a_vector",
        lambda p: _accumulate(_token_loss(lambda b: jnp.ones(2)), token_weighted=True),
        ValueError,
        "loss_fn's count must be a scalar, got shape (2,)",
    ),
    Case(
        "tokens/accumulate_without_a_count",
        lambda p: _accumulate(_loss, token_weighted=True),
        TypeError,
        "token_weighted=True: loss_fn must return (loss_sum, count), got",
    ),
    Case(
        "accumulate/loss_a_vector",
        lambda p: _accumulate(lambda q, b: b["x"] @ q["w"]),
        ValueError,
        "loss_fn's loss must be a scalar, got shape (2,); reduce it (e.g. jnp.mean)",
    ),
    Case(
        "accumulate/loss_an_int",
        lambda p: _accumulate(lambda q, b: jnp.int32(1)),
        TypeError,
        "loss_fn's loss must be a real floating scalar, got dtype int32",
    ),
    Case(
        "accumulate/has_aux_without_aux",
        lambda p: _accumulate(_loss, has_aux=True),
        TypeError,
        "has_aux=True: loss_fn must return (loss, aux)",
    ),
    # --- 2d. ShapeDtypeStructs (and other non-arrays) where arrays are needed ----------------------
    Case(
        "abstract/params_of_create",
        lambda p: TrainState.create({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, SGD),
        TypeError,
        "params['w'] is a jax.ShapeDtypeStruct (a shape without values); TrainState.create needs concrete arrays",
    ),
    Case(
        "abstract/model_state_of_create",
        lambda p: _state(model_state={"n": jax.ShapeDtypeStruct((), jnp.int32)}),
        TypeError,
        "model_state['n'] is a jax.ShapeDtypeStruct",
    ),
    Case(
        "abstract/state_of_the_step",
        lambda p: _STEP(_ABSTRACT_STATE, _batch()),
        TypeError,
        "state.step is a jax.ShapeDtypeStruct (a shape without values); the step runs on arrays",
    ),
    Case(
        "abstract/batch_of_the_step",
        lambda p: _STEP(_state(), {"x": jax.ShapeDtypeStruct((4, 2), jnp.float32), "y": jnp.ones(4)}),
        TypeError,
        "batch['x'] is a jax.ShapeDtypeStruct",
    ),
    Case(
        "step/batch_string_leaf",
        lambda p: _STEP(_state(), {"x": "ones", "y": jnp.ones(4)}),
        TypeError,
        "batch['x'] is a str; the batch must be a pytree of arrays",
    ),
    Case("step/state_a_string", lambda p: _STEP("state", _batch()), TypeError, "state must be a TrainState"),
]


def test_the_catalogue_is_big_and_its_ids_unique():
    from test_reliability_input import CATALOGUE

    ids = [c.id for c in CASES]
    assert len(CASES) >= 30 and len(set(ids)) == len(ids)
    assert not set(ids) & {c.id for c in CATALOGUE}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_setting_or_input_gets_a_clear_error(case: Case):
    with pytest.raises(case.expected) as info:
        case.call({})
    assert case.fragment in str(info.value)
    # Raised by a leanstep check, not by JAX, NumPy or optax failing further in.
    assert "/leanstep/" in traceback.extract_tb(info.tb)[-1].filename


# --- 1a. the masters are float32, whatever dtype the params are given in ------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "float32",
        "compute=bf16",
        "params=float32,compute=bfloat16,output=float32",
        "p=f32,c=f16,o=f32,strict",
        Precision(jnp.float32, jnp.bfloat16, jnp.float32),
    ],
)
def test_check_train_precision_accepts_every_float32_master_policy(spec):
    assert check_train_precision(spec) == get_precision(spec)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_params_become_exact_float32_masters_and_stay_float32(dtype):
    """bf16/f16 params are widened exactly; a step updates float32 masters (SGD against float64 NumPy)."""
    rng = np.random.default_rng(0)
    given = {"w": jnp.asarray(rng.normal(size=(3,)), dtype)}
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
    state = TrainState.create(given, optax.sgd(0.05))
    assert state.params["w"].dtype == jnp.float32
    w0 = np.asarray(given["w"], np.float64)
    np.testing.assert_array_equal(np.asarray(state.params["w"], np.float64), w0)
    state, _ = make_train_step(_loss, precision="compute=bfloat16")(state, {"x": jnp.asarray(x), "y": jnp.asarray(y)})
    assert state.params["w"].dtype == jnp.float32
    # The gradient is taken at the bf16 copy of the masters; the update itself is float32.
    w_c = w0.astype(jnp.bfloat16).astype(np.float64)
    x_c = x.astype(jnp.bfloat16).astype(np.float64)
    grad = 2 * x_c.T @ (x_c @ w_c - y.astype(np.float64)) / len(y)
    expected = w0 - 0.05 * grad
    np.testing.assert_allclose(np.asarray(state.params["w"], np.float64), expected, rtol=2e-2, atol=2e-3)
    # An update far below bf16's resolution of w is kept (a bf16 master would round it away).
    tiny = TrainState.create({"w": jnp.ones(3)}, optax.sgd(1e-4))
    tiny, _ = make_train_step(_loss, precision="compute=bfloat16")(tiny, {"x": jnp.asarray(x), "y": jnp.asarray(y)})
    assert np.all(np.asarray(tiny.params["w"]) != 1.0)
    assert np.all(np.asarray(tiny.params["w"], np.float64).astype(jnp.bfloat16) == 1.0)


# --- 1b. save:NAME policies the model does define keep working ----------------------------------


def test_a_save_policy_naming_a_tag_the_model_sets_trains_like_no_remat():
    plain = make_train_step(_remat_loss("none"), num_microbatches=2, donate=False)
    saved = make_train_step(_remat_loss("save:hidden"), num_microbatches=2, donate=False)
    state, batch = _block_state(), _block_batch()
    (new_plain, m_plain), (new_saved, m_saved) = plain(state, batch), saved(state, batch)
    np.testing.assert_allclose(m_saved.loss, m_plain.loss, rtol=1e-6)
    np.testing.assert_allclose(new_saved.params["w"], new_plain.params["w"], rtol=1e-6, atol=1e-7)
    report = audit(saved, state, batch)  # the audit accepts it too, and sees the policy
    assert {r.policy for r in report.remat_regions} == {"save:hidden"}


def test_a_backward_pass_region_may_save_a_tag_the_forward_pass_set():
    """After jax.grad the tagged value lives outside the recomputed region: that is what saving it means."""
    grad = jax.grad(lambda w: jnp.sum(remat(_block, "save:hidden")(w, jnp.ones((4, 2)))))
    report = audit(grad, {"w": jnp.eye(2)})
    assert [r.differentiated for r in report.remat_regions] == [True]


@pytest.fixture(scope="module")
def model_losses():
    def traced(name: str, policy: str) -> Any:
        model = build_model(name, "tiny")
        params = jax.eval_shape(model.init, jax.random.key(0))
        tokens = jax.ShapeDtypeStruct((2, model.seq_len + 1), jnp.int32)
        return jax.make_jaxpr(lambda p, t: model.loss(p, {"tokens": t}, remat_policy=policy))(params, tokens)

    return traced


def test_the_models_tags_pass_and_a_tag_a_model_lacks_is_named(model_losses):
    check_saved_names(model_losses("transformer", "save:attn_out,mlp_hidden"))
    check_saved_names(model_losses("mlp", "save:mlp_hidden"))
    with pytest.raises(ValueError, match=r"tag 'attn_out', .* the tags it sets: \['mlp_hidden'\]"):
        check_saved_names(model_losses("mlp", "save:attn_out,mlp_hidden"))


# --- 1c. the float32 range: its ends are accepted, one step beyond is refused -------------------


def test_thresholds_accept_the_ends_of_the_normal_float32_range():
    below, above = float(np.nextafter(np.float32(F32_TINY), np.float32(0))), math.nextafter(F32_MAX, math.inf)
    for value in (F32_TINY, 1.0, F32_MAX):
        make_train_step(_loss, max_grad_norm=value)
        assert float(StaticLossScale.create(value).loss_scale) == np.float32(value)
        clip_by_global_norm_transform(value)
    assert DynamicLossScale.create(1.0, backoff_factor=F32_TINY).backoff_factor == F32_TINY
    for value in (below, above, 0.0, -F32_TINY):
        with pytest.raises(ValueError, match="max_grad_norm must be a positive finite number"):
            make_train_step(_loss, max_grad_norm=value)
        with pytest.raises(ValueError, match="loss_scale must be finite and > 0 in float32"):
            StaticLossScale.create(value)
        with pytest.raises(ValueError, match="max_norm must be finite and > 0"):
            clip_by_global_norm_transform(value)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScale.create(1.0, backoff_factor=below)


def test_seeds_at_the_ends_of_the_range_give_distinct_keys():
    keys = {tuple(np.asarray(_state(seed=s).rng)) for s in (0, 1, 2**32 - 1)}
    assert len(keys) == 3


# --- 2a. the optimizer-state check accepts every optimizer, before and after a step -------------


def _optimizers() -> dict[str, optax.GradientTransformation]:
    decay_mask = lambda params: {"w": True, "b": False, "nested": {"v": True}}
    return {
        "sgd": optax.sgd(0.1),
        "sgd_momentum": optax.sgd(0.1, momentum=0.9, nesterov=True),
        "adam": optax.adam(1e-2),
        "adamw_masked_decay": optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
        "chain_clip_adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        "chain_leanstep_clip": optax.chain(clip_by_global_norm_transform(1.0), optax.sgd(0.1)),
        "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(0.1, 0.0, 10)),
        "masked": optax.masked(optax.adam(1e-2), decay_mask),
        "multi_transform": optax.multi_transform(
            {"a": optax.adam(1e-2), "s": optax.sgd(0.1)}, {"w": "a", "b": "s", "nested": {"v": "a"}}
        ),
        "adafactor": optax.adafactor(1e-2),
        "lion": optax.lion(1e-3),
        "apply_if_finite": optax.apply_if_finite(optax.adam(1e-2), 3),
        "multi_steps": optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
        "schedule_free": optax.contrib.schedule_free_adamw(1e-2),
    }


def _mixed_loss(params: dict, batch: dict) -> jax.Array:
    pred = batch["x"] @ params["w"] + params["b"][None, :] + jnp.sum(params["nested"]["v"])
    return jnp.mean((pred - batch["y"]) ** 2)


@pytest.mark.parametrize("name", list(_optimizers()))
def test_the_optimizer_state_check_accepts_every_optimizer(name):
    optimizer = _optimizers()[name]
    params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(2), "nested": {"v": jnp.ones((2, 2))}}
    state = TrainState.create(params, optimizer, loss_scale="dynamic")
    check_opt_state(state.opt_state, optimizer, state.params)
    batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}
    step = make_train_step(_mixed_loss, num_microbatches=2, max_grad_norm=1.0)
    after, _ = jax.eval_shape(step, state, batch)  # traced, the check included; nothing compiles
    check_opt_state(after.opt_state, optimizer, state.params)


def test_a_state_out_of_the_compiled_step_passes_the_check_again():
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=0.1))
    state = TrainState.create({"w": jnp.zeros(2)}, optimizer, loss_scale="dynamic")
    step = make_train_step(_loss, num_microbatches=2)
    for _ in range(2):
        state, metrics = step(state, _batch())
    assert int(state.step) == 2 and not bool(metrics.skipped)
    check_opt_state(state.opt_state, optimizer, state.params)


# --- 2b. donation: the returned state is the one to use; donate=False keeps the input -----------


def test_without_donation_the_same_state_can_be_stepped_twice():
    step = make_train_step(_loss, donate=False)
    state = _state()
    first, _ = step(state, _batch())
    second, _ = step(state, _batch())
    np.testing.assert_array_equal(first.params["w"], second.params["w"])


def test_the_checked_step_is_still_the_jitted_one():
    state = _state()
    compiled = _STEP.lower(state, _batch()).compile()
    assert compiled is not None and _STEP.trace(state, _batch()).jaxpr is not None
    new, _ = _STEP(state, _batch())
    cached = _STEP._cache_size()
    new, _ = _STEP(new, _batch())  # the returned state is usable, by the same executable
    assert int(new.step) == 2 and _STEP._cache_size() == cached


# --- 2c. an integer token count still works --------------------------------------------------------


def test_an_integer_token_count_gives_the_full_batch_sum_over_count():
    rng = np.random.default_rng(1)
    batch = {
        "x": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        "mask": jnp.asarray([1, 1, 0, 1], jnp.int32),
    }

    def loss_fn(params, b):
        errors = (b["x"] @ params["w"] - b["y"]) ** 2
        return jnp.sum(errors * b["mask"]), jnp.sum(b["mask"])

    result = gradient_stage(loss_fn, accumulation=2, loss=LossContract(token_weighted=True))({"w": jnp.ones(2)}, batch)
    x, y, m = (np.asarray(batch[k], np.float64) for k in ("x", "y", "mask"))
    np.testing.assert_allclose(result.loss, np.sum((x @ np.ones(2) - y) ** 2 * m) / m.sum(), rtol=1e-6)
    assert float(result.token_count) == 3.0
