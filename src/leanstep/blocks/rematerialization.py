r"""Rematerialization: named ``jax.checkpoint`` policies, and :func:`remat` to apply them.

Reverse-mode autodiff keeps some forward-pass values alive (the *residuals*) so the
backward pass can use them. ``jax.checkpoint`` trades memory for compute: values its
policy does not save are recomputed from the saved ones during the backward pass.
This module names the common policies.

.. code-block:: text

    policy              saved for the backward pass                  recomputed
    "none"              everything autodiff needs (no checkpoint)    nothing
    "full"              only the inputs of the wrapped function      the whole forward pass
    "dots"              dot_general / conv outputs                   elementwise ops (tanh, ...)
    "dots_no_batch"     dot_generals without batch dimensions        elementwise ops and
                        (x @ W, not einsum('bij,bjk->bik'))          batched matmuls
    "save:NAME1,NAME2"  only values tagged checkpoint_name(v, NAME)  everything else

For a residual MLP block :math:`y = x + \tanh(x W_1 + b_1) W_2 + b_2` with
:math:`t = \tanh(x W_1 + b_1)`:

- ``"none"`` keeps :math:`t` and :math:`1 - t` (``tanh' = (1 - t)(1 + t)``);
- ``"dots"`` keeps :math:`x W_1` and recomputes :math:`t` in the backward pass;
- ``"full"`` keeps only :math:`x, W_1, b_1, W_2` and reruns the block.

Use :func:`leanstep.inspection.residuals.saved_residuals_report` to see, per policy, which values
are saved and how many bytes they take. Equal gradients cannot show that anything was
recomputed; the report (and the gradient jaxpr) can.

A ``"save:NAME"`` policy whose name the function never tags would save nothing, silently;
:func:`check_saved_names` finds that in a traced program, and the train step and
:func:`leanstep.inspection.audit` run it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from leanstep.common.checks import check_bool
from leanstep.common.jaxprs import equations, is_remat_primitive, sub_jaxprs

__all__ = ["REMAT_POLICIES", "check_saved_names", "checkpoint_name", "get_remat_policy", "remat"]

_POLICIES = jax.checkpoint_policies

#: Policy names accepted by :func:`get_remat_policy` and :func:`remat`, besides the
#: ``"save:NAME1,NAME2"`` form and a raw JAX policy callable.
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots", "dots_no_batch")

_SAVE_PREFIX = "save:"

_NAMED_POLICIES: dict[str, Callable[..., Any]] = {
    "full": _POLICIES.nothing_saveable,
    "dots": _POLICIES.dots_saveable,
    "dots_no_batch": _POLICIES.dots_with_no_batch_dims_saveable,
}

# Factories that build a policy: passing one uncalled is always a mistake, and a
# silent one (the factory is callable and its return value is truthy).
_POLICY_FACTORIES = tuple(
    getattr(_POLICIES, name, None)
    for name in (
        "save_only_these_names",
        "save_any_names_but_these",
        "save_anything_except_these_names",
        "save_from_both_policies",
        "offload_dot_with_no_batch_dims",
        "save_and_offload_only_these_names",
    )
)


def get_remat_policy(policy: str | Callable[..., Any]) -> Callable[..., Any] | None:
    """Resolve a policy name (or a raw JAX policy) to a ``jax.checkpoint`` policy.

    .. code-block:: text

        "none"          -> None   (meaning: do not wrap in jax.checkpoint at all)
        "full"          -> jax.checkpoint_policies.nothing_saveable
        "dots"          -> jax.checkpoint_policies.dots_saveable
        "dots_no_batch" -> jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        "save:a,b"      -> jax.checkpoint_policies.save_only_these_names("a", "b")
        callable        -> returned unchanged

    ``None`` means *no rematerialization*. Do not pass it on to
    ``jax.checkpoint(policy=None)``, which means the opposite (save nothing);
    :func:`remat` handles this for you.

    Args:
      policy: one of :data:`REMAT_POLICIES`, ``"save:"`` followed by comma-separated
        ``checkpoint_name`` tags (surrounding whitespace is stripped), or a JAX policy
        callable ``(prim, *avals, **params) -> bool``.

    Returns:
      The JAX policy callable, or ``None`` for ``"none"``.

    Raises:
      ValueError: ``policy`` is an unknown name, or ``"save:"`` without names.
      TypeError: ``policy`` is neither a string nor a callable, or is a policy
        factory such as ``save_only_these_names`` that was not called.

    Example:
      >>> get_remat_policy("dots") is jax.checkpoint_policies.dots_saveable
      True
      >>> get_remat_policy("none") is None
      True
      >>> get_remat_policy("save:attn, mlp_hidden")
      SaveOnlyTheseNames(saveable_names=frozenset({...}))
      >>> get_remat_policy("dot")
      Traceback (most recent call last):
      ...
      ValueError: unknown policy='dot'; expected one of 'none', 'full', 'dots', 'dots_no_batch', 'save:NAME1,NAME2' or a JAX policy callable
    """
    if isinstance(policy, str):
        if policy == "none":
            return None
        if policy in _NAMED_POLICIES:
            return _NAMED_POLICIES[policy]
        if policy.startswith(_SAVE_PREFIX):
            names = [name.strip() for name in policy[len(_SAVE_PREFIX) :].split(",")]
            if not all(names):
                raise ValueError(
                    f"policy={policy!r} names an empty checkpoint_name tag; "
                    "expected 'save:NAME1,NAME2' with one or more non-empty names"
                )
            return _POLICIES.save_only_these_names(*names)
        valid = ", ".join(repr(name) for name in (*REMAT_POLICIES, "save:NAME1,NAME2"))
        raise ValueError(f"unknown policy={policy!r}; expected one of {valid} or a JAX policy callable")
    if not callable(policy):
        raise TypeError(
            f"policy must be a policy name (str) or a JAX policy callable, got {policy!r} "
            f"of type {type(policy).__name__}; use 'none' for no remat and 'full' to save nothing"
        )
    if any(policy is factory for factory in _POLICY_FACTORIES):
        raise TypeError(
            f"policy={policy!r} is a policy factory, not a policy; call it first, e.g. "
            "jax.checkpoint_policies.save_only_these_names('name'), or pass 'save:name'"
        )
    return policy


def remat(
    fn: Callable[..., Any],
    policy: str | Callable[..., Any] = "full",
    *,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable[..., Any]:
    """Wrap ``fn`` in ``jax.checkpoint`` with a named policy (or return it for ``"none"``).

    .. code-block:: text

        remat(fn, "none")   == fn
        remat(fn, policy)   == jax.checkpoint(fn, policy=get_remat_policy(policy),
                                              prevent_cse=prevent_cse,
                                              static_argnums=static_argnums)

    Values and gradients are those of ``fn``; only what is kept between the forward
    and the backward pass changes (see :func:`leanstep.inspection.residuals.saved_residuals_report`). The policy is
    resolved and validated here, at wrap time.

    Framework modules get their framework's own checkpoint, with the same policies:

    .. code-block:: text

        remat(LinenModuleClass, p)  == flax.linen.remat(LinenModuleClass, policy=..., prevent_cse=...)
        remat(nnx_module, p)        == an nnx.Module holding nnx_module, whose __call__ runs it under
                                       nnx.remat (a bound method of an NNX module likewise): kept as an
                                       attribute of a model, its params stay the model's
        remat(equinox_module, p)    == equinox.filter_checkpoint(equinox_module, policy=..., prevent_cse=...)

    Use it as a decorator with ``functools.partial(remat, policy="dots")``. For the
    body of a ``lax.scan`` over layers pass ``prevent_cse=False``: the scan already
    keeps XLA from merging the recomputation with the forward pass, and the extra
    optimization barriers of ``prevent_cse=True`` only cost speed there (this is what
    the ``jax.checkpoint`` docs recommend).

    Args:
      fn: the function to rematerialize, or a Flax Linen module class, a Flax NNX module
        or an Equinox module.
      policy: see :func:`get_remat_policy`. Default ``"full"`` (save only inputs).
      prevent_cse: forwarded to ``jax.checkpoint``; ``False`` inside ``lax.scan``.
      static_argnums: positions of arguments that are static Python values (used in
        Python control flow inside ``fn``); forwarded to ``jax.checkpoint``.

    Returns:
      The wrapped function, or ``fn`` itself for ``policy="none"``.

    Raises:
      ValueError, TypeError: bad ``policy`` (see :func:`get_remat_policy`),
        ``prevent_cse`` not a bool, or ``static_argnums`` not an int or tuple of ints.

    Example:
      >>> import functools
      >>> import jax.numpy as jnp
      >>> @functools.partial(remat, policy="dots")
      ... def block(w, x):
      ...     return x + jnp.tanh(x @ w) @ w
      >>> w, x = jnp.eye(2) * 0.5, jnp.ones((3, 2))
      >>> loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)
      >>> g = jax.grad(loss(block))(w, x)
      >>> g_plain = jax.grad(loss(block.__wrapped__))(w, x)
      >>> bool(jnp.allclose(g, g_plain, rtol=1e-6))
      True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}")
    jax_policy = get_remat_policy(policy)
    prevent_cse = check_bool("prevent_cse", prevent_cse)
    argnums = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
    if not isinstance(argnums, tuple) or not all(type(i) is int for i in argnums):
        raise TypeError(f"static_argnums must be an int or a tuple of ints, got {static_argnums!r}")
    if jax_policy is None:
        return fn
    framework = _framework_remat(fn, jax_policy, prevent_cse, argnums)
    if framework is not None:
        return framework
    return jax.checkpoint(fn, policy=jax_policy, prevent_cse=prevent_cse, static_argnums=argnums)


