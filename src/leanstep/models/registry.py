"""Select a model by name and size preset, for the command line."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

from leanstep.blocks.layer_stack import LayerStack
from leanstep.models.residual_mlp import (
    MLP_RULES,
    MLPConfig,
    init_residual_mlp,
    residual_mlp_flops_per_token,
    residual_mlp_loss,
    residual_mlp_loss_sum,
)
from leanstep.models.transformer import (
    TRANSFORMER_RULES,
    TransformerConfig,
    init_transformer,
    transformer_flops_per_token,
    transformer_loss,
    transformer_loss_sum,
    transformer_stack,
)


class Model(NamedTuple):
    """A model bound to its config.

    Attributes:
      name: registry name (``"transformer"`` or ``"mlp"``).
      config: the frozen config dataclass.
      seq_len: ``T`` for batches of shape ``(B, T + 1)``.
      init: ``init(key) -> params`` (float32).
      loss: ``loss(params, batch, *, remat_policy="none", compute_dtype=None) -> scalar``, mean nats.
      loss_sum: same arguments, ``-> (loss_sum, count)`` for token-weighted accumulation.
      flops_per_token: analytic training FLOPs per predicted token.
      rules: its partition rules (:mod:`leanstep.sharding.partition_rules`) for sharded training.
      stack: ``stack(token_weighted=...)``, the loss as a :class:`leanstep.LayerStack` (for the update
        inside the backward pass), or None: the model has no such form.
    """

    name: str
    config: Any
    seq_len: int
    init: Callable[[jax.Array], Any]
    loss: Callable[..., jax.Array]
    loss_sum: Callable[..., tuple[jax.Array, jax.Array]]
    flops_per_token: int
    rules: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    stack: Callable[..., LayerStack] | None = None


#: ``name -> (config class, init, loss, loss_sum, flops_per_token, {preset: config fields})``.
#: "mini" transformer: 2 blocks, ~0.43 M params, the default of ``leanstep train`` (the best
#: held-out bits per byte in three minutes on 2 CPU cores of what the speedrun table of docs/speedrun-and-benchmarks.md tried);
#: "small": the same blocks, 4 of them, ~0.8 M params.
MODELS: Mapping[str, tuple[Any, ...]] = {
    "transformer": (
        TransformerConfig, init_transformer, transformer_loss, transformer_loss_sum,
        transformer_flops_per_token,
        {
            "tiny": dict(d_model=16, n_layers=2, n_heads=2, d_ff=32, seq_len=16),
            "mini": dict(d_model=128, n_layers=2, n_heads=4, d_ff=512, seq_len=32),
            "small": dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, seq_len=128),
        },
    ),
    "mlp": (
        MLPConfig, init_residual_mlp, residual_mlp_loss, residual_mlp_loss_sum,
        residual_mlp_flops_per_token,
        {
            "tiny": dict(d_model=16, d_hidden=32, n_layers=2, seq_len=16),
            "mini": dict(d_model=128, d_hidden=512, n_layers=2, seq_len=32),
            "small": dict(d_model=128, d_hidden=512, n_layers=2, seq_len=128),
        },
    ),
}  # fmt: skip


#: Partition rules of each model (:mod:`leanstep.sharding.partition_rules`).
RULES: Mapping[str, tuple[Any, ...]] = {"transformer": TRANSFORMER_RULES, "mlp": MLP_RULES}

#: The models whose loss has a :class:`leanstep.LayerStack` form: ``name -> stack(config, *, token_weighted)``.
STACKS: Mapping[str, Callable[..., LayerStack]] = {"transformer": transformer_stack}

#: Every size preset some model has, in the order of the first model's presets.
SIZES: tuple[str, ...] = tuple(dict.fromkeys(size for *_, presets in MODELS.values() for size in presets))


def build_model(name: str, size: str = "small", **overrides: Any) -> Model:
    """Builds a registered model from a size preset, with any config field overridden.

    Args:
      name: a key of :data:`MODELS`.
      size: a preset, ``"tiny"`` (tests) or ``"small"`` (default training run).
      **overrides: config fields, e.g. ``n_layers=6``, or ``fp8=leanstep.Fp8Recipe()`` (the transformer).

    Returns:
      A :class:`Model` whose ``init``/``loss``/``loss_sum`` have the config bound.

    Raises:
      ValueError: unknown ``name`` or ``size``, or an invalid config.
      TypeError: an override that is not a config field.

    Example:
      >>> model = build_model("transformer", "tiny", n_layers=3)
      >>> model.config
      TransformerConfig(vocab_size=256, d_model=16, n_layers=3, n_heads=2, d_ff=32, seq_len=16, attention='auto')
      >>> params = jax.eval_shape(model.init, jax.random.key(0))  # shapes only: nothing is computed
      >>> batch = {"tokens": jax.ShapeDtypeStruct((2, model.seq_len + 1), jax.numpy.int32)}
      >>> jax.eval_shape(lambda p, b: model.loss(p, b, remat_policy="dots"), params, batch).shape
      ()
    """
    if name not in MODELS:
        raise ValueError(f"unknown model name={name!r}; expected one of {sorted(MODELS)}")
    for recipe, what in (("fp8", "FP8"), ("int8", "int8")):
        if overrides.get(recipe) is not None and name != "transformer":
            raise ValueError(f"{what} matmuls are built into the transformer, not the {name!r} model")
    config_cls, init, loss, loss_sum, flops, presets = MODELS[name]
    if size not in presets:
        raise ValueError(f"unknown model size={size!r} for {name!r}; expected one of {sorted(presets)}")
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown {config_cls.__name__} field(s) {unknown}; expected some of {sorted(fields)}")
    config = config_cls(**{**presets[size], **overrides})
    return Model(
        name=name,
        config=config,
        seq_len=config.seq_len,
        init=functools.partial(init, config=config),
        loss=functools.partial(loss, config=config),
        loss_sum=functools.partial(loss_sum, config=config),
        flops_per_token=flops(config),
        rules=RULES[name],
        stack=functools.partial(STACKS[name], config) if name in STACKS else None,
    )
