r"""Lean optimizer state: moments kept in bfloat16, or in 8-bit blocks with a float32 scale each.

An optimizer's moments (Adam's ``mu`` and ``nu``, Lion's ``mu``, SGD's momentum ``trace``: the
fields of optax's states that hold running averages of the gradient or its square, listed in
``MOMENT_FIELDS``) are stored compressed and widened to float32 for the update, whose math is the
optimizer's own, in float32. Nothing else is compressed, even where it is shaped like the
parameters: schedule-free's ``z`` and Prodigy's ``params0`` are weights, kept as the optimizer
keeps them.

.. code-block:: text

    bfloat16   m = bf16(m32)                                           2 bytes an element
    int8       along the last axis, in blocks of B (a last, shorter block where B does not divide it):
                 a_k  = max |x| over block k                           float32, one per block
                 c_i  = nearest code of x_i / a_k in the map           uint8
                 x_i ~= map[c_i] * a_k                                 1 + 4/B bytes an element

The map is the dynamic (tree) quantization of the 8-bit optimizers paper (Dettmers et al.,
2022): 256 values in [-1, 1] (the first moment, signed) or [0, 1] (the second, unsigned), dense
near zero over six decades, with 0 and 1 exact. Where it differs from bitsandbytes' map: -1 is
exact too (in place of the smallest negative value, about -5.5e-7), so a block whose largest
magnitude is negative keeps it (bitsandbytes decodes -1 as -0.99297). The nearest code is found against the float32
midpoints of the sorted map (a value on a midpoint takes the lower code). A block of zeros has
scale 0 and decodes to zeros.

Blocks run along the last axis, so a parameter split over a device mesh along its other axes
keeps whole blocks on each device; split along its last axis, each device's blocks are its own
where its part is a multiple of ``B``, and otherwise a block straddles devices and the scales are
kept whole along that axis (:func:`leanstep.step.state_sharding.scales_sharding`).

Size: one concern, the 8-bit form of a moment from its map to the optimizer's state: the map and
its decoding (a lookup on a CPU; arithmetic on an accelerator, whose gathers are slow), the
blocks, and the wrapper that finds the moments in optax's states and keeps them compressed.

Example:
  >>> import jax.numpy as jnp
  >>> q = quantize(jnp.array([0.0, 0.5, -1.0, 3e-4]), signed=True, block_size=4)
  >>> q.codes.dtype, dequantize(q)
  (dtype('uint8'), Array([ 0.0000000e+00,  5.0078124e-01, -1.0000000e+00,  2.6874998e-04], dtype=float32))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from leanstep.blocks.dynamic_map import decode_with, dynamic_map, map_tables
from leanstep.common.checks import is_int
from leanstep.common.row_slices import map_row_slices

__all__ = [
    "MOMENT_DTYPES",
    "MOMENT_FIELDS",
    "QuantizedArray",
    "compress_moments",
    "decode",
    "dequantize",
    "dynamic_map",
    "quantize",
    "quantize_in_slices",
]

#: The forms a moment may be kept in.
MOMENT_DTYPES = ("float32", "bfloat16", "int8")

#: The moments of optax's states: state type -> {field: signed}. A second moment (non-negative)
#: takes the unsigned map; a field that may be negative, the signed one (SM3's ``nu`` is its
#: momentum; Sophia's ``nu`` averages Hutchinson's Hessian estimates, which may be negative).
#: Every other field (schedule-free's ``z``, Prodigy's ``params0``, Adan's last gradient ``g``,
#: counts) is no moment, and is kept as the optimizer keeps it.
MOMENT_FIELDS: dict[str, dict[str, bool]] = {
    "ScaleByAdamState": {"mu": True, "nu": False},  # adam(w), nadam(w), radam, lamb, adamax, yogi
    "ScaleByAmsgradState": {"mu": True, "nu": False, "nu_max": False},
    "ScaleByLionState": {"mu": True},
    "TraceState": {"trace": True},  # sgd(momentum=), lars, nesterov
    "ScaleByRmsState": {"nu": False},
    "ScaleByRmsWithCountState": {"nu": False},  # rmsprop; schedule-free AdamW's base
    "ScaleByRStdDevState": {"mu": True, "nu": False},  # centered rmsprop
    "ScaleByRStdDevWithCountState": {"mu": True, "nu": False},
    "ScaleByRssState": {"sum_of_squares": False},  # adagrad
    "ScaleByBeliefState": {"mu": True, "nu": False},  # adabelief
    "FactoredState": {"v": False},  # adafactor's unfactored second moments (v_row, v_col are not shaped like them)
    "ScaleBySM3State": {"nu": True},
    "ScaleByAdanState": {"m": True, "v": True, "n": False},
    "ScaleByAdemamixState": {"m1": True, "m2": True, "nu": False},
    "MuonState": {"mu": True},
    "SophiaState": {"mu": True, "nu": True},
    "ProdigyState": {"exp_avg": True, "exp_avg_sq": False},
    "DAdaptAdamWState": {"exp_avg": True, "exp_avg_sq": False},
    "MomoState": {"exp_avg": True},
    "MomoAdamState": {"exp_avg": True, "exp_avg_sq": False},
}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A float array in 8-bit blocks (see the module doc).

    Attributes:
      codes: uint8, the array's shape.
      scales: float32, the array's shape with its last axis in blocks (``ceil(n / block_size)``).
      signed: the map (static).
      block_size: ``B`` (static).
    """

    codes: Any
    scales: Any
    signed: bool
    block_size: int

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[bool, int]]:
        return (self.codes, self.scales), (self.signed, self.block_size)

    @classmethod
    def tree_unflatten(cls, aux: tuple[bool, int], children: tuple[Any, Any]) -> QuantizedArray:
        return cls(*children, *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)


