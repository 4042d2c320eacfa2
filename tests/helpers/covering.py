"""A campaign's cases chosen to cover pairs of settings: a greedy covering array, as AETG builds them.

Of a pool of seeded random draws, each case chosen is the first draw that adds the most pairs of
settings (``(setting, value, other setting, its value)``) not yet covered: a few cases cover as
many pairs as twice as many drawn at random (tests/test_verification_configs.py and
tests/test_verification_defects.py give their counts).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

Pair = tuple[str, str, str, str]


def pairs(values: dict[str, Any], settings: Sequence[str]) -> set[Pair]:
    """The pairs of ``settings`` that ``values`` holds, each value as its ``str``."""
    return {(a, str(values[a]), b, str(values[b])) for a, b in itertools.combinations(settings, 2)}


def covering(pool: Sequence[Any], pairs_of: Callable[[Any], set[Pair]], count: int) -> list[Any]:
    """``count`` cases of ``pool``, each the first that adds the most pairs not yet covered."""
    held = [(case, pairs_of(case)) for case in pool]
    chosen, covered = [], set()
    for _ in range(count):
        case, its_pairs = max(held, key=lambda entry: len(entry[1] - covered))
        chosen.append(case)
        covered |= its_pairs
    return chosen
