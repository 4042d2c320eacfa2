"""An adapter's loss takes a key exactly when the user's function does: its signature, read from the function's.

A framework adapter (:func:`leanstep.frameworks.nnx.loss`, :func:`leanstep.frameworks.equinox.loss`,
:func:`leanstep.frameworks.equinox.stateful_loss`) turns ``fn(model, [model_state,] batch[, key])``
into leanstep's ``loss_fn(params, [model_state,] batch[, key])``. Written as ``*key``, the adapter
would take any number of keys, and a ``uses_rng`` that does not fit ``fn`` would fail inside ``fn``
with Python's bare arity error. Given ``fn``'s own signature, the adapter's says whether it takes a
key, and leanstep's contract check (:meth:`leanstep.LossContract.check_signature`) names
``uses_rng`` when the step is built, before anything is traced.

.. code-block:: text

    fn takes                      the adapter's signature
    (model, batch, key)           (params, batch, key)
    (model, batch)                (params, batch)
    (model, batch, key=None)      (params, batch, *key)       either fits
    neither, or unreadable        TypeError naming fn / (params, batch, *key)
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["with_fn_signature"]


def _takes(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def with_fn_signature(loss_fn: Any, fn: Any, model_arguments: tuple[str, ...], loss_arguments: tuple[str, ...]) -> Any:
    """``loss_fn`` (``loss_arguments`` then ``*key``) with the signature that ``fn``'s implies (the module doc).

    Args:
      loss_fn: the adapter's loss, ``loss_fn(*loss_arguments, *key)``.
      fn: the user's function, ``fn(*model_arguments[, key])``.
      model_arguments: ``fn``'s arguments before the key, by name, for the message.
      loss_arguments: ``loss_fn``'s arguments before the key.

    Returns:
      ``loss_fn``, its ``__signature__`` set.

    Raises:
      TypeError: ``fn`` takes neither ``model_arguments`` nor ``model_arguments`` and a key.

    Example:
      >>> fn = lambda model, batch, key: 0.0
      >>> loss_fn = with_fn_signature(lambda params, batch, *key: 0.0, fn, ("model", "batch"), ("params", "batch"))
      >>> inspect.signature(loss_fn)
      <Signature (params, batch, key)>
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return loss_fn
    count = len(model_arguments)
    without, with_key = _takes(signature, count), _takes(signature, count + 1)
    if not (without or with_key):
        names = ", ".join(model_arguments)
        raise TypeError(
            f"fn{signature} must take ({names}) or ({names}, key), the model first: the adapter calls "
            f"fn({names}), or fn({names}, key) with uses_rng=True"
        )
    parameter = lambda name, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD: inspect.Parameter(name, kind)
    parameters = [parameter(name) for name in loss_arguments]
    if with_key and without:
        parameters.append(parameter("key", inspect.Parameter.VAR_POSITIONAL))
    elif with_key:
        parameters.append(parameter("key"))
    loss_fn.__signature__ = inspect.Signature(parameters)
    return loss_fn
