"""Tests for leanstep.models: shapes, the loss against float64 NumPy references, remat, bf16."""

from __future__ import annotations

import dataclasses
import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from leanstep.blocks.rematerialization import remat
from leanstep.inspection.residuals import saved_residuals_report
from leanstep.models import (
    MLPConfig,
    TransformerConfig,
    build_model,
    count_params,
    init_residual_mlp,
    init_transformer,
    residual_block,
    residual_mlp_flops_per_token,
    residual_mlp_loss,
    residual_mlp_loss_sum,
    transformer_flops_per_token,
    transformer_logits,
    transformer_loss,
    transformer_loss_sum,
)
from leanstep.models.transformer import _block

TF = build_model("transformer", "tiny").config
MLP = build_model("mlp", "tiny").config
REMAT_POLICIES = ["full", "dots", "dots_no_batch", "save:attn_out,mlp_hidden"]
LN256 = math.log(256)
# Shared jitted entry points, each compiled once for the one batch shape used below: eager
# calls would compile every primitive separately and dominate the runtime.
tf_logits = jax.jit(functools.partial(transformer_logits, config=TF))
tf_loss_sum = jax.jit(functools.partial(transformer_loss_sum, config=TF))
tf_value_and_grad = jax.jit(jax.value_and_grad(functools.partial(transformer_loss, config=TF)))
mlp_loss_sum = jax.jit(functools.partial(residual_mlp_loss_sum, config=MLP))
mlp_value_and_grad = jax.jit(jax.value_and_grad(functools.partial(residual_mlp_loss, config=MLP)))


def perturbed(params, seed, std=0.3):
    """Parameters far from init, so attention is not uniform and every path matters.

    NumPy noise: a jax.random draw per leaf shape would compile a sampler per shape.
    """
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: jnp.asarray(p + std * rng.standard_normal(p.shape), jnp.float32), params)


def make_batch(seed, batch, seq_len):
    tokens = np.random.default_rng(seed).integers(0, 256, size=(batch, seq_len + 1), dtype=np.int32)
    return {"tokens": jnp.asarray(tokens)}


@pytest.fixture(scope="module")
def tf_params():
    return perturbed(init_transformer(jax.random.key(0), TF), 1)


@pytest.fixture(scope="module")
def mlp_params():
    return perturbed(init_residual_mlp(jax.random.key(0), MLP), 1)


@pytest.fixture(scope="module")
def batch():
    assert TF.seq_len == MLP.seq_len
    return make_batch(2, 3, TF.seq_len)


