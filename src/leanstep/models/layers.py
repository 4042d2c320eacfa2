"""Pieces shared by the byte-level language models: norms, dense layers and the loss.

Dense layers take activations already flattened to ``(tokens, features)``: on XLA:CPU the
gradient of ``(batch, time, d) @ (d, f)`` (a weight gradient contracting two axes) took about 2x
as long as the same product written as one 2-D matmul (30 ms vs 15 ms at 32x128x128 @ 128x512),
so the models keep the residual stream as ``(batch * time, d_model)`` and reshape only around
attention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from leanstep.blocks.fp8_state import is_fp8_state
from leanstep.common.checks import is_int
from leanstep.sharding.model_sharding import sharding_active


def cast_floating(params: Any, dtype: DTypeLike | None) -> Any:
    """Casts every floating leaf of ``params`` to ``dtype``; ``None`` leaves them as they are.

    Args:
      params: a pytree of arrays.
      dtype: the compute dtype, or ``None`` to compute in the dtype the caller gave.

    Returns:
      The same tree with floating leaves cast; integer leaves and FP8 state
      (:mod:`leanstep.blocks.fp8_state`: scales and amax histories stay float32) are untouched.

    Example:
      >>> tree = cast_floating({"w": jnp.ones(2), "i": jnp.arange(2)}, jnp.bfloat16)
      >>> tree["w"].dtype, tree["i"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    if dtype is None:
        return params

    def cast(leaf: jax.Array) -> jax.Array:
        if is_fp8_state(leaf):
            return leaf
        return leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree_util.tree_map(cast, params, is_leaf=is_fp8_state)


#: The most values one ``jax.random.normal`` draw of :func:`normal_arrays` holds: 1 GiB of float32.
#: Past it, each array is drawn alone, so a program that keeps only some arrays computes only
#: theirs (``TrainState.create_from`` making a large state in groups; int32 offsets past 2**31).
_MAX_DRAW = 2**28


def normal_arrays(key: jax.Array, specs: Mapping[str, tuple[tuple[int, ...], float]]) -> dict[str, jax.Array]:
    """Float32 normal draws ``{name: std * N(0, 1) of shape}`` for ``specs = {name: (shape, std)}``.

    All values come from ONE ``jax.random.normal`` call, sliced and reshaped: XLA:CPU compiles
    the threefry sampler once per distinct shape (about a second each), so six separate draws
    made model init ~6x slower to compile than one.

    Example:
      >>> arrays = normal_arrays(jax.random.key(0), {"w": ((2, 3), 0.02), "b": ((4,), 1.0)})
      >>> {name: a.shape for name, a in arrays.items()}
      {'w': (2, 3), 'b': (4,)}
    """
    sizes = [math.prod(shape) for shape, _ in specs.values()]
    if sum(sizes) > _MAX_DRAW:  # one draw per array
        keys = jax.random.split(key, len(specs))
        return {
            name: std * jax.random.normal(k, shape, jnp.float32) for k, (name, (shape, std)) in zip(keys, specs.items())
        }
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    arrays, start = {}, 0
    for (name, (shape, std)), size in zip(specs.items(), sizes):
        # A static slice: its bounds are HLO attributes, not int32 arguments.
        arrays[name] = std * jax.lax.slice(flat, (start,), (start + size,)).reshape(shape)
        start += size
    return arrays


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    r"""Layer normalization over the last axis of a 2-D ``x``, statistics in float32.

    .. math:: y = \frac{x - \mathrm{mean}(x)}{\sqrt{\mathrm{var}(x) + \epsilon}} \cdot s + b

    Mean and variance of bf16 activations lose most of their digits in bf16, so they are taken
    in float32 and the result is cast back to ``x.dtype``.

    Example:
      >>> layer_norm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2))
      Array([[-0.999995,  0.999995]], dtype=float32)
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    y = y * scale.astype(jnp.float32)[None, :] + bias.astype(jnp.float32)[None, :]
    return y.astype(x.dtype)


def dense(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """``x @ w + b`` for a 2-D ``x`` of shape ``(tokens, d_in)`` (one 2-D matmul on purpose).

    Example:
      >>> dense(jnp.ones((1, 2)), jnp.ones((2, 3)), jnp.arange(3.0))
      Array([[2., 3., 4.]], dtype=float32)
    """
    return x @ w + b[None, :]


@jax.custom_vjp
def _gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0)


def _gather_rows_fwd(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return jnp.take(table, ids, axis=0), (table, ids)  # the table is the parameter: kept anyway


def _gather_rows_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, None]:
    table, ids = res
    summed = jnp.zeros(table.shape, jnp.float32).at[ids].add(g.astype(jnp.float32), mode="drop")
    return summed.astype(table.dtype), None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ``table[ids]``; sharded (:func:`leanstep.sharding.sharding_context`), a one-hot matmul.

    The gradient of a gather is a scatter-add, which XLA's SPMD partitioner serves by
    gathering every device's token ids and activations (batch rows); the gradient of a
    one-hot matmul is a matmul over the rows, reduced like any weight gradient. One device
    keeps the cheaper gather, whose scatter-add sums in float32 and rounds once to the
    table's dtype: a bf16 table's row can take thousands of tokens' gradients, and a GPU
    adds them in bf16 otherwise (``leanstep verify`` on an H200 found a 27% error).

    Example:
      >>> embedding_lookup(jnp.arange(6.0).reshape(3, 2), jnp.array([2, 0]))
      Array([[4., 5.],
             [0., 1.]], dtype=float32)
    """
    if not sharding_active():
        return _gather_rows(table, ids)
    return jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype) @ table


