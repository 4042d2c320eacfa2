"""The seed's residual MLP block, stacked into a byte-level (bigram) language model.

Each byte is embedded on its own, passed through ``n_layers`` residual blocks

.. math:: x \\leftarrow x + \\tanh(x W_1 + b_1)\\, W_2 + b_2

and mapped to 256 logits for the next byte. With no context beyond the current byte it can
learn at best the bigram distribution, but it trains in seconds on the same data as the
transformer, which makes it a quick end-to-end check of the training step.
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

from leanstep.blocks.rematerialization import checkpoint_name, remat
from leanstep.models.layers import (
    cast_floating,
    check_positive_ints,
    dense,
    embedding_lookup,
    normal_arrays,
    split_tokens,
    token_nll,
    weighted_sum,
)
from leanstep.sharding.model_sharding import constrain, gathered

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of the residual-MLP byte model.

    Attributes:
      vocab_size: number of token ids (256 for bytes).
      d_model: embedding and residual width ``D``.
      d_hidden: hidden width ``H`` of each block.
      n_layers: number of residual blocks.
      seq_len: window length of the batches it is trained on (the model itself sees one byte).

    Raises:
      ValueError: a field is not a positive int.
    """

    vocab_size: int = 256
    d_model: int = 128
    d_hidden: int = 512
    n_layers: int = 2
    seq_len: int = 128

    def __post_init__(self) -> None:
        check_positive_ints("MLPConfig", **dataclasses.asdict(self))


@functools.partial(jax.jit, static_argnames="config")
def init_residual_mlp(key: jax.Array, config: MLPConfig) -> Params:
    r"""Float32 parameters; block weights stacked along a leading ``n_layers`` axis.

    The embedding is :math:`\mathcal{N}(0, 1)` so that the tanh inputs are of order one;
    ``w1`` is LeCun-normal (:math:`1/\sqrt{D}`), ``w2`` is :math:`1/\sqrt{2 L H}` so the residual
    stream keeps its scale with depth, the head is :math:`\mathcal{N}(0, 0.02^2)` (loss near
    :math:`\ln V` at init) and all biases are zero. Jitted (``config`` static): one compiled program,
    not one per operation and shape.

    Example:
      >>> params = init_residual_mlp(jax.random.key(0), MLPConfig(d_model=4, d_hidden=8, n_layers=3))
      >>> {k: v.shape for k, v in params["blocks"].items()}
      {'b1': (3, 8), 'b2': (3, 4), 'w1': (3, 4, 8), 'w2': (3, 8, 4)}
    """
    c = config
    n, d, h = c.n_layers, c.d_model, c.d_hidden
    w = normal_arrays(key, {
        "embed": ((c.vocab_size, d), 1.0), "w1": ((n, d, h), 1 / math.sqrt(d)),
        "w2": ((n, h, d), 1 / math.sqrt(2 * n * h)), "head_w": ((d, c.vocab_size), 0.02),
    })  # fmt: skip
    return {
        "embed": w["embed"],
        "blocks": {"w1": w["w1"], "b1": jnp.zeros((n, h)), "w2": w["w2"], "b2": jnp.zeros((n, d))},
        "head_w": w["head_w"],
        "head_b": jnp.zeros((c.vocab_size,)),
    }


#: Partition rules (:mod:`leanstep.sharding.partition_rules`): embedding and head split on the
#: vocabulary, the blocks' first matmul column parallel and the second row parallel.
MLP_RULES = (
    ("^embed$", ("fsdp", None)),
    ("^head_w$", (None, "fsdp")),
    ("^head_b$", ("fsdp",)),
    ("^blocks/w1$", (None, "fsdp", "tensor")),
    ("^blocks/b1$", (None, ("tensor", "fsdp"))),
    ("^blocks/w2$", (None, "tensor", "fsdp")),
    ("^blocks/", (None, "fsdp")),
)