def _blocks(x: jax.Array, block_size: int) -> tuple[jax.Array, int]:
    """``x`` with its last axis padded to whole blocks and split: ``(..., blocks, B)``; and its length."""
    x = x.reshape(1) if x.ndim == 0 else x
    n = x.shape[-1]
    blocks = -(-n // block_size)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * block_size - n)])
    return padded.reshape(*x.shape[:-1], blocks, block_size), n


# How a code is found among the 255 midpoints. A CPU keeps the binary search of
# gathers ("scan", eight an entry; leanstep's search before 0.12): 32-39 ns an entry against
# 585-1,960 for "compare_all", which XLA:CPU does not fuse (2-core EPYC, 4M entries, two loaded
# runs; "scan_unrolled" measured 16 and 47 there, so it was not switched to:
# `python benchmarks/moment_codes.py --entries 4194304`). On a TPU v5e the gathers are slow:
# "scan" 77 ns an entry, "sort" 21, "compare_all" (one fused compare-and-count, no gather) 0.27
# (16M entries, JAX 0.10.2, 2026-12-06). Both give the same codes (tests/test_lean_state.py).
_ACCELERATOR_SEARCH = "compare_all"


def _search(method: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    return lambda midpoints, normalized: jnp.searchsorted(midpoints, normalized, side="left", method=method)


# The codec's functions are jitted so that a step traces each once per leaf shape and format, not once
# per leaf and chunk (`python benchmarks/codec_tracing.py`: the 405M lean step on a TPU v5e lowers in
# 2.86 s instead of 7.31, to the same temporaries).
#: Past this many entries a moment is made (``init``) a slice of rows at a time: whole, the
#: float32 temporaries of quantizing its zeros (blocks, normalized values, the search's indices)
#: did not fit a 2.5B model's moments beside its state on a 16 GiB TPU v5e. Rows quantize alike
#: either way: the same codes. (The update's own quantization is chunked by the step.)
SLICE_ENTRIES = 1 << 24


@functools.partial(jax.jit, static_argnames=("signed", "block_size"))
def quantize(x: jax.Array, *, signed: bool, block_size: int = 256) -> QuantizedArray:
    """``x`` in 8-bit blocks (float32 math; see the module doc)."""
    return _quantize(jnp.asarray(x), signed=signed, block_size=block_size)


@functools.partial(jax.jit, static_argnames=("signed", "block_size"))
def quantize_in_slices(x: jax.Array, *, signed: bool, block_size: int = 256) -> QuantizedArray:
    """:func:`quantize`'s codes, made a slice of rows at a time past :data:`SLICE_ENTRIES` entries."""
    whole = functools.partial(_quantize, signed=signed, block_size=block_size)
    return map_row_slices(whole, jnp.asarray(x), SLICE_ENTRIES)


def _quantize(x: jax.Array, *, signed: bool, block_size: int) -> QuantizedArray:
    _, midpoints = map_tables(signed)
    shape = jnp.shape(x)
    blocks, n = _blocks(jnp.asarray(x, jnp.float32), block_size)
    scales = jnp.max(jnp.abs(blocks), axis=-1)
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]
    normalized = jnp.where(scales[..., None] > 0, blocks / safe, 0.0)
    codes = jax.lax.platform_dependent(
        jnp.asarray(midpoints), normalized, cpu=_search("scan"), default=_search(_ACCELERATOR_SEARCH)
    ).astype(jnp.uint8)
    codes = codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * block_size)[..., :n].reshape(shape)
    return QuantizedArray(codes, scales, signed, block_size)


