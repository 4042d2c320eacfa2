"""A decoder-only, byte-level transformer language model in plain JAX.

Pre-norm GPT-2 blocks: LayerNorm (with bias), causal multi-head self-attention, LayerNorm, a
gelu MLP; learned positional embeddings; a final LayerNorm; and an output head tied to the
token embedding (``logits = h @ embed.T``). Per-layer parameters are stacked along a leading
``n_layers`` axis and the blocks run under ``jax.lax.scan``, so compile time does not grow with
depth, and every block is wrapped in ``leanstep.blocks.remat`` with the caller's policy.

With an FP8 recipe (``TransformerConfig(fp8=leanstep.Fp8Recipe(...))``) the four matmuls of
each block (QKV, attention output, MLP in and out) take FP8 operands
(:func:`leanstep.blocks.fp8_matmul`; delayed scaling keeps one :class:`leanstep.blocks.Fp8Meta` per matmul and
layer under ``params["blocks"]["fp8"]``); the attention score and value products and the tied
output head stay in the compute dtype, as Transformer Engine's recipes keep them. With an int8
recipe (``TransformerConfig(int8=Int8Recipe())``) the same four take int8 operands with dynamic
scales (:func:`leanstep.blocks.int8.int8_matmul`, no state); the rest stays in the compute dtype.

Size: the model is one unit (config, init, block, forward, loss and FLOP count share its shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.fp8_dot import Fp8Meta, fp8_matmul
from leanstep.blocks.fp8_state import split_fp8
from leanstep.blocks.int8 import Int8Recipe, int8_matmul, int8_remat_policy
from leanstep.blocks.layer_stack import LayerStack
from leanstep.blocks.rematerialization import checkpoint_name, remat
from leanstep.models.attention import causal_attention, check_attention
from leanstep.models.layers import (
    cast_floating,
    check_positive_ints,
    dense,
    embedding_lookup,
    layer_norm,
    normal_arrays,
    split_tokens,
    token_nll,
    weighted_sum,
)
from leanstep.sharding.model_sharding import constrain, gathered

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the byte-level transformer.

    Attributes:
      vocab_size: number of token ids (256 for bytes).
      d_model: width of the residual stream; divisible by ``n_heads``.
      n_layers: number of blocks.
      n_heads: attention heads per block.
      d_ff: hidden width of the MLP.
      seq_len: longest input the positional embedding covers (``T``; batches carry ``T + 1``).
      fp8: an :class:`leanstep.Fp8Recipe` for the blocks' four matmuls, or None (no FP8).
      int8: an :class:`leanstep.blocks.int8.Int8Recipe` for the same four matmuls, or None (no
        int8); not with ``fp8``.
      attention: ``"xla"`` (the scores written out; every platform and mesh), ``"splash"``
        (JAX's Pallas kernel for TPUs: one device, ``seq_len`` a multiple of 128), or ``"auto"``
        (``"splash"`` where it runs, else ``"xla"``); see :mod:`leanstep.models.attention`.

    Raises:
      ValueError: a size is not a positive int, or ``d_model % n_heads != 0``.
      TypeError: ``fp8`` is neither None nor an ``Fp8Recipe`` (``int8``: an ``Int8Recipe``).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128
    fp8: Fp8Recipe | None = dataclasses.field(default=None, repr=False)
    attention: str = "auto"
    int8: Int8Recipe | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        sizes = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("fp8", "int8", "attention")
        }
        check_positive_ints("TransformerConfig", **sizes)
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise TypeError(f"TransformerConfig.fp8 must be an Fp8Recipe or None, got {type(self.fp8).__name__}")
        if self.int8 is not None and not isinstance(self.int8, Int8Recipe):
            raise TypeError(f"TransformerConfig.int8 must be an Int8Recipe or None, got {type(self.int8).__name__}")
        if self.int8 is not None and self.fp8 is not None:
            raise ValueError("TransformerConfig: fp8 and int8 are two recipes for the same matmuls; give one")
        if self.d_model % self.n_heads:
            raise ValueError(f"TransformerConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        check_attention(self.attention, seq_len=self.seq_len)


@functools.partial(jax.jit, static_argnames="config")
def init_transformer(key: jax.Array, config: TransformerConfig) -> Params:
    r"""Float32 parameters with GPT-2 initialization.

    Weights are :math:`\mathcal{N}(0, 0.02^2)`; the two projections that write into the residual
    stream (``proj_w``, ``out_w``) use standard deviation :math:`0.02 / \sqrt{2 L}`; biases are
    zero and LayerNorm scales one. Block parameters under ``"blocks"`` have a leading ``n_layers``
    axis. Jitted (``config`` static): one compiled program, not one per operation and shape.

    Args:
      key: a PRNG key.
      config: the model sizes.

    Returns:
      ``{"embed": (V, d), "pos": (seq_len, d), "blocks": {...}, "ln_f_scale": (d,), "ln_f_bias": (d,)}``.

    Example:
      >>> config = TransformerConfig(d_model=8, n_layers=2, n_heads=2, d_ff=16, seq_len=4)
      >>> params = init_transformer(jax.random.key(0), config)
      >>> params["blocks"]["qkv_w"].shape, count_params(params)
      ((2, 8, 24), 3296)
    """
    c = config
    n, d, f = c.n_layers, c.d_model, c.d_ff
    residual_std = 0.02 / math.sqrt(2 * n)
    w = normal_arrays(key, {
        "embed": ((c.vocab_size, d), 0.02), "pos": ((c.seq_len, d), 0.02),
        "qkv_w": ((n, d, 3 * d), 0.02), "proj_w": ((n, d, d), residual_std),
        "fc_w": ((n, d, f), 0.02), "out_w": ((n, f, d), residual_std),
    })  # fmt: skip
    zeros, ones = jnp.zeros, jnp.ones
    blocks: dict[str, Any] = {
        "ln1_scale": ones((n, d)), "ln1_bias": zeros((n, d)),
        "qkv_w": w["qkv_w"], "qkv_b": zeros((n, 3 * d)),
        "proj_w": w["proj_w"], "proj_b": zeros((n, d)),
        "ln2_scale": ones((n, d)), "ln2_bias": zeros((n, d)),
        "fc_w": w["fc_w"], "fc_b": zeros((n, f)),
        "out_w": w["out_w"], "out_b": zeros((n, d)),
    }  # fmt: skip
    if c.fp8 is not None and c.fp8.delayed:  # one meta per FP8 matmul and layer
        blocks["fp8"] = {name: Fp8Meta.create(c.fp8, stack=n) for name in FP8_MATMULS}
    return {
        "embed": w["embed"],
        "pos": w["pos"],
        "blocks": blocks,
        "ln_f_scale": ones((d,)),
        "ln_f_bias": zeros((d,)),
    }


#: The matmuls of a block that take FP8 operands under an FP8 recipe: ``{name}_w`` and ``{name}_b``.
FP8_MATMULS = ("qkv", "proj", "fc", "out")


def _dense(h: jax.Array, p: Params, name: str, fp8: Fp8Recipe | Int8Recipe | None) -> jax.Array:
    """The block's matmul ``name``: ``h @ w + b``, with FP8 or int8 operands under a recipe."""
    if fp8 is None:
        return dense(h, p[f"{name}_w"], p[f"{name}_b"])
    if isinstance(fp8, Int8Recipe):
        return int8_matmul(h, p[f"{name}_w"], fp8) + p[f"{name}_b"][None, :]
    meta = p["fp8"][name] if fp8.delayed else None
    return fp8_matmul(h, p[f"{name}_w"], meta, fp8) + p[f"{name}_b"][None, :]