# ---------------------------------------------------------------- float64 NumPy references
def np_layer_norm(x, s, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * s + b


def np_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def np_nll(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    return lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]


def np_transformer_logits(params, tokens, c):
    """Unflattened einsums over (B, T, d), one layer at a time, in float64."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    b_, t = tokens.shape
    hd = c.d_model // c.n_heads
    x = p["embed"][tokens] + p["pos"][:t]
    for i in range(c.n_layers):
        q = {k: v[i] for k, v in p["blocks"].items()}
        h = np_layer_norm(x, q["ln1_scale"], q["ln1_bias"])
        qkv = np.einsum("btd,de->bte", h, q["qkv_w"]) + q["qkv_b"]
        # Head-major columns: (head, q|k|v, head_dim), so tensor-parallel blocks hold whole heads.
        qkv = qkv.reshape(b_, t, c.n_heads, 3, hd)
        qh, kh, vh = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        scores = np.einsum("bqhd,bkhd->bhqk", qh, kh) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        ctx = np.einsum("bhqk,bkhd->bqhd", np_softmax(scores), vh).reshape(b_, t, c.d_model)
        x = x + np.einsum("btd,de->bte", ctx, q["proj_w"]) + q["proj_b"]
        h = np_gelu(np.einsum("btd,df->btf", np_layer_norm(x, q["ln2_scale"], q["ln2_bias"]), q["fc_w"]) + q["fc_b"])
        x = x + np.einsum("btf,fd->btd", h, q["out_w"]) + q["out_b"]
    x = np_layer_norm(x, p["ln_f_scale"], p["ln_f_bias"])
    return np.einsum("btd,vd->btv", x, p["embed"])


def np_mlp_nll(params, tokens):
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x = p["embed"][tokens[:, :-1]]
    for i in range(p["blocks"]["w1"].shape[0]):
        q = {k: v[i] for k, v in p["blocks"].items()}
        x = x + np.tanh(x @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"]
    return np_nll(x @ p["head_w"] + p["head_b"], tokens[:, 1:])


# ---------------------------------------------------------------- configs and init
@pytest.mark.parametrize("field", ["vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_transformer_config_rejects_non_positive_int(field, bad):
    with pytest.raises(ValueError, match=f"TransformerConfig.{field} must be a positive int"):
        dataclasses.replace(TF, **{field: bad})


def test_transformer_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="d_model=10 must be divisible by n_heads=4"):
        TransformerConfig(d_model=10, n_heads=4)


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "d_hidden", "n_layers", "seq_len"])
def test_mlp_config_rejects_non_positive_int(field):
    with pytest.raises(ValueError, match=f"MLPConfig.{field} must be a positive int"):
        dataclasses.replace(MLP, **{field: 0})


def test_transformer_init_shapes_dtypes_and_scales():
    c = TransformerConfig(d_model=64, n_layers=3, n_heads=4, d_ff=96, seq_len=8)
    params = init_transformer(jax.random.key(0), c)
    n, d, f = 3, 64, 96
    expected = {
        "ln1_scale": (n, d), "ln1_bias": (n, d), "qkv_w": (n, d, 3 * d), "qkv_b": (n, 3 * d),
        "proj_w": (n, d, d), "proj_b": (n, d), "ln2_scale": (n, d), "ln2_bias": (n, d),
        "fc_w": (n, d, f), "fc_b": (n, f), "out_w": (n, f, d), "out_b": (n, d),
    }  # fmt: skip
    assert {k: v.shape for k, v in params["blocks"].items()} == expected
    assert params["embed"].shape == (256, d) and params["pos"].shape == (8, d)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    blocks = params["blocks"]
    for name in ("qkv_b", "proj_b", "fc_b", "out_b", "ln1_bias", "ln2_bias"):
        assert not np.any(blocks[name])
    assert np.all(blocks["ln1_scale"] == 1) and np.all(params["ln_f_scale"] == 1)
    # Sample standard deviations: 20k+ draws each, so 5% is many standard errors away.
    np.testing.assert_allclose(np.std(blocks["qkv_w"]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(params["embed"]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(blocks["out_w"]), 0.02 / math.sqrt(2 * n), rtol=0.05)
    np.testing.assert_allclose(np.std(blocks["proj_w"]), 0.02 / math.sqrt(2 * n), rtol=0.05)
    expected_count = 256 * d + 8 * d + 2 * d + n * (4 * d + 4 * d * d + 4 * d + 2 * d * f + f + d)
    assert count_params(params) == expected_count


def test_residual_mlp_init_shapes():
    params = init_residual_mlp(jax.random.key(0), MLP)
    assert {k: v.shape for k, v in params["blocks"].items()} == {
        "w1": (2, 16, 32), "b1": (2, 32), "w2": (2, 32, 16), "b2": (2, 16),
    }  # fmt: skip
    assert params["embed"].shape == (256, 16) and params["head_w"].shape == (16, 256)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize(
    ("init", "config", "value_and_grad"),
    [(init_transformer, TF, tf_value_and_grad), (init_residual_mlp, MLP, mlp_value_and_grad)],
    ids=["transformer", "mlp"],
)
def test_loss_at_init_is_near_uniform(init, config, value_and_grad, batch):
    loss, _ = value_and_grad(init(jax.random.key(0), config), batch)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert abs(float(loss) - LN256) < 0.1


# ---------------------------------------------------------------- values against references
def test_transformer_matches_float64_unflattened_reference(tf_params, batch):
    tokens = np.asarray(batch["tokens"])
    ref_logits = np_transformer_logits(tf_params, tokens[:, :-1], TF)
    np.testing.assert_allclose(tf_logits(tf_params, tokens[:, :-1]), ref_logits, rtol=2e-5, atol=2e-5)
    ref_nll = np_nll(ref_logits, tokens[:, 1:])
    assert np.std(ref_nll) > 0.1  # perturbed params: a real, non-uniform model
    total, count = tf_loss_sum(tf_params, batch)
    np.testing.assert_allclose(total, ref_nll.sum(), rtol=1e-5)
    assert float(count) == tokens[:, 1:].size and count.dtype == jnp.float32
    # transformer_loss is the mean of the same sum.
    np.testing.assert_allclose(tf_value_and_grad(tf_params, batch)[0], ref_nll.mean(), rtol=1e-5)


def test_loss_sum_with_mask_weights_tokens(tf_params, mlp_params, batch):
    tokens = np.asarray(batch["tokens"])
    mask = np.random.default_rng(0).integers(0, 2, size=(3, TF.seq_len)).astype(np.float32)
    ref_tf = np_nll(np_transformer_logits(tf_params, tokens[:, :-1], TF), tokens[:, 1:])
    total, count = tf_loss_sum(tf_params, {**batch, "mask": mask})
    np.testing.assert_allclose(total, (ref_tf * mask).sum(), rtol=1e-5)
    assert float(count) == mask.sum()
    ref_mlp = np_mlp_nll(mlp_params, tokens)
    total, count = mlp_loss_sum(mlp_params, {**batch, "mask": mask})
    np.testing.assert_allclose(total, (ref_mlp * mask).sum(), rtol=1e-5)
    assert float(count) == mask.sum()
    np.testing.assert_allclose(mlp_value_and_grad(mlp_params, batch)[0], ref_mlp.mean(), rtol=1e-5)


def test_residual_block_reproduces_seed_example():
    """The seed's worked example: MSE of the block output, its loss and gradients."""
    params = {
        "w1": jnp.array([[0.5, -0.3, 0.8], [0.1, 0.4, -0.6]]), "b1": jnp.array([0.0, 0.1, -0.1]),
        "w2": jnp.array([[0.2, -0.5], [0.7, 0.3], [-0.4, 0.6]]), "b2": jnp.array([0.05, -0.05]),
    }  # fmt: skip
    x, y = jnp.array([[1.0, -2.0]]), jnp.array([[0.5, -1.0]])
    block = remat(residual_block, "dots")
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((block(x, p) - y) ** 2))(params)
    np.testing.assert_allclose(loss, 0.408815, atol=1e-6)
    np.testing.assert_allclose(
        grads["w1"], [[0.332859, -0.197498, -0.033156], [-0.665719, 0.394996, 0.066313]], atol=1e-6
    )
    np.testing.assert_allclose(
        grads["w2"], [[-0.089534, -0.24773], [0.234075, 0.647654], [-0.293898, -0.813177]], atol=1e-6
    )
    np.testing.assert_allclose(grads["b2"], [-0.307348, -0.850392], atol=1e-6)


