"""Flags shared by ``leanstep train``, ``plan`` and ``audit``."""

from __future__ import annotations

import argparse
from typing import Any


def grad_norm(text: str) -> float | None:
    """``--max-grad-norm``: a number, or "none"/"off" for no clipping."""
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'none', got {text!r}") from None


def remat_help() -> str:
    """``--remat``'s help, from the library's policy names."""
    from leanstep.blocks.rematerialization import REMAT_POLICIES

    return ", ".join(REMAT_POLICIES) + " or save:NAME,..."


def add_compile_cache_flag(p: argparse.ArgumentParser) -> None:
    """``--no-compile-cache``: the commands that compile keep XLA's programs in a per-user folder."""
    from leanstep.compilation.cache import ENV

    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not keep or reuse compiled XLA programs in the per-user cache folder (on by default: "
        f"a second run with the same flags starts without compiling; {ENV}=off also turns it off, "
        f"{ENV}=DIR moves it)",
    )


def add_run_flags(p: argparse.ArgumentParser, d: Any) -> None:
    """The model and batch flags that train, plan and audit share, with ``d``'s defaults."""
    from leanstep.blocks.loss_scale_registry import LOSS_SCALES
    from leanstep.models import MODELS, SIZES

    model = p.add_argument_group("model and batch")
    model.add_argument("--model", choices=tuple(MODELS), default=d.model)
    model.add_argument("--size", choices=SIZES, default=d.size, help="size preset")
    model.add_argument("--d-model", type=int, help="override the preset's width")
    model.add_argument("--layers", dest="n_layers", type=int, help="override the preset's depth")
    model.add_argument("--heads", dest="n_heads", type=int, help="override the preset's attention heads")
    model.add_argument("--d-ff", type=int, help="override the preset's MLP width")
    model.add_argument("--batch-size", type=int, default=d.batch_size)
    model.add_argument("--seq-len", type=int, default=d.seq_len)
    model.add_argument(
        "--precision",
        default=d.precision,
        help="jmp-style: params=...,compute=...,output=...[,strict]; 'auto': bfloat16 compute where XLA "
        "multiplies it on bfloat16 matrix units (GPUs from sm_80, AMD GPUs, TPUs), else float32 "
        "(every CPU: XLA:CPU does not use AMX or AVX512-BF16)",
    )
    model.add_argument("--loss-scale", choices=LOSS_SCALES, default=d.loss_scale)
    model.add_argument("--max-grad-norm", type=grad_norm, default=d.max_grad_norm, help="a number, or 'none'")