#: The order of the QKV weights' columns, recorded in a run's config.json: (head, q|k|v, head_dim).
QKV_LAYOUT = "head-major"

#: Partition rules (:mod:`leanstep.sharding.partition_rules`): embeddings split on the vocabulary, the
#: QKV and MLP input matmuls column parallel, their output matmuls row parallel (Megatron), the
#: model dimension of everything over the FSDP axis.
TRANSFORMER_RULES = (
    ("^embed$", ("fsdp", None)),
    ("^pos$", (None, "fsdp")),
    ("^blocks/(qkv_w|fc_w)$", (None, "fsdp", "tensor")),
    ("^blocks/(qkv_b|fc_b)$", (None, ("tensor", "fsdp"))),
    ("^blocks/(proj_w|out_w)$", (None, "tensor", "fsdp")),
    ("^blocks/", (None, "fsdp")),
    ("^ln_f_", ("fsdp",)),
)


def _attention(
    h: jax.Array, p: Params, *, batch: int, time: int, n_heads: int, fp8: Fp8Recipe | Int8Recipe | None, attention: str
) -> jax.Array:
    """Causal multi-head self-attention on flattened ``h`` of shape ``(batch * time, d)``.

    The QKV columns are head-major, ``(head, q|k|v, head_dim)``, so a tensor-parallel split
    of them in contiguous blocks gives each device whole heads.
    """
    d = h.shape[-1]
    qkv = constrain(_dense(h, p, "qkv", fp8), "batch", "tensor")
    qkv = qkv.reshape(batch, time, n_heads, 3, d // n_heads)
    context = causal_attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2], implementation=attention)
    context = checkpoint_name(constrain(context.reshape(batch * time, d), "batch", "tensor"), "attn_out")
    return constrain(_dense(context, p, "proj", fp8), "batch", None)