# ---------------------------------------------------------------- remat
@pytest.mark.parametrize(
    ("loss_fn", "config", "value_and_grad", "params_fixture"),
    [
        (transformer_loss, TF, tf_value_and_grad, "tf_params"),
        (residual_mlp_loss, MLP, mlp_value_and_grad, "mlp_params"),
    ],
    ids=["transformer", "mlp"],
)
def test_remat_policies_give_the_unremated_gradients(loss_fn, config, value_and_grad, params_fixture, batch, request):
    params = request.getfixturevalue(params_fixture)

    @jax.jit
    def remat_grads(params, batch):
        return [
            jax.value_and_grad(functools.partial(loss_fn, config=config, remat_policy=policy))(params, batch)
            for policy in REMAT_POLICIES
        ]

    ref_loss, ref_grads = value_and_grad(params, batch)
    for policy, (loss, grads) in zip(REMAT_POLICIES, remat_grads(params, batch)):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=policy)
        for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=policy)


def test_blocks_tag_attn_out_and_mlp_hidden_for_save_policies(tf_params):
    layer = jax.tree_util.tree_map(lambda a: a[0], tf_params["blocks"])
    x = jnp.ones((2 * 4, TF.d_model))
    block = functools.partial(_block, batch=2, time=4, n_heads=TF.n_heads, fp8=None, attention="xla")
    saved = saved_residuals_report(remat(block, "save:attn_out,mlp_hidden"), x, layer)
    assert sorted(e.name for e in saved.of_kind("named")) == ["attn_out", "mlp_hidden"]
    assert saved.count("dot_general") == 0
    full = saved_residuals_report(remat(block, "full"), x, layer)
    assert full.activation_bytes == 0 < saved.activation_bytes


