"""The same train step in PyTorch, written the way a PyTorch user would (CPU build).

The model is leanstep's byte-level transformer (``leanstep.models.transformer``) as an
``nn.Module``: pre-norm GPT-2 blocks with LayerNorm (bias, eps 1e-5), causal multi-head
attention through ``F.scaled_dot_product_attention``, a tanh-approximated gelu MLP (``jax.nn.gelu``'s
default), learned positions, a final LayerNorm and a head tied to the token embedding;
GPT-2 initialization (``N(0, 0.02)``, the two residual projections ``0.02 / sqrt(2 L)``,
zero biases). The step: ``torch.autocast("cpu", bfloat16)`` with a ``GradScaler`` for bf16
compute, ``torch.utils.checkpoint(use_reentrant=False)`` around each block, a loop over
microbatches accumulating ``.grad``, ``clip_grad_norm_`` and AdamW (fused when available).

torch is a benchmark-only extra: this module imports it lazily, and
:func:`torch_available` says whether it can.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["build_torch_model", "load_jax_params", "make_torch_step", "torch_available"]


def torch_available() -> bool:
    """Whether ``import torch`` would succeed (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def build_torch_model(config: Any, *, remat: bool = True, seed: int = 0) -> Any:
    """Builds the transformer of ``config`` (a ``TransformerConfig``) as a float32 ``nn.Module``.

    Args:
      config: sizes, as for leanstep's transformer.
      remat: run every block under ``torch.utils.checkpoint`` (``use_reentrant=False``),
        saving only block inputs (leanstep's ``"full"`` policy).
      seed: ``torch.manual_seed`` for the GPT-2 initialization.

    Returns:
      A module whose ``forward(tokens)`` takes int64 ``(B, T + 1)`` tokens and returns the
      mean next-token cross-entropy.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    d, heads = config.d_model, config.n_heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, config.d_ff), nn.Linear(config.d_ff, d)

        def forward(self, x: Any) -> Any:
            batch, time, _ = x.shape
            # leanstep's QKV columns are head-major, (head, q|k|v, head_dim): the same layout
            # here, so that leanstep's weights (load_jax_params) give leanstep's function.
            qkv = self.qkv(self.ln1(x)).view(batch, time, heads, 3, d // heads)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # (B, H, T, head_dim)
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(context.transpose(1, 2).reshape(batch, time, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(config.vocab_size, d)
            self.pos = nn.Parameter(torch.zeros(config.seq_len, d))
            self.blocks = nn.ModuleList(Block() for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(d, eps=1e-5)

        def forward(self, tokens: Any) -> Any:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            x = self.embed(inputs) + self.pos[: inputs.shape[1]]
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if remat else block(x)
            logits = F.linear(self.ln_f(x), self.embed.weight)  # tied head
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    torch.manual_seed(seed)
    model = Transformer()
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "ln" in name:
                param.fill_(1.0)
            elif name.endswith(("proj.weight", "out.weight")):
                param.normal_(0.0, residual_std)
            else:
                param.normal_(0.0, 0.02)
    return model


def load_jax_params(model: Any, params: Any) -> None:
    """Copies leanstep transformer params (stacked over layers) into ``model`` in place.

    JAX dense weights are ``(d_in, d_out)``; torch ``Linear`` weights are ``(d_out, d_in)``.
    """
    import torch

    def tensor(x: Any) -> Any:
        return torch.from_numpy(np.array(x, np.float32))

    blocks = params["blocks"]
    with torch.no_grad():
        model.embed.weight.copy_(tensor(params["embed"]))
        model.pos.copy_(tensor(params["pos"]))
        model.ln_f.weight.copy_(tensor(params["ln_f_scale"]))
        model.ln_f.bias.copy_(tensor(params["ln_f_bias"]))
        for i, block in enumerate(model.blocks):
            for norm in ("ln1", "ln2"):
                getattr(block, norm).weight.copy_(tensor(blocks[f"{norm}_scale"][i]))
                getattr(block, norm).bias.copy_(tensor(blocks[f"{norm}_bias"][i]))
            for dense in ("qkv", "proj", "fc", "out"):
                getattr(block, dense).weight.copy_(tensor(blocks[f"{dense}_w"][i]).T)
                getattr(block, dense).bias.copy_(tensor(blocks[f"{dense}_b"][i]))


def make_torch_step(
    model: Any,
    *,
    bfloat16: bool,
    num_microbatches: int,
    max_grad_norm: float = 1.0,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    initial_loss_scale: float = 2.0**15,
    compile: bool = False,
) -> tuple[Callable[[Any], float], dict[str, Any]]:
    """Builds ``step(tokens) -> loss``: one optimizer step over ``num_microbatches`` microbatches.

    Args:
      model: from :func:`build_torch_model`.
      bfloat16: compute under ``torch.autocast("cpu", bfloat16)`` with a ``GradScaler``.
      num_microbatches: equal chunks of the batch, each ``forward`` + ``backward``
        (gradients accumulate in the float32 ``.grad``).
      max_grad_norm: ``clip_grad_norm_`` threshold.
      lr, weight_decay: AdamW (betas 0.9, 0.95, like leanstep's trainer).
      initial_loss_scale: the GradScaler's starting scale (leanstep's default).
      compile: wrap the model in ``torch.compile``.

    Returns:
      ``(step, info)``; ``info`` says which optimizer variant and scaler were used.
    """
    import torch

    info: dict[str, Any] = {"compiled": compile}
    try:
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True
        )
        info["adamw"] = "fused"
    except (RuntimeError, TypeError, ValueError):
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=True
        )
        info["adamw"] = "foreach"
    scaler = torch.amp.GradScaler("cpu", init_scale=initial_loss_scale) if bfloat16 else None
    info["grad_scaler"] = scaler is not None
    forward = torch.compile(model) if compile else model
    params = list(model.parameters())

    def step(tokens: Any) -> float:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for microbatch in tokens.chunk(num_microbatches):
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=bfloat16):
                loss = forward(microbatch) / num_microbatches
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return float(total)

    return step, info