def residual_block(x: jax.Array, p: Params) -> jax.Array:
    """The seed block ``x + tanh(x @ w1 + b1) @ w2 + b2`` for ``x`` of shape ``(N, D)``.

    Example:
      >>> p = {"w1": jnp.eye(2), "b1": jnp.zeros(2), "w2": jnp.eye(2), "b2": jnp.zeros(2)}
      >>> residual_block(jnp.array([[0.5, -0.5]]), p)
      Array([[ 0.9621172, -0.9621172]], dtype=float32)
    """
    hidden = checkpoint_name(jnp.tanh(dense(x, p["w1"], p["b1"])), "mlp_hidden")
    return x + dense(hidden, p["w2"], p["b2"])


def residual_mlp_loss_sum(
    params: Params,
    batch: Mapping[str, ArrayLike],
    *,
    config: MLPConfig,
    remat_policy: str | Callable[..., Any] = "none",
    compute_dtype: DTypeLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Summed next-byte cross-entropy and token count, as ``transformer_loss_sum``.

    Inputs ``tokens[:, :-1]`` are embedded to ``(B*T, D)``, run through the stacked blocks (each
    wrapped in ``remat(block, remat_policy, prevent_cse=False)``, under ``lax.scan``) and the
    head; the cross-entropy against ``tokens[:, 1:]`` is taken in float32. Batches may be any
    length ``T``: the model looks at one byte at a time.

    Raises:
      TypeError, ValueError: malformed ``batch``.
    Sharded (:class:`leanstep.step.ShardingLayer`), each block's parameters are gathered inside
    the rematerialized block (:func:`leanstep.sharding.gathered`) and the residual stream's rows stay
    on their devices (:func:`leanstep.sharding.constrain`).
    """
    inputs, targets = split_tokens(batch)
    params = cast_floating(params, compute_dtype)
    top = gathered({k: v for k, v in params.items() if k != "blocks"})
    x = constrain(embedding_lookup(top["embed"], inputs.reshape(-1)), "batch", None)

    def sharded_block(x: jax.Array, layer: Params) -> jax.Array:  # each layer gathered just before use
        return constrain(residual_block(x, gathered(layer, "blocks")), "batch", None)

    block = remat(sharded_block, remat_policy, prevent_cse=False)
    x, _ = jax.lax.scan(lambda carry, layer: (block(carry, layer), None), x, params["blocks"])
    logits = dense(x, top["head_w"], top["head_b"])
    nll = token_nll(logits, targets.reshape(-1))
    return weighted_sum(nll.reshape(targets.shape), batch)


def residual_mlp_loss(
    params: Params,
    batch: Mapping[str, ArrayLike],
    *,
    config: MLPConfig,
    remat_policy: str | Callable[..., Any] = "none",
    compute_dtype: DTypeLike | None = None,
) -> jax.Array:
    """Mean next-byte cross-entropy in nats (float32).

    Example:
      >>> config = MLPConfig(d_model=8, d_hidden=16, n_layers=2)
      >>> params = init_residual_mlp(jax.random.key(0), config)
      >>> batch = {"tokens": jnp.arange(10, dtype=jnp.int32).reshape(2, 5)}
      >>> loss = residual_mlp_loss(params, batch, config=config)
      >>> print(f"{float(loss):.1f}  ln(256)={math.log(256):.1f}")
      5.5  ln(256)=5.5
    """
    total, count = residual_mlp_loss_sum(
        params, batch, config=config, remat_policy=remat_policy, compute_dtype=compute_dtype
    )
    return total / jnp.maximum(count, 1e-9)


def residual_mlp_flops_per_token(config: MLPConfig) -> int:
    """Training FLOPs per token, ``6 * (2 L D H + D V)`` (matmul weights only; see the transformer)."""
    c = config
    return 6 * (2 * c.n_layers * c.d_model * c.d_hidden + c.d_model * c.vocab_size)