# ---------------------------------------------------------------- causality, dtype, errors
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(position=st.integers(0, TF.seq_len - 1), shift=st.integers(1, 255))
def test_logits_are_causal(tf_params, batch, position, shift):
    tokens = batch["tokens"][:, :-1]
    changed = tokens.at[:, position].set((tokens[:, position] + shift) % 256)
    before, after = tf_logits(tf_params, tokens), tf_logits(tf_params, changed)
    np.testing.assert_allclose(before[:, :position], after[:, :position], rtol=1e-6, atol=1e-6)
    assert np.all(np.max(np.abs(before[:, position:] - after[:, position:]), axis=-1) > 1e-4)


def test_bf16_compute_is_close_to_float32_and_grads_stay_float32(tf_params, batch):
    bf16_loss = functools.partial(transformer_loss, config=TF, compute_dtype=jnp.bfloat16)
    lossbf, gradsbf = jax.jit(jax.value_and_grad(bf16_loss))(tf_params, batch)
    loss32, grads32 = tf_value_and_grad(tf_params, batch)
    assert lossbf.dtype == jnp.float32 and float(lossbf) != float(loss32)  # really computed in bf16
    np.testing.assert_allclose(lossbf, loss32, rtol=2e-2)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(gradsbf))
    g, r = np.ravel(gradsbf["blocks"]["fc_w"]), np.ravel(grads32["blocks"]["fc_w"])
    assert g @ r / (np.linalg.norm(g) * np.linalg.norm(r)) > 0.95
    # compute_dtype=None computes in the dtype of the params given.
    bf16_params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tf_params)
    assert jax.eval_shape(tf_logits, bf16_params, batch["tokens"][:, :-1]).dtype == jnp.bfloat16
    assert jax.eval_shape(tf_logits, tf_params, batch["tokens"][:, :-1]).dtype == jnp.float32


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ({"tokens": jnp.zeros((2, 5))}, TypeError, "integer token ids"),
        ({"tokens": jnp.zeros((5,), jnp.int32)}, ValueError, r"shape \(B, T \+ 1\)"),
        ({"tokens": jnp.zeros((2, 1), jnp.int32)}, ValueError, r"T >= 1"),
        ({"tokens": jnp.zeros((2, 18), jnp.int32)}, ValueError, "T=17 .* seq_len=16"),
        ({"tokens": jnp.zeros((2, 5), jnp.int32), "mask": jnp.ones((2, 5))}, ValueError, r"mask.*\(2, 4\)"),
        ([1, 2], TypeError, "mapping"),
    ],
)
def test_transformer_loss_rejects_bad_batches(tf_params, batch, error, match):
    with pytest.raises(error, match=match):
        transformer_loss(tf_params, batch, config=TF)


# ---------------------------------------------------------------- registry, flops, training
def test_build_model_binds_config_and_validates():
    model = build_model("transformer", "tiny", n_layers=3)
    assert model.config.n_layers == 3 and model.seq_len == model.config.seq_len
    assert build_model("mlp").config == MLPConfig(d_model=128, d_hidden=512, n_layers=2, seq_len=128)
    assert model.flops_per_token == transformer_flops_per_token(model.config)
    for bound, fn in (
        (model.loss, transformer_loss),
        (model.loss_sum, transformer_loss_sum),
        (model.init, init_transformer),
    ):
        assert bound.func is fn and bound.keywords == {"config": model.config}
    mlp = build_model("mlp", "tiny")
    assert mlp.loss.func is residual_mlp_loss and mlp.loss.keywords == {"config": MLP}
    with pytest.raises(ValueError, match="unknown model name='gpt'"):
        build_model("gpt")
    with pytest.raises(ValueError, match="unknown model size='huge'"):
        build_model("mlp", "huge")
    with pytest.raises(TypeError, match=r"unknown TransformerConfig field\(s\) \['width'\]"):
        build_model("transformer", width=3)
    with pytest.raises(ValueError, match="n_heads"):
        build_model("transformer", n_heads=3)


