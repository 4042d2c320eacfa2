"""The building blocks, each usable on its own: precision, loss scaling, clipping,
rematerialization, microbatches and their accumulation, FP8 and int8 matmuls.

.. code-block:: text

    fp8.py                  Fp8Recipe: delayed or current scaling; the scale and quantize-dequantize
    fp8_state.py            FP8 state in the params tree: recognised, max-reduced, overwritten
    fp8_dot.py              fp8_dot_general, fp8_matmul and Fp8Meta, one matmul's FP8 state
    fp8_agreement.py        two layouts' FP8 states compared entry by entry, within a tolerance
    moments.py              compress_moments: optimizer moments in bfloat16 or 8-bit blocks
    masters.py              bfloat16 masters with stochastic rounding (and Kahan compensation)
    spike_guard.py          SpikeGuard: a loss spike skipped inside the step, exactly reproducible
    precision.py            Precision: params, compute and output dtypes, and strict rounding
    rounding.py             strict_precision: every low-precision result rounded, as hardware does
    compute_dtype_check.py  PrecisionWarning: a compute dtype the model silently undoes
    loss_scale.py           NoOp, Static and Dynamic loss scales, all_finite
    loss_scale_registry.py  get_loss_scale("dynamic"): loss scales by name
    clipping.py             the global gradient norm, and clipping by it
    rematerialization.py    remat policies by name, checkpoint_name
    int8.py                 Int8Recipe, int8_matmul: int8 products with dynamic scales, straight-through
    microbatches.py         a batch split into microbatches: contiguous, strided, presplit
    layer_stack.py          LayerStack: a loss as embedding, scanned layers and head
    loss_contract.py        LossContract: what a loss takes and returns, parsed once
    accumulation.py         Accumulation, microbatched_value_and_grad: one lax.scan, float32 sums

Each depends only on :mod:`leanstep.common`, and on the blocks listed above it.
"""

from leanstep.blocks.accumulation import Accumulation, microbatched_value_and_grad
from leanstep.blocks.clipping import clip_by_global_norm, clip_by_global_norm_transform, global_norm
from leanstep.blocks.compute_dtype_check import PrecisionWarning
from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.fp8_dot import Fp8Meta, fp8_dot_general, fp8_matmul
from leanstep.blocks.fp8_state import Fp8Collection
from leanstep.blocks.int8 import Int8Recipe, int8_matmul, int8_remat_policy
from leanstep.blocks.layer_stack import LayerStack
from leanstep.blocks.loss_contract import LossContract, LossOutput
from leanstep.blocks.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale, all_finite
from leanstep.blocks.loss_scale_registry import get_loss_scale
from leanstep.blocks.masters import MASTERS
from leanstep.blocks.microbatches import (
    SPLITS,
    get_splitter,
    presplit_microbatches,
    split_microbatches,
    split_strided_microbatches,
)
from leanstep.blocks.moments import MOMENT_DTYPES, QuantizedArray, compress_moments
from leanstep.blocks.precision import Precision, get_precision
from leanstep.blocks.rematerialization import REMAT_POLICIES, checkpoint_name, get_remat_policy, remat
from leanstep.blocks.rounding import strict_precision
from leanstep.blocks.spike_guard import SpikeGuard, SpikeState

__all__ = [
    "MASTERS",
    "MOMENT_DTYPES",
    "REMAT_POLICIES",
    "SPLITS",
    "Accumulation",
    "DynamicLossScale",
    "Fp8Collection",
    "Fp8Meta",
    "Fp8Recipe",
    "Int8Recipe",
    "LayerStack",
    "LossContract",
    "LossOutput",
    "LossScale",
    "NoOpLossScale",
    "Precision",
    "PrecisionWarning",
    "QuantizedArray",
    "SpikeGuard",
    "SpikeState",
    "StaticLossScale",
    "all_finite",
    "checkpoint_name",
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "compress_moments",
    "fp8_dot_general",
    "fp8_matmul",
    "get_loss_scale",
    "get_precision",
    "get_remat_policy",
    "get_splitter",
    "global_norm",
    "int8_matmul",
    "int8_remat_policy",
    "microbatched_value_and_grad",
    "presplit_microbatches",
    "remat",
    "split_microbatches",
    "split_strided_microbatches",
    "strict_precision",
]
