"""The four seed contracts, exactly, as thin compositions of leanstep's building blocks.

Each function is meant to be called under ``jax.jit``; ``growth_interval`` and
``num_microbatches`` are static (pass them by keyword with ``static_argnames``).
Shapes and keys are checked at trace time and bad input raises ``ValueError``
or ``TypeError`` naming the argument.

Size: the four seed contracts, exact, each with the input checks its contract names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from leanstep.blocks.accumulation import microbatched_value_and_grad
from leanstep.blocks.clipping import clip_by_global_norm as _clip_by_global_norm
from leanstep.blocks.loss_scale import DynamicLossScale, all_finite
from leanstep.blocks.precision import Precision
from leanstep.blocks.rematerialization import remat
from leanstep.common.checks import is_int

__all__ = [
    "TASKS",
    "Task",
    "accumulate_gradients",
    "checkpointed_residual_block",
    "clip_by_global_norm",
    "mixed_precision_step",
]

_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)
_BF16_POLICY = Precision(jnp.float32, jnp.bfloat16, jnp.float32, strict=True)


def _check_keys(tree: Any, expected: tuple[str, ...], name: str) -> None:
    if not isinstance(tree, dict):
        raise TypeError(f"{name} must be a dict with keys {list(expected)}, got {type(tree).__name__}")
    missing = [k for k in expected if k not in tree]
    extra = [k for k in tree if k not in expected]
    if missing or extra:
        raise ValueError(f"{name} must have exactly the keys {list(expected)}; missing {missing}, unexpected {extra}")


def _check_shape(value: Any, shape: tuple[int | None, ...], name: str) -> tuple[int, ...]:
    """Checks ``value``'s shape against ``shape`` (``None`` matches any size) and returns it."""
    if value is None or isinstance(value, (dict, list, tuple)):  # a subtree where one array belongs
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")
    actual = tuple(jnp.shape(value))
    if len(actual) != len(shape) or any(e is not None and a != e for a, e in zip(actual, shape)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
        raise ValueError(f"{name} has shape {actual}; expected {want}")
    return actual


def _check_dtypes(tree: Any, name: str, *, integers: bool) -> None:
    """Leaves must be real floating (or, with ``integers``, integer) arrays: no bool, no complex."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not (jnp.issubdtype(dtype, jnp.floating) or integers and jnp.issubdtype(dtype, jnp.integer)):
            what = "real numbers" if integers else "a real floating-point array"
            raise TypeError(f"{name}{jax.tree_util.keystr(path)} has dtype {dtype}; expected {what}")


def _check_rows(batch: int) -> None:
    if batch == 0:
        raise ValueError("x has 0 rows; expected at least one example")


def _check_data(params: Any, x: ArrayLike, y: ArrayLike, d: int, k: int) -> int:
    """Checks x (B, d) and y (B, k) against each other and every dtype; returns B."""
    (batch, _) = _check_shape(x, (None, d), "x")
    _check_shape(y, (batch, k), "y")
    _check_dtypes(params, "params", integers=False)
    _check_dtypes(x, "x", integers=True)
    _check_dtypes(y, "y", integers=True)
    return batch


def _check_static_int(value: Any, name: str, minimum: int = 1) -> int:
    if not is_int(value):
        raise TypeError(
            f"{name} must be a static Python int (pass it with static_argnames), got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def mixed_precision_step(
    params: dict[str, ArrayLike],
    x: ArrayLike,
    y: ArrayLike,
    loss_scale: ArrayLike,
    good_steps: ArrayLike,
    lr: ArrayLike,
    growth_interval: int,
) -> dict[str, Any]:
    r"""One SGD step of a bf16 linear model on float32 master weights with a dynamic loss scale.

    .. math::

       \hat y = x_{bf16} w_{bf16} + b_{bf16}, \qquad
       L = \frac{1}{BK} \sum_{ij} (\hat y_{ij} - y_{ij})^2, \qquad
       g = \nabla_p (S L) / S

    Every bf16 op result is rounded to bf16, forward and backward
    (:func:`leanstep.blocks.strict_precision`), so the numbers are a bf16 device's
    whatever XLA's excess-precision setting. A finite step applies
    :math:`p \leftarrow p - \mathrm{lr}\, g`; a non-finite one keeps ``params``.
    The loss scale then moves by :class:`leanstep.DynamicLossScale`'s seed rule
    (double after ``growth_interval`` good steps, halve on a bad one, floor 1).

    Args:
      params: ``{"w": (D, K), "b": (K,)}`` float32 master weights.
      x: inputs of shape (B, D).
      y: targets of shape (B, K).
      loss_scale: float32 scalar S.
      good_steps: int32 scalar, finite steps since the last change of S.
      lr: float32 scalar learning rate.
      growth_interval: static int >= 1.

    Returns:
      ``{"loss", "params", "loss_scale", "good_steps", "grads_finite"}``; ``loss``
      is the unscaled loss, finite even when only the scaled one overflows.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> step = jax.jit(mixed_precision_step, static_argnames=("growth_interval",))
      >>> out = step({"w": jnp.array([[0.5], [-1.25]]), "b": jnp.array([0.1])},
      ...            jnp.array([[1.0, 2.0], [0.5, -1.0]]), jnp.array([[-1.9], [1.5]]),
      ...            jnp.float32(1024.0), jnp.int32(0), jnp.float32(0.1), growth_interval=2)
      >>> print(f"{out['loss']:.6f}", out["good_steps"], out["grads_finite"])
      0.005159 1 True
    """
    growth_interval = _check_static_int(growth_interval, "growth_interval")
    _check_keys(params, ("w", "b"), "params")
    d, k = _check_shape(params["w"], (None, None), "params['w']")
    _check_shape(params["b"], (k,), "params['b']")
    batch = _check_data(params, x, y, d, k)
    _check_rows(batch)
    for name, value in (("loss_scale", loss_scale), ("good_steps", good_steps), ("lr", lr)):
        _check_shape(value, (), name)

    scaler = DynamicLossScale(
        loss_scale=jnp.asarray(loss_scale, jnp.float32),
        good_steps=jnp.asarray(good_steps, jnp.int32),
        bad_steps=jnp.zeros((), jnp.int32),
        growth_interval=growth_interval,
        max_loss_scale=_FLOAT32_MAX,
    )
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)

    @_BF16_POLICY.wrap
    def loss_fn(master: dict[str, jax.Array]) -> jax.Array:
        p = _BF16_POLICY.cast_to_compute(master)
        pred = _BF16_POLICY.cast_to_compute(x) @ p["w"] + p["b"][None, :]
        return jnp.mean(jnp.square(_BF16_POLICY.cast_to_output(pred) - y))

    def scaled_loss(master: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        loss = loss_fn(master)
        return scaler.scale(loss), loss

    scaled_grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    grads = scaler.unscale(scaled_grads)
    finite = all_finite(grads)
    lr = jnp.asarray(lr, jnp.float32)
    new_params = jax.tree.map(lambda p, g: jnp.where(finite, p - lr * g, p), params, grads)
    new_scaler = scaler.adjust(finite)
    return {
        "loss": loss,
        "params": new_params,
        "loss_scale": new_scaler.loss_scale,
        "good_steps": new_scaler.good_steps,
        "grads_finite": finite,
    }


_MLP_KEYS = ("w1", "b1", "w2", "b2")


def _check_mlp(params: Any, x: ArrayLike, y: ArrayLike, *, residual: bool) -> int:
    _check_keys(params, _MLP_KEYS, "params")
    d, h = _check_shape(params["w1"], (None, None), "params['w1']")
    _check_shape(params["b1"], (h,), "params['b1']")
    _, k = _check_shape(params["w2"], (h, d if residual else None), "params['w2']")
    _check_shape(params["b2"], (k,), "params['b2']")
    return _check_data(params, x, y, d, k)


def _two_layer_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
    out = hidden @ params["w2"] + params["b2"][None, :]
    # Mean over examples of the sum over outputs, as the seed defines L.
    return jnp.mean(jnp.sum(jnp.square(out - batch["y"]), axis=-1))


def accumulate_gradients(
    params: dict[str, ArrayLike], x: ArrayLike, y: ArrayLike, num_microbatches: int
) -> dict[str, Any]:
    r"""Full-batch loss and gradient of a two-layer tanh network, accumulated over microbatches.

    .. math::

       h = \tanh(x W_1 + b_1), \quad o = h W_2 + b_2, \quad
       L = \frac{1}{N} \sum_n \sum_k (o_{nk} - y_{nk})^2

    The batch is split into ``num_microbatches`` equal, contiguous microbatches
    and walked with one ``lax.scan`` whose body runs ``value_and_grad`` on its
    own rows (:func:`leanstep.blocks.microbatched_value_and_grad`); the mean of the
    equal-size microbatch means is the full-batch value.

    Args:
      params: ``{"w1": (D, H), "b1": (H,), "w2": (H, K), "b2": (K,)}``.
      x: inputs of shape (B, D).
      y: targets of shape (B, K).
      num_microbatches: static int that divides B.

    Returns:
      ``{"loss": float32 (), "grads": dict shaped like params}``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(accumulate_gradients, static_argnames=("num_microbatches",))
      >>> params = {"w1": jnp.ones((1, 2)), "b1": jnp.zeros(2), "w2": jnp.ones((2, 1)), "b2": jnp.zeros(1)}
      >>> out = f(params, jnp.array([[1.0], [2.0]]), jnp.array([[0.0], [0.0]]), num_microbatches=2)
      >>> print(f"{out['loss']:.6f}")
      3.018750
    """
    num_microbatches = _check_static_int(num_microbatches, "num_microbatches")
    batch = _check_mlp(params, x, y, residual=False)
    if batch % num_microbatches:
        raise ValueError(f"batch size {batch} is not divisible by num_microbatches={num_microbatches}")
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    data = {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}
    loss, grads = microbatched_value_and_grad(_two_layer_loss, num_microbatches)(params, data)
    return {"loss": loss, "grads": grads}


def clip_by_global_norm(grads: Any, max_norm: ArrayLike) -> dict[str, Any]:
    r"""Clips a gradient pytree by its global L2 norm, computed in float32.

    .. math::

       \lVert g \rVert = \sqrt{\textstyle\sum_\ell \sum_i g_{\ell i}^2}, \qquad
       s = \min(1, c / \lVert g \rVert)

    Args:
      grads: a pytree of float32 or bfloat16 leaves.
      max_norm: the positive threshold c (may be traced).

    Returns:
      ``{"clipped": tree like grads (leaf dtypes kept), "global_norm": float32 ()}``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> out = jax.jit(clip_by_global_norm)({"w": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)}, 1.0)
      >>> print(out["clipped"]["w"], f"{out['global_norm']:.1f}")
      [0.6 0. ] 5.0
    """
    if not jax.tree.leaves(grads):
        raise ValueError("grads must have at least one leaf, got an empty tree")
    clipped, norm = _clip_by_global_norm(grads, max_norm)
    return {"clipped": clipped, "global_norm": norm}


def _residual_block(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ params["w1"] + params["b1"][None, :]) @ params["w2"] + params["b2"][None, :]


_checkpointed_block = remat(_residual_block, "dots")


def checkpointed_residual_block(params: dict[str, ArrayLike], x: ArrayLike, y: ArrayLike) -> dict[str, Any]:
    r"""Loss and gradients of a residual MLP block that recomputes tanh in the backward pass.

    .. math::

       \mathrm{out} = x + \tanh(x W_1 + b_1) W_2 + b_2, \qquad
       L = \frac{1}{BD} \sum (\mathrm{out} - y)^2

    The block runs under ``jax.checkpoint`` with ``dots_saveable``
    (:func:`leanstep.blocks.remat` policy ``"dots"``): both matmul results are saved,
    the tanh is recomputed from the saved pre-activation.

    Args:
      params: ``{"w1": (D, H), "b1": (H,), "w2": (H, D), "b2": (D,)}``.
      x: inputs of shape (B, D).
      y: targets of shape (B, D).

    Returns:
      ``{"loss": float32 (), "grads": dict shaped like params}``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"w1": jnp.eye(2), "b1": jnp.zeros(2), "w2": jnp.eye(2), "b2": jnp.zeros(2)}
      >>> out = jax.jit(checkpointed_residual_block)(params, jnp.array([[0.5, -0.5], [1.0, 2.0]]), jnp.zeros((2, 2)))
      >>> print(f"{out['loss']:.6f}")
      3.435003
    """
    _check_rows(_check_mlp(params, x, y, residual=True))  # accumulate_gradients' split reports its own
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)

    def loss_fn(p: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean(jnp.square(_checkpointed_block(p, x) - y))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return {"loss": loss, "grads": grads}


class Task(NamedTuple):
    """One seed contract: its function, static arguments and the kind of each argument.

    ``inputs`` maps every argument, in order, to how its JSON is read: ``"tree"`` (a float32
    pytree), ``"array"`` (a float32 array), ``"int"`` (a static or int32 integer), ``"count"``
    (an integer >= 0), ``"scalar"`` (a finite float32 scalar) or ``"positive"`` (one > 0).
    """

    function: Callable[..., Any]
    static: tuple[str, ...]
    inputs: dict[str, str]


#: Task name (as ``leanstep solve`` calls it) -> :class:`Task`.
TASKS: dict[str, Task] = {
    "mixed-precision-step": Task(
        mixed_precision_step,
        ("growth_interval",),
        {
            "params": "tree",
            "x": "array",
            "y": "array",
            "loss_scale": "positive",
            "good_steps": "count",
            "lr": "scalar",
            "growth_interval": "int",
        },
    ),
    "gradient-accumulation": Task(
        accumulate_gradients,
        ("num_microbatches",),
        {"params": "tree", "x": "array", "y": "array", "num_microbatches": "int"},
    ),
    "global-norm-clipping": Task(clip_by_global_norm, (), {"grads": "tree", "max_norm": "positive"}),
    "checkpointed-residual-block": Task(
        checkpointed_residual_block, (), {"params": "tree", "x": "array", "y": "array"}
    ),
}
