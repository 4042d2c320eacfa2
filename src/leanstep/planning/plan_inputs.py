"""What :func:`leanstep.planning.plan` is given beside the loss: the spec, params and model state per policy, and what a model state implies.

.. code-block:: text

    spec               the run's StepSpec: each candidate's step is it with the candidate's precision
                       and microbatch count (candidate_spec); the state is built from it too

    params             a tree (the same for every remat policy), or a params builder:
                       policy -> params, for a remat policy that changes the params' structure
                       (an Equinox submodule wrapped by leanstep.blocks.remat via eqx.tree_at; a Linen
                       model whose unnamed blocks are renamed, ResNetBlock_0 -> CheckpointResNetBlock_0)
    model_state        a tree, or a builder policy -> model state, as params: the Linen model's
                       renamed blocks rename their batch_stats too
                       each microbatch computes its own batch statistics (BatchNorm): the plan
                       says so in Plan.notes; bound the count with SearchSpace(max_microbatches=...);
                       microbatches of fewer than SearchSpace.min_microbatch_rows rows (16 by
                       default with a model state) are not planned

A builder is a plain callable (a function, not a pytree of arrays: an Equinox module
is callable too, and is taken as a tree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from leanstep.blocks.fp8_state import split_fp8
from leanstep.planning.candidates import abstract_tree
from leanstep.step.spec import StepSpec
from leanstep.step.state import TrainState

T = TypeVar("T")
__all__ = [
    "TreesGiven",
    "abstract_state",
    "batch_size_of",
    "batch_statistics_notes",
    "candidate_spec",
    "holds_model_state",
    "is_params_builder",
    "params_for",
    "plan_spec",
    "state_format_notes",
    "structure_error",
    "trace_refusing_structure_errors",
]

#: Words of the errors a loss raises when its params have another structure than it expects
#: (jax's pytree errors, Equinox's combine, Flax's missing parameter).
_STRUCTURE_WORDS = (
    "structure",
    "treedef",
    "mismatch",
    "arity",
    "could not find parameter",
    "scopeparamnotfound",
    "scopecollectionnotfound",
    "custom node type",
)


def plan_spec(spec: Any) -> StepSpec:
    """The step spec a plan searches around: ``spec`` (None: ``StepSpec()``), checked.

    Raises:
      TypeError: ``spec`` is not a StepSpec.
      ValueError: its accumulation does not divide the loss by the microbatch count (the plan
        searches the count of a loss divided by it).
    """
    spec = StepSpec() if spec is None else spec
    if not isinstance(spec, StepSpec):
        raise TypeError(
            f"spec must be a leanstep.StepSpec or None, got {type(spec).__name__}; a plan takes the step's settings "
            "in its spec (leanstep.StepSpec(...), or StepSpec.from_keywords(...) of make_train_step's keywords)"
        )
    if not spec.accumulation.divide:
        raise ValueError(
            "plan searches the microbatch count of a loss divided by it: spec.accumulation.divide must be True"
        )
    return spec


def candidate_spec(spec: StepSpec, setting: Any) -> StepSpec:
    """``spec`` with what a candidate ``setting`` (:class:`leanstep.planning.Setting`) searches:
    its precision, microbatch count and (``update_in_backward``, where it says so) the update
    inside the backward pass; the layout is the mesh's, given to the step with it.

    Example:
      >>> from leanstep.planning.records import Setting
      >>> spec = candidate_spec(StepSpec(max_grad_norm=1.0), Setting(4, "full", "compute=bfloat16"))
      >>> spec.accumulation.num_microbatches, spec.precision.compute_dtype.name, spec.max_grad_norm
      (4, 'bfloat16', 1.0)
    """
    accumulation = dataclasses.replace(spec.accumulation, num_microbatches=setting.num_microbatches)
    in_backward = spec.update_in_backward or bool(getattr(setting, "update_in_backward", False))
    return spec.replace(precision=setting.precision, accumulation=accumulation, update_in_backward=in_backward)


def abstract_state(params: Any, optimizer: Any, spec: StepSpec, model_state: Any) -> Any:
    """The abstract :class:`leanstep.TrainState` of ``params`` (a tree) and ``model_state``, built
    as ``spec`` says (its loss scale, masters, moments and spike guard: ``TrainState.create``)."""
    return jax.eval_shape(
        lambda p, m: TrainState.create(p, optimizer, spec, model_state=m),
        abstract_tree(params),
        abstract_tree(model_state),
    )


def _bytes(tree: Any) -> int:
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_format_notes(params: Any, optimizer: Any, spec: StepSpec, model_state: Any) -> tuple[str, ...]:
    """The plan's note on a compressed state (``spec.master``, ``spec.moments``): its bytes a
    parameter and what it saves against float32 masters and moments; none for the float32 state.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
      >>> print(state_format_notes(params, optax.adamw(1e-3), StepSpec(moments="int8"), None)[0])
      state kept with moments='int8': 6.03 bytes a parameter (params, optimizer state), against 12.00 in float32: 5.97 saved, 6.3 MB for 1,048,576 parameters
    """
    formats = {name: getattr(spec, name) for name in ("master", "moments") if getattr(spec, name) != "float32"}
    if not formats:
        return ()
    lean = abstract_state(params, optimizer, spec, model_state)
    full = abstract_state(params, optimizer, spec.replace(master="float32", moments="float32"), model_state)
    count = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(split_fp8(full.params)[0]))
    parts = lambda s: _bytes(split_fp8(s.params)[0]) + _bytes(s.opt_state) + _bytes(s.master_error)
    lean_bytes, full_bytes = parts(lean), parts(full)
    given = ", ".join(f"{name}={value!r}" for name, value in formats.items())
    note = (
        f"state kept with {given}: {lean_bytes / count:.2f} bytes a parameter (params, optimizer state), against "
        f"{full_bytes / count:.2f} in float32: {(full_bytes - lean_bytes) / count:.2f} saved, "
        f"{(full_bytes - lean_bytes) / 1e6:,.1f} MB for {count:,} parameters"
    )
    return (note,)


def batch_size_of(batch: Any) -> int:
    """The batch's leading size, shared by all its leaves.

    Raises:
      ValueError: leaves with different leading sizes, or a scalar leaf.
    """
    batch_sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batch)}
    batch_size = next(iter(batch_sizes)) if len(batch_sizes) == 1 else None
    if batch_size is None:
        raise ValueError(
            f"batch leaves must share one leading batch axis, got leading sizes {sorted(map(str, batch_sizes))}"
        )
    return int(batch_size)


def is_params_builder(params: Any) -> bool:
    """Whether ``params`` is a params builder: a callable that is a pytree leaf (not an Equinox module).

    Example:
      >>> is_params_builder(lambda policy: {"w": 1.0}), is_params_builder({"w": 1.0})
      (True, False)
    """
    if not callable(params) or hasattr(params, "dtype"):
        return False
    leaves = jax.tree.leaves(params)
    return len(leaves) == 1 and leaves[0] is params


def params_for(tree: Any, policy: str) -> Any:
    """The params (or model state) to plan ``policy`` with: ``tree(policy)`` for a builder, else ``tree``."""
    return tree(policy) if is_params_builder(tree) else tree


def holds_model_state(model_state: Any, policy: str) -> bool:
    """Whether a model state (a builder's, under ``policy``) can hold batch statistics: whether it has
    leaves. None, ``{}`` and the empty ``nnx.State`` of an NNX model without BatchNorm hold none.

    Example:
      >>> holds_model_state(None, "none"), holds_model_state({}, "none"), holds_model_state({"mean": 0.0}, "none")
      (False, False, True)
    """
    return bool(jax.tree.leaves(params_for(model_state, policy)))


class TreesGiven(NamedTuple):
    """Whether a plan was given one tree for every policy (not a builder): params, model state."""

    params: bool = True
    model_state: bool = True

    @classmethod
    def of(cls, params: Any, model_state: Any) -> TreesGiven:
        return cls(not is_params_builder(params), model_state is not None and not is_params_builder(model_state))


#: The start of the loss contract's error for a new model state of another structure (``LossContract.parse``).
_STATE_STRUCTURE = "has_state=True: loss_fn must return a new model state of the structure it was given"


def structure_error(error: BaseException, policy: str, given: TreesGiven | None = None) -> ValueError | None:
    """A leanstep error for a loss that failed on a tree's structure under ``policy``; None for other errors.

    The model state's (the loss returned one of another structure: the policy renamed the blocks
    holding it) names ``model_state``; the params' names ``params``, with ``model_state`` too
    where both were given as one tree. ``given``: None, one params tree and no model state.

    Example:
      >>> print(structure_error(TypeError(_STATE_STRUCTURE + "; got ..."), "full", TreesGiven(False, True)))
      under remat policy 'full' the model state's structure changes: the loss returned a new model state of another structure than the model_state given (a Linen model's unnamed blocks are renamed under remat, ResNetBlock_0 -> CheckpointResNetBlock_0, and their batch_stats with them); pass model_state as a builder too, model_state=lambda policy: <the model state of the model built under that policy>, as params
    """
    given = TreesGiven(model_state=False) if given is None else given
    text = f"{type(error).__name__} {error}".lower()
    if given.model_state and str(error).startswith(_STATE_STRUCTURE):
        return ValueError(
            f"under remat policy {policy!r} the model state's structure changes: the loss returned a new model "
            "state of another structure than the model_state given (a Linen model's unnamed blocks are renamed "
            "under remat, ResNetBlock_0 -> CheckpointResNetBlock_0, and their batch_stats with them); pass "
            "model_state as a builder too, model_state=lambda policy: <the model state of the model built under "
            "that policy>, as params"
        )
    if not (given.params or given.model_state) or not any(word in text for word in _STRUCTURE_WORDS):
        return None
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    trees = [name for name, one in (("params", given.params), ("model_state", given.model_state)) if one]
    builders = " and ".join(
        f"{name}=lambda policy: <the {_WHAT[name]} of the model built under that policy>" for name in trees
    )
    kind = "a params builder" if trees == ["params"] else "a model-state builder" if len(trees) == 1 else "builders"
    return ValueError(
        f"the loss under remat policy {policy!r} does not take the {' and '.join(trees)} given "
        f"({type(error).__name__}: {first[:300]}): this policy changes the {' or '.join(trees)}' structure, so "
        f"pass {' and '.join(trees)} as {kind}, {builders} (a callable policy -> tree), instead of one tree "
        "for every policy"
    )


def trace_refusing_structure_errors(trace: Callable[[], T], policy: str, given: TreesGiven | None = None) -> T:
    """``trace()`` (a loss or step traced under remat ``policy``), an error on the structure of a tree given
    once for every policy raised as :func:`structure_error`'s one line: what plan and verify both refuse.

    Example:
      >>> trace_refusing_structure_errors(lambda: 1, "full")
      1
      >>> def renamed():
      ...     raise ValueError("pytree structure error: different types at key path")
      >>> trace_refusing_structure_errors(renamed, "full")
      Traceback (most recent call last):
      ...
      ValueError: the loss under remat policy 'full' does not take the params given (ValueError: pytree structure error: different types at key path): this policy changes the params' structure, so pass params as a params builder, params=lambda policy: <the params of the model built under that policy> (a callable policy -> tree), instead of one tree for every policy
    """
    try:
        return trace()
    except Exception as error:  # jax's, Equinox's, Flax's or the contract's error on a tree's structure
        refused = structure_error(error, policy, given)
        if refused is None:
            raise
        raise refused from error


#: What each builder builds, in the refusal's words.
_WHAT = {"params": "params", "model_state": "model state"}


def batch_statistics_notes(
    model_state: Any, num_microbatches: int, batch_size: int, min_rows: int | None = None
) -> tuple[str, ...]:
    """The plan's notes on a model state: microbatching changes batch statistics (and ``min_rows``,
    the fewest rows a microbatch was planned with, where it left counts out). A model state with
    no leaves holds no statistics.

    Example:
      >>> batch_statistics_notes(None, 4, 32), batch_statistics_notes({}, 4, 32)
      ((), ())
      >>> print(batch_statistics_notes({"mean": 0.0}, 4, 32)[0][:72])
      microbatching changes batch statistics: the chosen 4 microbatches each c
      >>> print(batch_statistics_notes({"mean": 0.0}, 2, 32, 16)[0][-94:])
      microbatches of fewer than 16 rows were not planned (SearchSpace.min_microbatch_rows, 16 here)
    """
    if not jax.tree.leaves(model_state):
        return ()
    bound = "bound it with SearchSpace(max_microbatches=...)"
    if num_microbatches > 1:
        rows = batch_size // num_microbatches
        note = (
            f"microbatching changes batch statistics: the chosen {num_microbatches} microbatches each "
            f"compute the model state's batch statistics (BatchNorm) over {rows} rows, not over the "
            f"batch of {batch_size}; {bound} (max_microbatches=1 keeps whole-batch statistics)"
        )
    else:
        note = (
            "microbatching changes batch statistics: with a model state (BatchNorm), a candidate of m "
            f"microbatches computes them over batch/m rows; the chosen setting has one microbatch; {bound}"
        )
    if min_rows is not None and min_rows > 1 and batch_size > min_rows:
        note += (
            f"; microbatches of fewer than {min_rows} rows were not planned "
            f"(SearchSpace.min_microbatch_rows, {min_rows} here)"
        )
    return (note,)
