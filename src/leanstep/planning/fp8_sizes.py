"""What a plan says of FP8: the FP8 state's bytes, and the FP8 matmul operands at one byte.

An FP8 run (:mod:`leanstep.blocks.fp8_dot`) carries, in its state, one scale and one amax
history per quantized tensor of every FP8 matmul: float32, replicated on every device, never in
the optimizer. Its matmul operands are FP8 arrays, one byte an element, in the program itself
(the forward dot and both transposes take them: an FP8 GEMM on an FP8 device, H100, H200, MI300;
XLA:CPU, where leanstep plans, computes the same products in wider registers), so the compiled
peak counts the operands kept for the backward pass at one byte. The plan says both, in
:attr:`leanstep.planning.Plan.notes`:

.. code-block:: text

    state     sum of the FP8 state's leaves (scales, histories), bytes
    operands  sum over the step's FP8 matmuls (forward and backward, loop bodies x trip count)
              of their two operands' elements, at the bytes the program holds them in

The cluster cost model prices the FP8 matmuls' share of the FLOPs at the accelerator's FP8
rate (:func:`fp8_flops`, :class:`leanstep.planning.Accelerator`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from leanstep.blocks.fp8_dot import fp8_scope
from leanstep.blocks.fp8_state import fp8_leaves, has_fp8
from leanstep.common.jaxprs import MATMUL_PRIMITIVES, matmul_flops, weighted_equations

__all__ = ["Fp8Sizes", "fp8_flops", "fp8_notes", "fp8_sizes"]


class Fp8Sizes:
    """The FP8 figures of a traced step (see the module doc).

    Attributes:
      state_bytes: bytes of the FP8 state in the train state.
      matmuls: FP8 matmul equations (forward and backward), counted once each.
      operand_elements: their operands' elements per step (trip counts included).
      operand_width: the most bytes an operand element takes in the traced program (1: FP8).
      flops: their FLOPs per step.
    """

    def __init__(self, state_bytes: int, matmuls: int, operand_elements: float, operand_width: int, flops: float):
        self.state_bytes, self.matmuls = state_bytes, matmuls
        self.operand_elements, self.operand_width, self.flops = operand_elements, operand_width, flops


def fp8_sizes(state: Any, jaxpr: Any) -> Fp8Sizes | None:
    """The FP8 figures of a step traced on ``state`` (its ``jaxpr``), or None without FP8 matmuls.

    Example:
      >>> import jax.numpy as jnp, optax, leanstep
      >>> recipe = leanstep.Fp8Recipe(history=16)
      >>> params = {"w": jnp.ones((8, 4)), "fp8": leanstep.blocks.Fp8Meta.create(recipe)}
      >>> loss = lambda p, b: jnp.sum(leanstep.blocks.fp8_matmul(b["x"], p["w"], p["fp8"], recipe))
      >>> state = leanstep.TrainState.create(params, optax.sgd(0.1))
      >>> traced = leanstep.make_train_step(loss, precision="compute=bfloat16").trace(state, {"x": jnp.ones((2, 8))})
      >>> sizes = fp8_sizes(state, traced.jaxpr)
      >>> sizes.state_bytes, sizes.matmuls, sizes.operand_elements, sizes.operand_width
      (204, 3, 112.0, 1)
    """
    state_bytes = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in fp8_leaves(state.params))
    matmuls, elements, flops, width = 0, 0.0, 0.0, 0
    for eqn, times in weighted_equations(jaxpr):
        if eqn.primitive.name not in MATMUL_PRIMITIVES or fp8_scope(str(eqn.source_info.name_stack)) is None:
            continue
        matmuls += 1
        operands = eqn.invars[:2]
        elements += times * sum(math.prod(v.aval.shape) for v in operands)
        flops += times * matmul_flops(eqn)
        width = max(width, *(np.dtype(v.aval.dtype).itemsize for v in operands))
    if not matmuls and not has_fp8(state.params):
        return None
    return Fp8Sizes(state_bytes, matmuls, elements, width, flops)


def fp8_flops(jaxpr: Any) -> float:
    """The FLOPs per step of a traced step's FP8 matmuls (loop bodies times trip counts)."""
    return sum(
        times * matmul_flops(eqn)
        for eqn, times in weighted_equations(jaxpr)
        if eqn.primitive.name in MATMUL_PRIMITIVES and fp8_scope(str(eqn.source_info.name_stack)) is not None
    )


def fp8_notes(state: Any, jaxpr: Any) -> tuple[str, ...]:
    """The plan's notes on FP8 (none without it): :func:`fp8_sizes` in two sentences."""
    sizes = fp8_sizes(state, jaxpr)
    if sizes is None:
        return ()
    at_one = sizes.operand_elements
    state = (
        f"FP8 state: {sizes.state_bytes:,} bytes (scales and amax histories, float32, replicated, not in the "
        "optimizer), counted in the state"
    )
    operands = (
        f"FP8 operands: {sizes.matmuls} FP8 matmuls a step move {at_one:,.0f} operand elements, "
        f"{sizes.operand_width * at_one:,.0f} bytes at {sizes.operand_width} byte(s) each, as the compiled peak counts them"
    )
    return state, operands