@functools.partial(jax.jit, static_argnames=("signed",))
def decode(codes: jax.Array, *, signed: bool) -> jax.Array:
    """``dynamic_map(signed)[codes]``: a lookup on a CPU; elsewhere by arithmetic, bit for bit the
    map (each value an integer times a float32 reciprocal, ``dynamic_map``), with no gather. On a
    TPU v5e a 256-entry lookup costs 9.6 ns an entry, 25 s a step for a 1.3B model's two
    moments; the arithmetic, 0.045 (``python benchmarks/moment_codes.py`` on the chip, 2026-12-06).
    On a CPU the lookup is the faster, 0.11 ns an entry against 0.33-0.38 (4M entries, 2-core EPYC:
    ``python benchmarks/moment_codes.py --entries 4194304``, "take" against "arithmetic").
    """
    values, _ = map_tables(signed)
    return jax.lax.platform_dependent(
        codes.astype(jnp.int32),
        cpu=lambda c: jnp.asarray(values)[c],  # codes are 0..255: always in bounds
        default=lambda c: decode_with(jnp, c, signed),
    )


@jax.jit
def dequantize(q: QuantizedArray) -> jax.Array:
    """The float32 array ``q`` stands for: ``map[code] * scale`` of its block."""
    decoded, n = _blocks(decode(q.codes, signed=q.signed), q.block_size)
    whole = (decoded * q.scales[..., None]).reshape(*decoded.shape[:-2], decoded.shape[-2] * q.block_size)
    return whole[..., :n].reshape(q.shape)  # explicit sizes: a zero-size array has no -1 to infer


# --- the optimizer wrapper -------------------------------------------------------------------------


class _Form(NamedTuple):
    dtype: str
    block_size: int


def _params_shaped(node: Any, template: Any) -> bool:
    """Whether ``node`` (a state subtree, maybe compressed) holds a floating array of each parameter's
    shape at its place, or an ``optax.MaskedNode`` where a ``masked`` (``partition``, Muon) optimizer
    leaves it to another part; at least one array."""
    template_leaves, template_def = jax.tree.flatten(template)
    if not template_leaves:
        return False
    try:
        subs = template_def.flatten_up_to(node)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
    except (ValueError, TypeError):  # another structure
        return False
    arrays = [(sub, param) for sub, param in zip(subs, template_leaves) if not isinstance(sub, optax.MaskedNode)]
    for sub, param in arrays:
        if isinstance(sub, QuantizedArray):
            shape = sub.shape
        elif sub is not None and jax.tree_util.treedef_is_leaf(jax.tree.structure(sub)):
            if not jnp.issubdtype(jnp.result_type(sub), jnp.floating):  # a count is no moment, even beside a scalar
                return False
            shape = tuple(jnp.shape(sub))
        else:
            return False
        if shape != tuple(jnp.shape(param)):
            return False
    return bool(arrays)


def _moment_fields(node: Any) -> dict[str, bool]:
    """``MOMENT_FIELDS`` of ``node``'s type if it is one of optax's states; ``{}`` otherwise."""
    kind = type(node)
    if not (isinstance(node, tuple) and hasattr(node, "_fields") and kind.__module__.split(".")[0] == "optax"):
        return {}
    return MOMENT_FIELDS.get(kind.__name__, {})


def _walk(node: Any, template: Any, fn: Callable[[Any, bool], Any]) -> Any:
    """``fn(moment, signed)`` on every moment of an optimizer state (a ``MOMENT_FIELDS`` field
    shaped like the params); the rest as is."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        fields = _moment_fields(node)
        return type(node)(
            *(
                fn(value, fields[name])
                if name in fields and _params_shaped(value, template)
                else _walk(value, template, fn)
                for name, value in zip(node._fields, node)
            )
        )
    if isinstance(node, (tuple, list)):
        return type(node)(_walk(x, template, fn) for x in node)
    if isinstance(node, dict):
        return {k: _walk(v, template, fn) for k, v in node.items()}
    return node


def _weights_like(node: Any, template: Any, where: str = "") -> list[str]:
    """The fields of an optimizer state shaped like the params that are no moment, by name."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        fields, found = _moment_fields(node), []
        for name, value in zip(node._fields, node):
            here = f"{type(node).__name__}.{name}"
            if _params_shaped(value, template):
                found += [] if name in fields else [here]
            else:
                found += _weights_like(value, template, here)
        return found
    if isinstance(node, (tuple, list)):
        return [f for x in node for f in _weights_like(x, template, where)]
    if isinstance(node, dict):
        return [f for k, v in node.items() for f in _weights_like(v, template, f"{where}[{k!r}]")]
    return []