def split_tokens(batch: Mapping[str, ArrayLike], max_len: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Validates ``batch["tokens"]`` of shape ``(B, T + 1)`` and returns ``(inputs, targets)``.

    Raises:
      TypeError: ``batch`` is not a mapping with integer ``"tokens"``.
      ValueError: ``tokens`` is not 2-D with at least two columns, ``T`` exceeds ``max_len``, or
        ``batch["mask"]`` is present without the targets' shape ``(B, T)``.
    """
    if not isinstance(batch, Mapping) or "tokens" not in batch:
        raise TypeError(
            f"batch must be a mapping with a 'tokens' entry of shape (B, T + 1); got {type(batch).__name__}"
        )
    tokens = jnp.asarray(batch["tokens"])
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"batch['tokens'] must hold integer token ids; got dtype {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"batch['tokens'] must have shape (B, T + 1) with T >= 1; got shape {tokens.shape}")
    if max_len is not None and tokens.shape[1] - 1 > max_len:
        raise ValueError(
            f"batch['tokens'] has T={tokens.shape[1] - 1} positions to predict, more than the model's "
            f"seq_len={max_len}; pass at most seq_len + 1 tokens per row"
        )
    targets_shape = (tokens.shape[0], tokens.shape[1] - 1)
    if "mask" in batch and jnp.shape(batch["mask"]) != targets_shape:
        raise ValueError(
            f"batch['mask'] must have the targets' shape {targets_shape}; got shape {jnp.shape(batch['mask'])}"
        )
    return tokens[:, :-1], tokens[:, 1:]


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    r"""Per-token negative log-likelihood in float32: :math:`\mathrm{logsumexp}(z) - z_y`.

    ``logits`` of shape ``(N, V)`` in any float dtype are upcast first, so the logsumexp runs in
    float32 even when the model computes in bf16.

    Example:
      >>> token_nll(jnp.zeros((1, 4)), jnp.array([2]))  # ln 4
      Array([1.3862944], dtype=float32)
    """
    logits = logits.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def weighted_sum(nll: jax.Array, batch: Mapping[str, ArrayLike]) -> tuple[jax.Array, jax.Array]:
    """Sums per-token losses ``nll`` of shape ``(B, T)``, weighted by an optional ``batch["mask"]``.

    Returns ``(loss_sum, count)`` in float32, where ``count`` is ``B * T`` without a mask and the
    sum of the mask weights with one, so microbatches combine as ``sum(loss_sum) / sum(count)``.
    The mask's shape is checked by :func:`split_tokens`, before any computation.
    """
    mask = batch.get("mask")
    if mask is None:
        return jnp.sum(nll), jnp.asarray(nll.size, jnp.float32)
    mask = jnp.asarray(mask).astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def check_positive_ints(owner: str, **fields: Any) -> None:
    """Raises ``ValueError`` naming the first field that is not a positive ``int``."""
    for name, value in fields.items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int; got {value!r}")
