"""The 0.7 keywords of the gradient stage, folded into the values that hold them now.

``gradient_stage(loss_fn, num_microbatches=2, has_aux=True)`` still runs through 0.8, with a
``DeprecationWarning``, as ``gradient_stage(loss_fn, accumulation=Accumulation(2),
loss=LossContract(has_aux=True))``.
"""

from __future__ import annotations

import warnings
from typing import Any

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.loss_contract import LossContract

__all__ = ["loss_settings", "loss_value", "unexpected_keywords"]

_LOSS_KEYWORDS = ("has_aux", "token_weighted", "uses_rng", "has_state")
_ACCUMULATION_KEYWORDS = ("num_microbatches", "split", "unroll")


def unexpected_keywords(where: str, names: Any) -> TypeError:
    """The TypeError Python raises for keywords a function never took."""
    return TypeError(f"{where}() got unexpected keyword argument(s): {', '.join(sorted(names))}")


def loss_settings(
    loss: LossContract | None, accumulation: Accumulation | int, deprecated: dict[str, Any], *, where: str
) -> tuple[LossContract, Accumulation]:
    """``(loss, accumulation)`` as values, with the 0.7 keywords of ``where`` in ``deprecated`` folded in.

    Raises:
      TypeError: a keyword ``where`` never took, ``loss`` not a :class:`LossContract`, or
        ``accumulation`` neither an :class:`Accumulation` nor an int.
      ValueError: a deprecated keyword given beside the value that now holds it.
    """
    unknown = set(deprecated) - set(_LOSS_KEYWORDS) - set(_ACCUMULATION_KEYWORDS)
    if unknown:
        raise unexpected_keywords(where, unknown)
    if deprecated:
        loss_new = "loss=LossContract(...)" if set(deprecated) & set(_LOSS_KEYWORDS) else ""
        accumulation_new = "accumulation=Accumulation(...)" if set(deprecated) & set(_ACCUMULATION_KEYWORDS) else ""
        warnings.warn(
            f"{where}({', '.join(f'{k}=' for k in sorted(deprecated))}) is deprecated: pass "
            f"{' and '.join(x for x in (loss_new, accumulation_new) if x)} (leanstep 0.8; the keywords go in 0.9)",
            DeprecationWarning,
            stacklevel=3,
        )
    flags = {k: v for k, v in deprecated.items() if k in _LOSS_KEYWORDS}
    walk = {k: v for k, v in deprecated.items() if k in _ACCUMULATION_KEYWORDS}
    return loss_value(loss, flags), _accumulation_value(accumulation, walk)


def loss_value(loss: LossContract | None, flags: dict[str, Any]) -> LossContract:
    """``loss``, or a contract of ``flags`` (the flags given) when None; both at once is refused."""
    if loss is None:
        return LossContract(**flags)
    if not isinstance(loss, LossContract):
        raise TypeError(f"loss must be a leanstep.LossContract, got {type(loss).__name__}")
    if flags:
        raise ValueError(f"give {', '.join(sorted(flags))} inside loss=LossContract(...), not beside it")
    return loss


def _accumulation_value(accumulation: Accumulation | int | None, walk: dict[str, Any]) -> Accumulation:
    if isinstance(accumulation, Accumulation):
        if walk:
            raise ValueError(f"give {', '.join(sorted(walk))} inside accumulation=Accumulation(...), not beside it")
        return accumulation
    if isinstance(accumulation, bool) or not isinstance(accumulation, int):
        raise TypeError(
            f"accumulation must be a leanstep.Accumulation or a number of microbatches, got {accumulation!r}"
        )
    if accumulation != 1 and "num_microbatches" in walk:
        raise ValueError("give the number of microbatches once: accumulation= or num_microbatches=")
    return Accumulation(**{"num_microbatches": accumulation, **walk})