def _compress(form: _Form, coder: Callable[..., QuantizedArray] = quantize) -> Callable[[Any, bool], Any]:
    def compress(moment: Any, signed: bool) -> Any:
        if form.dtype == "bfloat16":
            return jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), moment)
        return jax.tree.map(lambda x: coder(x, signed=signed, block_size=form.block_size), moment)

    return compress


def _widen(moment: Any, signed: bool) -> Any:
    leaf = lambda x: dequantize(x) if isinstance(x, QuantizedArray) else jnp.asarray(x, jnp.float32)
    return jax.tree.map(leaf, moment, is_leaf=lambda x: isinstance(x, QuantizedArray))


@functools.lru_cache(maxsize=64)
def compress_moments(
    optimizer: optax.GradientTransformation, dtype: str = "int8", *, block_size: int = 256
) -> optax.GradientTransformation:
    """``optimizer`` with its moments kept compressed (see the module doc).

    The moments (the ``MOMENT_FIELDS`` of optax's states, where shaped like the parameters) are
    widened to float32 before each update and compressed after it; everything else of its state
    (counts, Adafactor's factored statistics, schedule-free's ``z``, Prodigy's ``params0``) is kept
    as the optimizer keeps it. The same arguments give the same wrapper (cached), so a state built
    twice compiles once.

    Args:
      optimizer: an optax optimizer whose state holds moments (Adam, AdamW, Lion, SGD with
        momentum, RMSProp, Adagrad, AdaBelief, Adafactor, schedule-free AdamW, ...).
      dtype: ``"bfloat16"`` or ``"int8"`` (``"float32"``: ``optimizer`` itself).
      block_size: ``B`` for ``"int8"``, an int >= 16.

    Raises:
      ValueError: another ``dtype``, or a bad ``block_size``; at ``init``, a state with fields
        shaped like the parameters none of which is a moment leanstep knows (schedule-free SGD's
        ``z``: a copy of the weights, which 8 bits would corrupt), naming them.

    Example:
      >>> tx = compress_moments(optax.adamw(1e-3), "int8", block_size=64)
      >>> state = tx.init({"w": jnp.ones((4, 128))})
      >>> state[0].mu["w"].codes.dtype, state[0].mu["w"].scales.shape
      (dtype('uint8'), (4, 2))
      >>> state = compress_moments(optax.contrib.schedule_free_adamw(1e-3), "int8").init({"w": jnp.ones((4, 128))})
      >>> type(state.base_optimizer_state[0].nu["w"]).__name__, state.z["w"].dtype
      ('QuantizedArray', dtype('float32'))
    """
    if dtype not in MOMENT_DTYPES:
        raise ValueError(f"moments must be one of {MOMENT_DTYPES}, got {dtype!r}")
    if not is_int(block_size) or block_size < 16:
        raise ValueError(f"block_size must be an int >= 16, got {block_size!r}")
    if dtype == "float32":
        return optimizer
    compress = _compress(_Form(dtype, int(block_size)))

    def init(params: Any) -> Any:
        state, moments = optimizer.init(params), []
        _walk(state, params, lambda moment, signed: moments.append(moment))
        weights = _weights_like(state, params)
        if weights and not moments:
            raise ValueError(
                f"moments {dtype!r}: the optimizer's state holds no moment that leanstep compresses "
                f"(MOMENT_FIELDS in leanstep.blocks.moments), and {', '.join(weights)}, shaped like the "
                "parameters, is no moment: 8 bits or bfloat16 would change what it tracks; pass "
                "moments='float32'"
            )
        return _walk(state, params, _compress(_Form(dtype, int(block_size)), quantize_in_slices))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        wide = _walk(state, updates, _widen)
        updates, new = optimizer.update(updates, wide, params)
        return updates, _walk(new, updates, compress)

    return optax.GradientTransformation(init, update)