def _framework_remat(
    fn: Any, policy: Callable[..., Any], prevent_cse: bool, static_argnums: tuple[int, ...]
) -> Callable[..., Any] | None:
    """The framework's own checkpoint of a module, or None for a plain function.

    ``jax.checkpoint`` cannot take a module: it hashes a Linen class's variables and an
    Equinox module's arrays. A framework that was never imported cannot have made ``fn``.
    """
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(fn, type) and issubclass(fn, linen.Module):
        return linen.remat(fn, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums)
    nnx = sys.modules.get("flax.nnx")
    owner = getattr(fn, "__self__", None)  # a bound method of an NNX module updates its state too
    if nnx is not None and (isinstance(fn, nnx.Module) or isinstance(owner, nnx.Module)):
        module, name = (fn, "__call__") if isinstance(fn, nnx.Module) else (owner, fn.__name__)
        return _nnx_remat_type(nnx)(module, name, policy, prevent_cse, static_argnums)
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(fn, eqx.Module):
        if static_argnums:
            raise TypeError(
                "static_argnums does not apply to an Equinox module: equinox.filter_checkpoint "
                "already treats every argument that is not an array as static"
            )
        return eqx.filter_checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
    return None


@functools.cache
def _nnx_remat_type(nnx: Any) -> type:
    """The NNX module type :func:`remat` gives for an NNX module (made once, from the imported ``flax.nnx``).

    An NNX module, not a function closing over one: kept as an attribute of another module, its
    module's variables stay in that model's graph (``nnx.state``, ``nnx.split``, the gradient).
    """

    class Remat(nnx.Module):
        """``module.<method>(*args, **kwargs)`` under ``nnx.remat`` with a named policy (``leanstep.blocks.remat``).

        Attributes:
          module: the rematerialized NNX module (its variables are this module's).
          method: the name of the method called, ``"__call__"`` for the module itself.
        """

        def __init__(
            self, module: Any, method: str, policy: Callable[..., Any], prevent_cse: bool, static_argnums: tuple
        ) -> None:
            self.module, self.method = module, method
            self.checkpointed = nnx.remat(
                lambda module, *args: getattr(module, method)(*args[:-1], **args[-1]),
                policy=policy,
                prevent_cse=prevent_cse,
                static_argnums=tuple(i + 1 for i in static_argnums),
            )

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # Keywords to positions here: nnx.remat cannot for (*args, **kwargs), and flax's Gemma passes rngs=.
            bound = inspect.signature(getattr(self.module, self.method)).bind(*args, **kwargs)
            return self.checkpointed(self.module, *bound.args, bound.kwargs)

    Remat.__qualname__ = Remat.__name__ = "Remat"
    Remat.__module__ = __name__
    return Remat