def test_flops_per_token_counts_matmul_weights_and_attention():
    for c in (TransformerConfig(), TF):
        params = jax.eval_shape(functools.partial(init_transformer, config=c), jax.random.key(0))
        b = params["blocks"]
        n_matmul = sum(b[k].size for k in ("qkv_w", "proj_w", "fc_w", "out_w")) + params["embed"].size
        assert transformer_flops_per_token(c) == 6 * n_matmul + 12 * c.n_layers * c.seq_len * c.d_model
    p = jax.eval_shape(functools.partial(init_residual_mlp, config=MLP), jax.random.key(0))
    assert residual_mlp_flops_per_token(MLP) == 6 * (p["blocks"]["w1"].size + p["blocks"]["w2"].size + p["head_w"].size)


@pytest.mark.parametrize(
    ("init", "config", "value_and_grad"),
    [(init_transformer, TF, tf_value_and_grad), (init_residual_mlp, MLP, mlp_value_and_grad)],
    ids=["transformer", "mlp"],
)
def test_adam_steps_on_a_repeated_batch_reduce_the_loss(init, config, value_and_grad, batch):
    params = init(jax.random.key(0), config)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def apply_adam(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    losses = []
    for _ in range(15):
        loss, grads = value_and_grad(params, batch)
        params, opt_state = apply_adam(grads, opt_state, params)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0, losses


def test_unknown_remat_policy_is_rejected_at_trace_time(tf_params, batch):
    with pytest.raises(ValueError, match="unknown policy='bogus'"):
        jax.eval_shape(functools.partial(transformer_loss, config=TF, remat_policy="bogus"), tf_params, batch)


def test_a_bf16_embeddings_gradient_sums_its_rows_in_float32():
    # 4,096 tokens of one id: a bf16 scatter-add rounds each partial sum to 8 bits (17% off here on
    # CPU; 27% on an H200, found by `leanstep verify`); leanstep's gather sums in float32, rounds once.
    from leanstep.models.layers import embedding_lookup

    ids = jnp.zeros(4096, jnp.int32)
    g = jax.random.normal(jax.random.key(0), (4096, 4)).astype(jnp.bfloat16)
    table = jnp.ones((3, 4), jnp.bfloat16)
    grad = jax.grad(lambda t: (embedding_lookup(t, ids) * g).astype(jnp.float32).sum())(table)
    want = np.asarray(g, np.float64).sum(axis=0)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad[0], np.float64), want, rtol=2.0**-8)
    np.testing.assert_array_equal(np.asarray(grad[1:], np.float32), 0.0)


@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_an_eager_init_compiles_one_program_not_one_per_operation(model):
    # Eager, each operation would lower and compile a program of its own per shape (22 for this
    # transformer): the init is one jitted program. Counted as it is lowered, which a persistent
    # compilation cache does not skip.
    lowered = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kwargs)

    # Sizes no other test uses: a program lowered earlier in this process would not be lowered again.
    if model == "transformer":
        config = TransformerConfig(vocab_size=37, d_model=12, n_layers=3, n_heads=2, d_ff=20, seq_len=5)
        init = init_transformer
    else:
        config, init = MLPConfig(vocab_size=37, d_model=12, d_hidden=20, n_layers=3), init_residual_mlp
    key = jax.random.key(3)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        params = init(key, config)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(lowered) == 1, lowered
    eager = init.__wrapped__(key, config)  # the function itself, op by op: the same bits
    assert jax.tree.structure(eager) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype == jnp.float32 and np.array_equal(np.asarray(a), np.asarray(b))
