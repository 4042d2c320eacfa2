"""leanstep's own step as a :class:`~leanstep.verification.protocol.VerifiableStep`.

:class:`LeanstepStep` takes what :func:`leanstep.planning.plan` takes (a loss builder per remat policy,
params, a batch, the step's settings) and builds :func:`leanstep.make_train_step` steps on
demand, one compiled program per ``(num_microbatches, max_grad_norm, randomness, mesh)``,
never donating (a check runs several steps from one state). With ``randomness=False`` a loss
that takes a key gets the same key in every microbatch, so that its dropout masks are a function
of the rows alone. A model with int8 matmuls names its recipe (``int8``) and its loss builder
takes it; :meth:`LeanstepStep.variant` is then the same step without them, or in float32 compute
(the int8 checks compare the step with both).

Size: one class, leanstep's step as the checks drive it: its settings, the programs and losses
it builds from them (no random numbers, no int8, a row made non-finite) and its variants.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> def make_loss(policy):
  ...     return lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  >>> batch = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 1), np.float32)}
  >>> setup = LeanstepStep(make_loss, {"w": jnp.ones((2, 1))}, batch, StepSpec(accumulation=Accumulation(2)))
  >>> state = setup.init(probe_optimizer(), max_grad_norm=None, seed=0, randomness=True, mesh=None)
  >>> state, metrics = setup.step(state, batch, 2)
  >>> float(metrics["loss"]), seen_gradient(setup.parts(state)["opt_state"])["w"].tolist()
  (4.0, [[4.0], [4.0]])
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from leanstep.blocks.accumulation import Accumulation  # noqa: F401 - the doctest's name
from leanstep.blocks.fp8_state import merge_fp8, split_fp8
from leanstep.blocks.layer_stack import LayerStack
from leanstep.blocks.precision import Precision
from leanstep.common.removed import refuses_removed_keywords
from leanstep.inspection.auditing import audit
from leanstep.planning.plan_inputs import TreesGiven, is_params_builder, params_for, trace_refusing_structure_errors
from leanstep.step.sharding_layer import ShardingLayer
from leanstep.step.spec import StepSpec
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step
from leanstep.verification.batches import batch_rows, poison_row, rows_of, with_leaf
from leanstep.verification.protocol import probe_optimizer, seen_gradient  # noqa: F401 - the doctest's names

__all__ = ["LeanstepStep", "ModelExtras"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["train_state"], meta_fields=["settings"])
@dataclasses.dataclass(frozen=True)
class BoundState:
    """A :class:`leanstep.TrainState` and the settings (static) of the step that runs it."""

    train_state: TrainState
    settings: tuple[Any, ...]


def _fixed_key(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn`` with its key argument (the last) replaced by ``PRNGKey(0)`` in every call."""

    def loss(*args: Any) -> Any:
        return loss_fn(*args[:-1], jax.random.PRNGKey(0))

    return loss


@dataclasses.dataclass(frozen=True)
class ModelExtras:
    """What a model offers beyond its loss, for the checks that need it (each None: those checks
    lay the step out without it, or do not apply).

    Attributes:
      rules: the model's partition rules, for a mesh with a ``"tensor"`` axis
        (:class:`leanstep.step.ShardingLayer`; a ``"fsdp"`` axis splits every parameter, other axes
        carry rows): the ``meshes`` checks.
      layer_stack: the loss as a :class:`leanstep.LayerStack` (its ``(sum, count)`` form where the
        loss is token-weighted): the ``in_backward`` check.
    """

    rules: Any = None
    layer_stack: LayerStack | None = None


