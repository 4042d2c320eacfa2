"""Byte-level language models in plain JAX: a GPT-2 style transformer and a residual MLP."""

from leanstep.models.registry import MODELS, SIZES, Model, build_model
from leanstep.models.residual_mlp import (
    MLP_RULES,
    MLPConfig,
    init_residual_mlp,
    residual_block,
    residual_mlp_flops_per_token,
    residual_mlp_loss,
    residual_mlp_loss_sum,
)
from leanstep.models.transformer import (
    TRANSFORMER_RULES,
    TransformerConfig,
    count_params,
    init_transformer,
    transformer_flops_per_token,
    transformer_logits,
    transformer_loss,
    transformer_loss_sum,
    transformer_stack,
)

__all__ = [
    "MLP_RULES",
    "MODELS",
    "SIZES",
    "TRANSFORMER_RULES",
    "MLPConfig",
    "Model",
    "TransformerConfig",
    "build_model",
    "count_params",
    "init_residual_mlp",
    "init_transformer",
    "residual_block",
    "residual_mlp_flops_per_token",
    "residual_mlp_loss",
    "residual_mlp_loss_sum",
    "transformer_flops_per_token",
    "transformer_logits",
    "transformer_loss",
    "transformer_loss_sum",
    "transformer_stack",
]