def _tagged_names(jaxpr: Any) -> set[str]:
    """The ``checkpoint_name`` tags of a jaxpr and its sub-programs (primitive ``name``)."""
    return {str(eqn.params["name"]) for eqn in equations(jaxpr) if eqn.primitive.name == "name"}


def check_saved_names(jaxpr: Any, what: str = "loss_fn") -> None:
    """Raises unless every name a ``"save:NAME"`` policy saves is tagged inside its checkpoint region.

    .. code-block:: text

        for each jax.checkpoint region R of the program whose policy saves names N:
            tagged = the checkpoint_name tags inside R      (a forward-pass region)
                   | the tags of the whole program          (a backward-pass region: the saved
                                                             values were tagged by the forward pass)
            N - tagged must be empty      (an untagged name would save nothing, silently)

    Args:
      jaxpr: a traced program (``jax.make_jaxpr`` output, closed or open).
      what: the traced function's name in the message.

    Raises:
      ValueError: a policy names a tag that its region never sets; the message lists the
        tags the program does set.

    Example:
      >>> import jax.numpy as jnp
      >>> def block(x):
      ...     return jnp.sum(checkpoint_name(jnp.tanh(x), "hidden"))
      >>> check_saved_names(jax.make_jaxpr(remat(block, "save:hidden"))(jnp.ones(2)))
      >>> check_saved_names(jax.make_jaxpr(remat(block, "save:hiden"))(jnp.ones(2)))
      Traceback (most recent call last):
      ...
      ValueError: remat policy 'save:hiden' saves checkpoint_name tag 'hiden', which loss_fn never sets ...
    """
    everywhere = _tagged_names(jaxpr)
    for eqn in equations(jaxpr):
        saved = (
            getattr(eqn.params.get("policy"), "saveable_names", None)
            if is_remat_primitive(eqn.primitive.name)
            else None
        )
        if not saved:
            continue
        # A region of the backward pass recomputes only what its policy did not save: the saved
        # tags were set by the forward pass, outside it.
        differentiated = bool(eqn.params.get("differentiated", False))
        inside = everywhere if differentiated else set().union(*(_tagged_names(sub) for _, sub in sub_jaxprs(eqn)))
        missing = sorted(set(map(str, saved)) - inside)
        if not missing:
            continue
        policy = "save:" + ",".join(sorted(map(str, saved)))
        tags = ", ".join(map(repr, missing))
        plural = len(missing) > 1
        defined = f"the tags it sets: {sorted(everywhere)}" if everywhere else "it sets no checkpoint_name tag"
        raise ValueError(
            f"remat policy {policy!r} saves checkpoint_name tag{'s' if plural else ''} {tags}, which "
            f"{what} never sets{'' if differentiated else ' inside that jax.checkpoint region'}, so "
            f"nothing is saved for {'them' if plural else 'it'}; {defined} (tag a value with "
            "leanstep.blocks.checkpoint_name(x, NAME) inside the remat'd function)"
        )