def _block(
    x: jax.Array, p: Params, *, batch: int, time: int, n_heads: int, fp8: Fp8Recipe | Int8Recipe | None, attention: str
) -> jax.Array:
    """One pre-norm block on the flattened residual stream ``x`` of shape ``(batch * time, d)``.

    Sharded, its parameters are gathered here, inside the rematerialized block, so the
    gathered copy is recomputed for the backward pass rather than saved.
    """
    p = gathered(p, "blocks")
    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    x = x + _attention(h, p, batch=batch, time=time, n_heads=n_heads, fp8=fp8, attention=attention)
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    hidden = constrain(jax.nn.gelu(_dense(h, p, "fc", fp8)), "batch", "tensor")
    hidden = checkpoint_name(hidden, "mlp_hidden")
    return constrain(x + _dense(hidden, p, "out", fp8), "batch", None)


def transformer_logits(
    params: Params,
    tokens: ArrayLike,
    *,
    config: TransformerConfig,
    remat_policy: str | Callable[..., Any] = "none",
    compute_dtype: DTypeLike | None = None,
) -> jax.Array:
    """Next-token logits for every position of ``tokens`` of shape ``(B, T)``.

    Computation runs in ``compute_dtype`` (or in the dtype of ``params`` when ``None``); norm
    statistics and the attention softmax run in float32. Token ids outside ``[0, vocab_size)``
    are clamped by the embedding gather, since traced values cannot raise.

    Args:
      params: from :func:`init_transformer`, in any float dtype.
      tokens: integer ids of shape ``(B, T)`` with ``T <= config.seq_len``.
      config: the model sizes.
      remat_policy: a policy accepted by ``leanstep.blocks.remat`` for each block.
      compute_dtype: dtype to cast floating params to, or ``None``.

    Returns:
      Logits of shape ``(B, T, vocab_size)`` in the compute dtype; position ``t`` depends only on
      ``tokens[:, :t + 1]``.

    Raises:
      ValueError: ``tokens`` is not 2-D or ``T > config.seq_len``.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] > config.seq_len:
        raise ValueError(
            f"tokens must have shape (B, T) with 1 <= T <= seq_len={config.seq_len}; got shape {tokens.shape}"
        )
    params = cast_floating(params, compute_dtype)
    top = gathered({k: v for k, v in params.items() if k != "blocks"})
    batch, time = tokens.shape
    x = embedding_lookup(top["embed"], tokens) + top["pos"][None, :time]
    x = constrain(x.reshape(batch * time, config.d_model), "batch", None)
    # an int8 model saves its dequantized products, not their int32 sums (int8_remat_policy)
    policy = remat_policy if config.int8 is None else int8_remat_policy(remat_policy)
    block = remat(
        functools.partial(
            _block,
            batch=batch,
            time=time,
            n_heads=config.n_heads,
            fp8=config.fp8 or config.int8,  # the low-precision recipe of the four matmuls, if any
            attention=config.attention,
        ),
        "none" if policy is None else policy,
        prevent_cse=False,
    )
    x, _ = jax.lax.scan(lambda carry, layer: (block(carry, layer), None), x, params["blocks"])
    x = layer_norm(x, top["ln_f_scale"], top["ln_f_bias"])
    logits = x @ top["embed"].T
    return logits.reshape(batch, time, config.vocab_size)


def transformer_loss_sum(
    params: Params,
    batch: Mapping[str, ArrayLike],
    *,
    config: TransformerConfig,
    remat_policy: str | Callable[..., Any] = "none",
    compute_dtype: DTypeLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Summed next-token cross-entropy and the token count, for token-weighted averaging.

    .. math:: \mathrm{loss\_sum} = \sum_{b,t} m_{bt}\,\big(\mathrm{logsumexp}(z_{bt}) - z_{bt,y_{bt}}\big),
              \qquad \mathrm{count} = \sum_{b,t} m_{bt}

    with inputs ``tokens[:, :-1]``, targets ``y = tokens[:, 1:]`` and weights ``m = batch["mask"]``
    (shape ``(B, T)``; all ones when absent). Both results are float32 scalars.

    Args:
      params: from :func:`init_transformer`.
      batch: ``{"tokens": int (B, T + 1)}``, optionally with ``"mask"``.
      config: as in :func:`transformer_logits`.
      remat_policy: as in :func:`transformer_logits`.
      compute_dtype: as in :func:`transformer_logits`.

    Returns:
      ``(loss_sum, count)``.

    Raises:
      TypeError, ValueError: malformed ``batch`` (see ``layers.split_tokens``).
    """
    inputs, targets = split_tokens(batch, config.seq_len)
    logits = transformer_logits(params, inputs, config=config, remat_policy=remat_policy, compute_dtype=compute_dtype)
    nll = token_nll(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    return weighted_sum(nll.reshape(targets.shape), batch)


def transformer_loss(
    params: Params,
    batch: Mapping[str, ArrayLike],
    *,
    config: TransformerConfig,
    remat_policy: str | Callable[..., Any] = "none",
    compute_dtype: DTypeLike | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy in nats (float32): ``loss_sum / max(count, 1e-9)``.

    Example:
      >>> config = TransformerConfig(d_model=8, n_layers=2, n_heads=2, d_ff=16, seq_len=4)
      >>> params = init_transformer(jax.random.key(0), config)
      >>> batch = {"tokens": jnp.arange(10, dtype=jnp.int32).reshape(2, 5)}
      >>> loss = transformer_loss(params, batch, config=config)
      >>> print(f"{float(loss):.2f}  ln(256)={math.log(256):.2f}")
      5.55  ln(256)=5.55
    """
    total, count = transformer_loss_sum(
        params, batch, config=config, remat_policy=remat_policy, compute_dtype=compute_dtype
    )
    return total / jnp.maximum(count, 1e-9)


def transformer_stack(config: TransformerConfig, *, token_weighted: bool = True) -> LayerStack:
    """The model as a :class:`leanstep.LayerStack` (embedding, the blocks under ``"blocks"``, the
    tied head), for the update inside the backward pass; as a loss it is :func:`transformer_loss_sum`
    (``token_weighted``) or :func:`transformer_loss`, with no remat (the layerwise step recomputes
    each block in its backward pass). No FP8 recipe (its metas are state under the blocks).

    Example:
      >>> config = TransformerConfig(d_model=8, n_layers=2, n_heads=2, d_ff=16, seq_len=4)
      >>> params = init_transformer(jax.random.key(0), config)
      >>> batch = {"tokens": jnp.arange(10, dtype=jnp.int32).reshape(2, 5)}
      >>> float(transformer_stack(config, token_weighted=False)(params, batch)) == float(transformer_loss(params, batch, config=config))
      True
    """
    if config.fp8 is not None:
        raise ValueError("transformer_stack: an FP8 recipe keeps state under the blocks; use the standard step")

    def embed(top: Params, batch: Mapping[str, ArrayLike]) -> jax.Array:
        inputs, _ = split_tokens(batch, config.seq_len)
        return embedding_lookup(top["embed"], inputs) + top["pos"][None, : inputs.shape[1]]

    def layer(p: Params, x: jax.Array) -> jax.Array:
        batch, time, d = x.shape
        out = _block(x.reshape(batch * time, d), p, batch=batch, time=time, n_heads=config.n_heads,
                     fp8=config.int8, attention=config.attention)  # fmt: skip
        return out.reshape(batch, time, d)

    def head(top: Params, x: jax.Array, batch: Mapping[str, ArrayLike]) -> Any:
        _, targets = split_tokens(batch, config.seq_len)
        x = x.reshape(-1, config.d_model)
        logits = layer_norm(x, top["ln_f_scale"], top["ln_f_bias"]) @ top["embed"].T
        total = weighted_sum(
            token_nll(logits.reshape(-1, config.vocab_size), targets.reshape(-1)).reshape(targets.shape), batch
        )
        return total if token_weighted else total[0] / jnp.maximum(total[1], 1e-9)

    return LayerStack(embed, layer, head, "blocks")


def count_params(params: Any) -> int:
    """Total number of scalars in a parameter tree (its FP8 state, scales and histories, left out)."""
    return sum(int(leaf.size) for leaf in jax.tree_util.tree_leaves(split_fp8(params)[0]))


def transformer_flops_per_token(config: TransformerConfig) -> int:
    r"""Analytic training FLOPs (forward + backward) per predicted token.

    .. math:: C = 6 N + 12\, L\, T\, d, \qquad N = L\,(4 d^2 + 2 d\, d_{ff}) + V d

    (the PaLM estimate). ``N`` counts the weights that take part in matmuls: per block the QKV
    (``3d^2``), output projection (``d^2``) and the MLP (``2 d d_ff``), plus the tied head
    (``V d``); the embedding and positional lookups, biases and norms are left out. A matmul
    weight costs 2 FLOPs per token forward and 4 backward, hence ``6N``. Attention scores
    ``QK^T`` and ``PV`` cost ``2 T d`` each per token and layer forward, tripled for backward:
    ``12 L T d``, with ``T = seq_len`` because the causal mask is applied to the full ``T x T``
    product that is actually computed.

    Example:
      >>> transformer_flops_per_token(TransformerConfig())
      5701632
    """
    c = config
    n = c.n_layers * (4 * c.d_model**2 + 2 * c.d_model * c.d_ff) + c.vocab_size * c.d_model
    return 6 * n + 12 * c.n_layers * c.seq_len * c.d_model