class LeanstepStep:
    """leanstep's step for the inputs :func:`leanstep.planning.plan` takes (see the module doc).

    The step is ``spec``'s, with what the checks set themselves: the clip (``init``'s
    ``max_grad_norm``), the microbatch count, the mesh and no donation; its moments kept float32
    and no spike guard (the probe optimizer records the gradient exactly, and every step a check
    compares is applied); the standard step (the ``in_backward`` check runs the other).

    Args:
      make_loss_fn: ``make_loss_fn(remat_policy) -> loss_fn``, the loss under a remat policy;
        ``make_loss_fn(remat_policy, random=False)`` if it takes ``random``: a loss that draws no
        random numbers (see :meth:`loss_fn`).
      params: the float32 parameters (arrays), FP8 state included if the model has any; or, for a
        model whose remat policy changes the parameters' structure (Flax Linen's ``nn.remat``
        renames its modules), a params builder ``params(remat_policy) -> params``, as
        :func:`leanstep.planning.plan` takes.
      batch: one global batch (arrays; leaves share the leading row dimension).
      spec: the run's :class:`leanstep.StepSpec` (None: ``StepSpec()``): its precision, loss
        contract, accumulation (the run's microbatch count; split ``"contiguous"`` or
        ``"strided"``), loss scale and masters; its ``int8``, the recipe of the model's int8
        matmuls: ``make_loss_fn`` then takes ``int8`` (``make_loss_fn(policy, int8=recipe)``) and
        builds the model with that recipe, or without int8 matmuls for None (:meth:`variant`).
      remat: the remat policy ``make_loss_fn`` is given.
      model_state: the model's state (with ``spec.loss.has_state``), or None.
      mask: the name of the batch's token-weight leaf (floating, rows first), or None; the
        non-finite check makes a row's weights NaN.
      extras: the model's partition rules and LayerStack (:class:`ModelExtras`).

    Raises:
      TypeError: ``spec`` not a StepSpec; a setting 0.11 took as a keyword (``precision=``, ...: the
        message names ``spec=``).
      ValueError: a split other than contiguous or strided; ``spec.int8`` with a ``make_loss_fn`` that
        does not take ``int8``; a batch with no floating leaf that is not a dict.
    """

    @refuses_removed_keywords("LeanstepStep")
    def __init__(
        self,
        make_loss_fn: Callable[[str], Callable[..., Any]],
        params: Any,
        batch: Any,
        spec: StepSpec | None = None,
        *,
        remat: str = "none",
        model_state: Any = None,
        mask: str | None = None,
        extras: ModelExtras = ModelExtras(),
    ) -> None:
        spec = StepSpec() if spec is None else spec
        if not isinstance(spec, StepSpec):
            raise TypeError(f"spec must be a leanstep.StepSpec or None, got {type(spec).__name__}")
        if spec.accumulation.split not in ("contiguous", "strided"):
            raise ValueError(
                f"spec.accumulation: expected the split 'contiguous' or 'strided', got {spec.accumulation.split!r}"
            )
        self._given = dict(params=params, batch=batch, remat=remat, model_state=model_state, mask=mask, extras=extras)
        # The checks' own: clip, microbatches, mesh, donation; the probe's record exact, every step applied.
        self.spec = spec.replace(
            donate=False, sharding=None, spike_guard=None, moments="float32", update_in_backward=False
        )
        self.make_loss_fn = make_loss_fn
        self.params_builder = params if is_params_builder(params) else None
        self.params = params_for(params, remat)
        self.given = TreesGiven.of(params, model_state)  # one tree for every policy, or builders
        self.batch = batch
        self.precision = spec.precision
        self.num_microbatches = spec.accumulation.num_microbatches
        self.remat = remat
        self.loss = spec.loss
        self.loss_scale = spec.loss_scale
        self.model_state = model_state
        self.master = spec.master
        self.weights_leaf = mask
        self.mask = mask if self.loss.token_weighted else None  # the protocol's: a token-weighted loss's weights
        self.split = str(spec.accumulation.split)
        self.rules = extras.rules
        self.compute_dtype = self.precision.compute_dtype
        self.int8 = spec.int8
        self.layer_stack = extras.layer_stack
        if self.int8 is not None and "int8" not in inspect.signature(make_loss_fn).parameters:
            raise ValueError(
                f"int8={self.int8.to_string()!r}: make_loss_fn must take int8 (make_loss_fn(policy, int8=recipe)), "
                "the recipe its model's int8 matmuls run with (None: none), for verify to build the step without them"
            )
        self.poison_leaf: str | None = None
        if mask is None and not _has_floating_leaf(batch):
            if not isinstance(batch, dict):
                raise ValueError(
                    "batch: a batch with no floating leaf must be a dict (verify adds a poison leaf to it)"
                )
            self.poison_leaf = POISON_LEAF
            self.batch = {**batch, POISON_LEAF: np.zeros(batch_rows(batch), np.float32)}
        self._steps: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._meshes: dict[int, Any] = {}

    def init(
        self,
        optimizer: optax.GradientTransformation,
        *,
        max_grad_norm: float | None,
        seed: int,
        randomness: bool,
        mesh: Any,
    ) -> BoundState:
        """The step-0 :class:`leanstep.TrainState`, bound to the settings of its step."""
        state = TrainState.create(self.params, optimizer, self.spec, seed=seed, model_state=self.model_state)
        if mesh is not None:
            self._meshes[id(mesh)] = mesh
        randomness = randomness or not (self.loss.uses_rng or self._takes_random)  # one program if nothing is random
        return BoundState(state, (max_grad_norm, randomness, None if mesh is None else id(mesh)))

    @functools.cached_property
    def rounding_dtype(self) -> Any:
        """The coarsest format the step's gradients are rounded to between two programs: ``float8_e5m2``
        where a matmul quantizes by its tensors' current amax (each microbatch and each device its own
        scale), else the compute dtype."""
        fn, args = self.microbatch_loss(self.remat)  # the trees given fit this policy's loss, maybe no other's
        scales = {m.scale for m in audit(fn, *args).matmuls}
        return jnp.dtype("float8_e5m2") if "current" in scales else self.compute_dtype

    @property
    def token_weighted(self) -> bool:
        """The loss is token-weighted (``loss.token_weighted``), its mask named or not."""
        return self.loss.token_weighted

    def token_counts(self, microbatches: list[Any]) -> list[float] | None:
        """Each microbatch's token count as the loss counts it (its ``count``), for a token-weighted
        loss whose mask is not named (None otherwise: the mask, or no count, says it)."""
        if not self.loss.token_weighted or self.mask is not None:
            return None
        fn, args = self.microbatch_loss(self.remat)
        position = 1 + int(self.loss.has_state)  # (params[, model_state], rows[, key])

        def count(rows: Any) -> jax.Array:
            out = self.loss.parse(fn(*args[:position], rows, *args[position + 1 :]), args[1] if position == 2 else None)
            return jnp.asarray(out.token_count, jnp.float32)

        counted = jax.jit(count)
        return [float(counted(rows)) for rows in microbatches]

    def params_under(self, policy: str) -> Any:
        """The params the loss under remat ``policy`` takes (the builder's, where one was given)."""
        return self.params if self.params_builder is None else params_for(self.params_builder, policy)

    def check_structure(self) -> None:
        """Traces one microbatch's loss under the remat policy (nothing runs).

        Raises:
          ValueError: the loss under the policy does not take the params (or model state) given as
            one tree: plan's line (:func:`leanstep.planning.plan_inputs.trace_refusing_structure_errors`).
        """
        fn, args = self.microbatch_loss(self.remat)

        def trace() -> Any:
            try:
                return jax.eval_shape(fn, *args)
            except KeyError as error:  # a dict of params whose keys the policy renamed
                raise ValueError(f"structure: {error}") from error

        trace_refusing_structure_errors(trace, self.remat, self.given)

    def reference_loss(self, params: Any, parts: Mapping[str, Any], batch: Any) -> tuple[jax.Array, Any]:
        """The loss of ``batch`` as the user wrote it, unscaled, at float32 ``params`` (the trainable
        part; the FP8 state from ``parts``): the token-weighted mean ``sum / count`` for a
        token-weighted loss; no random numbers; and the model state it returns."""
        fp8 = parts.get("fp8")
        full = params if fp8 is None else merge_fp8(params, fp8)
        model_state = parts.get("model_state")
        loss_fn = self.loss_fn(self.remat, random=False)
        out = self.loss.parse(
            loss_fn(*self.loss.arguments(full, model_state, batch, jax.random.PRNGKey(0))), model_state
        )
        value = out.value / out.token_count if out.token_count is not None else out.value
        return value, out.model_state

    @property
    def keyed_by_shape(self) -> bool:
        """The loss draws random numbers from its key even with ``randomness=False`` (one fixed key):
        masks shaped like the microbatch, so one microbatch of ``B`` rows is not ``M`` of ``B / M``."""
        return self.loss.uses_rng and not self._takes_random

    @property
    def _takes_random(self) -> bool:
        return "random" in inspect.signature(self.make_loss_fn).parameters

    def loss_fn(self, policy: str, *, random: bool = True) -> Callable[..., Any]:
        """The loss under remat ``policy``; with ``random=False`` one that draws no random numbers:
        ``make_loss_fn(policy, random=False)`` where it takes ``random`` (a model whose random
        numbers come from its own state, such as Flax NNX's ``Rngs``, says so there), else, for a
        loss that takes a key, the same key in every call."""
        settings: dict[str, Any] = {"random": random} if self._takes_random else {}
        if "int8" in inspect.signature(self.make_loss_fn).parameters:
            settings["int8"] = self.int8
        loss_fn = self.make_loss_fn(policy, **settings)
        if not self._takes_random and self.loss.uses_rng and not random:
            loss_fn = _fixed_key(loss_fn)
        if self.poison_leaf is not None:
            loss_fn = _poisonable(loss_fn, self.poison_leaf, 2 if self.loss.has_state else 1)
        return loss_fn

    def variant(self, **changes: Any) -> LeanstepStep:
        """The same step (loss builder, params, batch, settings) with ``int8`` (a recipe; None: the model's
        matmuls in the compute dtype) or ``compute_dtype`` (the outputs at least as wide) changed.

        Raises:
          TypeError: another setting.
        """
        unknown = sorted(set(changes) - {"int8", "compute_dtype"})
        if unknown:
            raise TypeError(f"variant: unknown settings {unknown}; expected among ['compute_dtype', 'int8']")
        given, spec = dict(self._given), self.spec.replace(int8=changes.get("int8", self.int8))
        if "int8" in changes:  # the stack was built with the model's recipe
            given["extras"] = dataclasses.replace(given["extras"], layer_stack=None)
        if "compute_dtype" in changes:
            p, dtype = self.precision, jnp.dtype(changes["compute_dtype"])
            spec = spec.replace(
                precision=Precision(p.param_dtype, dtype, jnp.promote_types(p.output_dtype, dtype), strict=p.strict)
            )
        return LeanstepStep(self.make_loss_fn, given.pop("params"), given.pop("batch"), spec, **given)

    def make_step(self, settings: tuple[Any, ...], num_microbatches: int) -> Callable[..., Any]:
        """The compiled step of these settings (built once, kept)."""
        key = (*settings, num_microbatches)
        if key not in self._steps:
            max_grad_norm, randomness, mesh_id = settings
            loss_fn = self.loss_fn(self.remat, random=randomness)
            mesh = None
            if mesh_id is not None:
                mesh = ShardingLayer(self._meshes[mesh_id], rules=self.rules)
            accumulation = dataclasses.replace(self.spec.accumulation, num_microbatches=num_microbatches)
            spec = self.spec.replace(accumulation=accumulation, max_grad_norm=max_grad_norm)
            self._steps[key] = make_train_step(loss_fn, spec, mesh=mesh)
        return self._steps[key]

    def step(self, state: BoundState, batch: Any, num_microbatches: int) -> tuple[BoundState, Mapping[str, Any]]:
        """One step of the bound settings over ``batch`` in ``num_microbatches`` microbatches."""
        step = self.make_step(state.settings, num_microbatches)
        new, metrics = step(state.train_state, batch)
        read = {
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
            "skipped": metrics.skipped,
            "loss_scale": metrics.loss_scale,
        }
        return BoundState(new, state.settings), read

    def parts(self, state: BoundState) -> Mapping[str, Any]:
        """``params`` (trainable), ``opt_state``, ``model_state`` and ``fp8`` (None where absent)."""
        train_state = state.train_state
        trainable, fp8 = split_fp8(train_state.params)
        return {
            "params": trainable,
            "opt_state": train_state.opt_state,
            "model_state": train_state.model_state,
            "fp8": fp8 if jax.tree.leaves(fp8) else None,
        }

    def poison(self, batch: Any, row: int) -> Any:
        """NaN in row ``row``'s token weights (``mask``), else in its floating inputs."""
        leaf = self.weights_leaf or self.poison_leaf
        if leaf is not None:
            weights = np.array(np.asarray(batch[leaf]), copy=True)
            weights[row] = np.nan
            return with_leaf(batch, leaf, weights)
        return poison_row(batch, row)

    def microbatch_loss(self, policy: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """One microbatch's loss under remat ``policy``, in the compute dtype, and its arguments
        (params, model state, rows, key as the loss takes them): what the residual report traces."""
        loss_fn = self.loss_fn(policy, random=False)
        rows = max(1, batch_rows(self.batch) // self.num_microbatches)
        microbatch = self.precision.cast_to_compute(rows_of(self.batch, list(range(rows))))
        trainable, fp8 = split_fp8(self.params_under(policy))
        params_c = merge_fp8(self.precision.cast_to_compute(trainable), fp8)
        args: tuple[Any, ...] = (params_c,)
        if self.loss.has_state:
            args += (self.model_state,)
        args += (microbatch,)
        if self.loss.uses_rng:
            args += (jax.random.PRNGKey(0),)
        return loss_fn, args


#: The leaf verify adds to a batch that has no floating leaf, to carry a NaN into one row's microbatch.
POISON_LEAF = "verify_poison"


def _has_floating_leaf(batch: Any) -> bool:
    return any(np.issubdtype(np.asarray(leaf).dtype, np.floating) for leaf in jax.tree.leaves(batch))


def _poisonable(loss_fn: Callable[..., Any], leaf: str, batch_index: int) -> Callable[..., Any]:
    r"""``loss_fn`` on params :math:`p + 0 \cdot s`, ``s`` the sum of the microbatch's ``leaf`` (then
    removed from the batch): exactly ``p`` while ``s`` is 0, NaN (and so NaN gradients) once a row
    of the microbatch carries a NaN."""

    def loss(params: Any, *args: Any) -> Any:
        batch = args[batch_index - 1]
        poison = jnp.sum(batch[leaf].astype(jnp.float32)) * 0
        rest = {k: v for k, v in batch.items() if k != leaf}
        params = jax.tree.map(lambda p: p + poison.astype(p.dtype), params)
        return loss_fn(params, *args[: batch_index - 1], rest, *args[batch_index:])

    return loss
