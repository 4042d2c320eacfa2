"""The built-in transformer's attention (leanstep.models.attention): the TPU kernel against the
written-out product, the choice "auto" makes, and the names it refuses.

The splash kernel runs here in Pallas's interpreter (the same kernel program, executed op by op
on the CPU); on a TPU the last test compares the compiled kernel inside the whole model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leanstep.models import attention
from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss
from leanstep.sharding.model_sharding import sharding_context
from leanstep.sharding.partition_rules import MeshAxes


def _qkv(shape: tuple[int, ...], dtype=jnp.float32) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, shape, dtype) for key in keys)


def _float64_attention(q, k, v) -> np.ndarray:
    """softmax(q k^T / sqrt(d) + causal) v in float64 NumPy, (B, T, H, d) in and out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


def test_the_written_out_product_is_causal_softmax_attention():
    q, k, v = _qkv((2, 24, 3, 8))
    out = attention.causal_attention(q, k, v, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), _float64_attention(q, k, v), rtol=2e-5, atol=2e-6)


def test_the_splash_kernel_equals_the_written_out_product_and_its_gradients():
    q, k, v = _qkv((2, 256, 2, 128))
    written = attention._written_out(q, k, v)
    kernel = attention._splash(q, k, v, interpret=True)
    np.testing.assert_allclose(np.asarray(kernel), _float64_attention(q, k, v), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(written), rtol=1e-4, atol=1e-5)

    def grads(fn):
        return jax.grad(lambda *x: jnp.sum(jnp.sin(fn(*x))), argnums=(0, 1, 2))(q, k, v)

    for g_kernel, g_written in zip(
        grads(lambda *x: attention._splash(*x, interpret=True)), grads(attention._written_out), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g_kernel), np.asarray(g_written), rtol=1e-4, atol=2e-5)


def test_auto_takes_the_kernel_on_one_tpu_and_writes_the_product_out_elsewhere():
    assert attention.resolve_attention("auto", time=1024, head_dim=256, platform="tpu") == "splash"
    assert attention.resolve_attention("auto", time=1024, head_dim=256, platform="cpu") == "xla"
    assert attention.resolve_attention("auto", time=1000, head_dim=256, platform="tpu") == "xla"  # T % 128
    assert attention.resolve_attention("auto", time=1024, head_dim=64, platform="tpu") == "xla"  # a narrow head
    assert attention.resolve_attention("xla", time=1024, head_dim=256, platform="tpu") == "xla"
    on_this = "splash" if jax.default_backend() == "tpu" else "xla"
    assert attention.resolve_attention("auto", time=1024, head_dim=256) == on_this
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with sharding_context(MeshAxes(mesh, ("data",), None, None), {}, {}):  # a sharded step: XLA partitions it
        assert attention.resolve_attention("auto", time=1024, head_dim=256, platform="tpu") == "xla"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention": "flash"}, "TransformerConfig.attention must be one of ('auto', 'xla', 'splash'), got 'flash'"),
        ({"attention": "splash", "seq_len": 100}, "a multiple of 128"),
    ],
)
def test_bad_attention_is_refused_by_name(overrides, message):
    if jax.default_backend() != "tpu" and overrides["attention"] == "splash":
        message = "TransformerConfig.attention='splash' is a TPU kernel"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TransformerConfig(**overrides)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="the compiled splash kernel runs on a TPU only")
def test_on_a_tpu_the_model_with_splash_equals_the_model_written_out():
    sizes = {"d_model": 256, "n_layers": 2, "n_heads": 2, "d_ff": 512, "seq_len": 256}
    configs = {name: TransformerConfig(**sizes, attention=name) for name in ("xla", "splash")}
    params = init_transformer(jax.random.key(1), configs["xla"])
    tokens = jax.random.randint(jax.random.key(2), (2, 257), 0, 256)
    with jax.default_matmul_precision("highest"):
        values = {
            name: jax.value_and_grad(transformer_loss)(params, {"tokens": tokens}, config=config)
            for name, config in configs.items()
        }
    (loss_x, grad_x), (loss_s, grad_s) = values["xla"], values["splash"]
    np.testing.assert_allclose(float(loss_s), float(loss_x), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad_s), jax.tree.leaves(grad_x), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
