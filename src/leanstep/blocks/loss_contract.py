r"""What a loss function takes and returns: one value, read once per call of the loss.

Four independent choices, each a field of :class:`LossContract`:

.. code-block:: text

    field           loss_fn's arguments                         loss_fn returns
    (none)          (params, batch)                             loss
    has_aux         -                                           (that, aux)
    token_weighted  -                                           (loss_sum, count) in place of loss
    uses_rng        ... then key                                -
    has_state       (params, model_state, batch[, key])         (that, new_model_state)

so with all four, ``loss_fn(params, model_state, batch, key)`` returns
``(((loss_sum, count), aux), new_model_state)``. :meth:`LossContract.parse` reads one output
into a :class:`LossOutput` and checks it (structure, a real floating scalar loss, a real scalar
count, a new model state of the structure and dtypes it was given) with errors that name the
field; the gradient stage, the accumulation and the sharding layer use the parsed value and
never look at the raw output again. :meth:`LossContract.check_signature` names the field a loss's
signature does not fit, and :meth:`LossContract.call_error` turns what a loss raises for a setting
(its model's Dropout handed no key, an axis name nothing binds) into one line naming it.

Size: one concern, the loss's contract: the value, its parsing, and the messages that name a
field a loss does not fit (its signature, its output, what it raises), which read each other.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from leanstep.common.checks import check_bool, check_scalar_output, same_structure, tree_difference

__all__ = ["OPTIONAL_MODEL_STATE", "LossContract", "LossOutput", "loss_contract_of"]

#: The attribute, True, of a loss that needs no model state but takes (and returns) one too, as
#: :func:`leanstep.frameworks.nnx.loss` of a stateless model: ``check_signature`` reads it without.
OPTIONAL_MODEL_STATE = "leanstep_optional_model_state"


class LossOutput(NamedTuple):
    """One call of the loss, parsed.

    Attributes:
      value: float32 scalar: the loss, or the ``loss_sum`` of a token-weighted loss.
      token_count: float32 scalar token count (token-weighted), or None. (Not ``count``:
        that would hide the tuple's ``count`` method.)
      aux: the aux output (``has_aux``), or None.
      model_state: the new model state (``has_state``) in the old state's dtypes, or None.
    """

    value: jax.Array
    token_count: jax.Array | None
    aux: Any
    model_state: Any


@dataclasses.dataclass(frozen=True)
class LossContract:
    """What a loss function takes and returns (see the module doc).

    Attributes:
      has_aux: the loss returns ``(out, aux)``; aux comes back stacked over microbatches.
      token_weighted: the loss returns ``(loss_sum, count)``: the batch's loss is
        ``sum(loss_sum) / sum(count)``, not a mean of microbatch means.
      uses_rng: the loss takes a PRNG key as its last argument.
      has_state: the loss takes a model state after the params and returns
        ``(out, new_model_state)``.

    Raises:
      TypeError: a field that is not a bool.

    Example:
      >>> import jax.numpy as jnp
      >>> contract = LossContract(has_aux=True)
      >>> contract.expected
      '(loss, aux)'
      >>> contract.parse((jnp.float32(2.0), {"acc": 1}))
      LossOutput(value=Array(2., dtype=float32), token_count=None, aux={'acc': 1}, model_state=None)
    """

    has_aux: bool = False
    token_weighted: bool = False
    uses_rng: bool = False
    has_state: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, check_bool(field.name, getattr(self, field.name)))

    @property
    def flags(self) -> str:
        """The fields that are set, as keywords: ``"has_aux=True and token_weighted=True"``."""
        on = [f"{field.name}=True" for field in dataclasses.fields(self) if getattr(self, field.name)]
        return " and ".join(on)

    @property
    def expected(self) -> str:
        """What the loss must return, as a structure: ``"((loss_sum, count), aux)"``."""
        out = self._without_state()
        return f"({out}, new_model_state)" if self.has_state else out

    def _without_state(self) -> str:
        out = "(loss_sum, count)" if self.token_weighted else "loss"
        return f"({out}, aux)" if self.has_aux else out

    def arguments(self, params: Any, model_state: Any, batch: Any, key: Any = None) -> tuple[Any, ...]:
        """The loss's positional arguments: ``(params, [model_state,] batch[, key])``."""
        return (params, *((model_state,) if self.has_state else ()), batch, *((key,) if self.uses_rng else ()))

    def check_signature(self, loss_fn: Any) -> None:
        """Raises if ``loss_fn`` cannot take :meth:`arguments`, naming the field that would fit.

        A callable whose signature Python cannot read (a builtin) is let through. Where setting or
        dropping ``uses_rng`` or ``has_state`` would fit, the message says which.

        Raises:
          TypeError: ``loss_fn`` takes fewer or more positional arguments than the contract passes.

        Example:
          >>> LossContract().check_signature(lambda params, batch, key: 0.0)
          Traceback (most recent call last):
          ...
          TypeError: loss_fn(params, batch, key) cannot be called as loss_fn(params, batch): has_state=True passes the model state after params, uses_rng=True passes a PRNG key last; it takes a PRNG key last: pass uses_rng=True (make_train_step's keyword, or loss=leanstep.LossContract(uses_rng=True))
        """
        try:
            signature = inspect.signature(loss_fn)
        except (TypeError, ValueError):
            return
        if self.has_state and getattr(loss_fn, OPTIONAL_MODEL_STATE, False):
            dataclasses.replace(self, has_state=False).check_signature(loss_fn)
            return
        if _binds(signature, self._argument_names()):
            return
        said = f" ({self.flags})" if self.flags else ""
        raise TypeError(
            f"loss_fn{signature} cannot be called as loss_fn({', '.join(self._argument_names())}){said}: "
            "has_state=True passes the model state after params, uses_rng=True passes a PRNG key last; "
            f"{self._signature_fix(signature)}"
        ) from None

    def _signature_fix(self, signature: inspect.Signature) -> str:
        """What to change so that a loss of ``signature`` fits: the ``uses_rng``/``has_state`` that would."""
        fits = [
            other
            for other in (
                dataclasses.replace(self, uses_rng=rng, has_state=state)
                for rng in (False, True)
                for state in (False, True)
            )
            if other != self and _binds(signature, other._argument_names())
        ]
        if len(fits) > 1:  # three arguments fit either: the last one's name says whether it is a key
            last = list(signature.parameters)[-1].lower()
            fits = [c for c in fits if c.uses_rng == any(word in last for word in ("key", "rng", "seed"))]
        if len(fits) != 1:
            return (
                "set exactly the ones the loss takes (make_train_step's keywords, or loss=leanstep.LossContract(...))"
            )
        changes = [
            _FIXES[name, getattr(fits[0], name)]
            for name in ("uses_rng", "has_state")
            if getattr(fits[0], name) != getattr(self, name)
        ]
        fields = ", ".join(
            f"{field.name}=True" for field in dataclasses.fields(fits[0]) if getattr(fits[0], field.name)
        )
        return f"{'; '.join(changes)} (make_train_step's keyword, or loss=leanstep.LossContract({fields}))"

    def call_error(self, error: BaseException) -> Exception | None:
        """A leanstep error for what ``loss_fn`` raised while traced, where a setting is the cause; else None.

        A model that needs a PRNG key it was not handed (Flax's ``InvalidRngError``, an NNX or
        Equinox ``Dropout`` without ``rngs``/``key``) names ``uses_rng``; a collective over an axis
        name nothing binds (a module written for ``pmap``, ``nn.BatchNorm(axis_name="batch")``)
        names the ``axis_name=`` that binds it.

        Example:
          >>> print(LossContract().call_error(RuntimeError("Dropout requires a key when running in non-deterministic mode.")))
          loss_fn's model needs a PRNG key (Dropout requires a key when running in non-deterministic mode) and none is handed to it: pass uses_rng=True, so that leanstep passes loss_fn(params, batch, key), and hand the key to the model (Linen: module.apply(..., rngs={'dropout': key}); NNX: nnx.Rngs(dropout=key); Equinox: key=key)
        """
        text = str(error).split("\n")[0].split(" (https://")[0].strip().rstrip(".")
        needs_key = (
            type(error).__name__ == "InvalidRngError"
            or (isinstance(error, ValueError) and "no `rngs` argument was provided" in text)
            or (isinstance(error, RuntimeError) and "requires a key" in text)
        )
        if needs_key:
            collection = re.search(r'needs PRNG for "([^"]+)"', text)
            hand = (
                f"hand the key to the model (Linen: module.apply(..., rngs={{{collection[1] if collection else 'dropout'!r}: "
                "key}); NNX: nnx.Rngs(dropout=key); Equinox: key=key)"
            )
            if self.uses_rng:
                return ValueError(
                    f"loss_fn's model needs a PRNG key ({text}): uses_rng=True passes loss_fn one last; {hand}"
                )
            with_key = dataclasses.replace(self, uses_rng=True)._argument_names()
            return ValueError(
                f"loss_fn's model needs a PRNG key ({text}) and none is handed to it: pass uses_rng=True, so "
                f"that leanstep passes loss_fn({', '.join(with_key)}), and {hand}"
            )
        unbound = re.search(r"unbound axis name: ([^\s.,]+)", text) if isinstance(error, NameError) else None
        if unbound:
            return ValueError(unbound_axis_message(unbound[1], "loss_fn"))
        return None

    def _argument_names(self) -> tuple[str, ...]:
        return self.arguments("params", "model_state", "batch", "key")

    def parse(self, out: Any, model_state: Any = None) -> LossOutput:
        """One output of the loss, checked (at trace time: structure, shapes and dtypes are static).

        Args:
          out: what the loss returned.
          model_state: the model state the loss was given (``has_state``): the new one must
            have its structure, leaf shapes and dtypes (a scan carry keeps its type).

        Raises:
          TypeError: ``out`` is not of the :attr:`expected` structure, the loss is not a real
            floating scalar or the count not a real scalar, or the new model state is of
            another structure, leaf shape or dtype (named by its leaf path).
          ValueError: the loss or the count is not a scalar.
        """
        new_state = None
        if self.has_state:
            out, new_state = _pair(out, "has_state=True: loss_fn must return (out, new_model_state)", out)
            new_state = _keep_state_types(new_state, model_state)
        whole, aux, count = out, None, None
        if self.has_aux:
            out, aux = _pair(out, self._structure_error(), whole)
        if self.token_weighted:
            out, count = _pair(out, self._structure_error(), whole)
            count = check_scalar_output(
                "token_weighted=True: loss_fn's count", count, integer=True, reduce="jnp.sum(mask)"
            ).astype(jnp.float32)
        if isinstance(out, tuple):  # a structure no field of the contract says: name the fields that would
            raise TypeError(self._tuple_error(out))
        name = "loss_fn's loss_sum" if self.token_weighted else "loss_fn's loss"
        value = check_scalar_output(name, out, reduce="jnp.sum" if self.token_weighted else "jnp.mean")
        return LossOutput(value.astype(jnp.float32), count, aux, new_state)

    def _tuple_error(self, out: tuple) -> str:
        hints = [
            (field, shape)
            for field, shape in (
                ("has_aux", "(loss, aux)"),
                ("token_weighted", "(loss_sum, count)"),
                ("has_state", "(out, new_model_state)"),
            )
            if not getattr(self, field)
        ]
        said = f" ({self.flags})" if self.flags else ""
        ways = "; ".join(f"{shape} needs {field}=True" for field, shape in hints)
        return (
            f"loss_fn's loss must be a real floating scalar, got a tuple of {len(out)}{said}: a loss that "
            f"returns {ways} (make_train_step's keyword, or loss=leanstep.LossContract(...))"
        )

    def _structure_error(self) -> str:
        flags = " and ".join(f"{name}=True" for name in ("has_aux", "token_weighted") if getattr(self, name))
        return f"{flags}: loss_fn must return {self._without_state()}"


#: What to change, by field and whether the loss takes that argument (:meth:`LossContract.check_signature`).
_FIXES = {
    ("uses_rng", True): "it takes a PRNG key last: pass uses_rng=True",
    ("uses_rng", False): "it takes no PRNG key: drop uses_rng=True, or give loss_fn a key argument last",
    ("has_state", True): "it takes a model state after params: pass has_state=True",
    ("has_state", False): "it takes no model state: drop has_state=True, or give loss_fn a model_state after params",
}


def unbound_axis_message(name: str, where: str, given: str | None = None) -> str:
    """The error for a collective over axis ``name`` that nothing binds (a module written for ``pmap``);
    ``given``: the ``axis_name=`` that was bound instead."""
    instead = f" (axis_name={given!r} was given: another name)" if given is not None else ""
    return (
        f"{where} reduces over the axis name {name!r} (a module written for pmap, such as "
        f"nn.BatchNorm(axis_name={name!r})), which nothing binds{instead}: leanstep hands the loss the whole "
        f"(micro)batch, so pass axis_name={name!r} to leanstep.frameworks.linen.apply (the module's "
        f"axis_name=), or call an Equinox model under jax.vmap(..., axis_name={name!r})"
    )


def _binds(signature: inspect.Signature, names: tuple[str, ...]) -> bool:
    """Whether a callable of ``signature`` takes ``names`` as positional arguments."""
    try:
        signature.bind(*names)
    except TypeError:
        return False
    return True


def _pair(out: Any, message: str, whole: Any) -> tuple[Any, Any]:
    """``out``'s two entries; TypeError ``message`` (saying what ``whole`` is) if it is not a pair."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{message}, got {_what(whole, message)}")
    return out[0], out[1]


def _what(value: Any, message: str) -> str:
    """``value`` in words: a loss's output is often a tracer, whose class name says nothing."""
    shape = getattr(value, "shape", None) if hasattr(value, "dtype") else None
    if shape == () or isinstance(value, (int, float)):  # token-weighted: mostly a mean for (loss_sum, count)
        hint = " (a mean? return (jnp.sum(losses * mask), jnp.sum(mask)))" if "token_weighted=True" in message else ""
        return f"a scalar{hint}"
    return type(value).__name__ if shape is None else f"an array of shape {tuple(shape)}"


def _keep_state_types(new: Any, old: Any) -> Any:
    """``new`` state in ``old``'s structure and dtypes: a scan carry must keep its type."""
    if not same_structure(new, old):
        raise TypeError(
            "has_state=True: loss_fn must return a new model state of the structure it was given; "
            f"got {jax.tree.structure(new)}, expected {jax.tree.structure(old)}"
        )
    # A scan carry must keep its type, and one microbatch (no scan) must not differ from many: a leaf
    # of a new dtype (cast back, it would lose what the loss computed) or shape is refused, named.
    difference = tree_difference(new, old, "new model_state", "model_state")
    if difference is not None:
        raise TypeError(
            "has_state=True: loss_fn must return a new model state of the shapes and dtypes it was given "
            f"(leanstep keeps them between steps and microbatches); {difference}"
        )
    return jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.result_type(o)), new, old)


def check_aux(aux: Any) -> None:
    """has_aux's aux must be a pytree of arrays and numbers: the step stacks it over microbatches."""
    for leaf in jax.tree.leaves(aux):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) and not isinstance(
            leaf, (bool, int, float, complex)
        ):
            raise TypeError(
                f"has_aux=True: loss_fn's aux must be a pytree of arrays and numbers (it is stacked over "
                f"microbatches), got a {type(leaf).__name__} leaf: {leaf!r:.40}"
            )


def loss_contract_of(loss: LossContract | None, flags: dict[str, bool]) -> LossContract:
    """``loss``, or the contract of the short-form ``flags`` given (``has_aux=True``, ...) when None.

    Raises:
      TypeError: ``loss`` neither None nor a :class:`LossContract`.
      ValueError: ``loss`` and ``flags`` both given (one setting, spelled once).
    """
    if loss is None:
        return LossContract(**flags)
    if not isinstance(loss, LossContract):
        raise TypeError(f"loss must be a leanstep.LossContract, got {type(loss).__name__}")
    if flags:
        raise ValueError(f"give {', '.join(sorted(flags))} inside loss=LossContract(...), not beside it")
    return loss
