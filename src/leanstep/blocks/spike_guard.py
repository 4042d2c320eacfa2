r"""A loss-spike guard: skip a finite step whose loss or gradient norm leaps past its recent history.

MaxText (``skip_step_on_spikes``, from OLMo-core) and Levanter skip a step whose loss is beyond
``mean + k * std`` of a rolling window. Here the window is part of the train state and the
decision is made inside the compiled step, on the step's reduced (global) values, so every
device decides alike and nothing syncs with the host. For each watched value ``x`` (the loss,
the gradient norm before clipping, and optionally the update norm):

.. code-block:: text

    n      = min(recorded, window)                          the values recorded so far, at most window
    mean   = sum(w_1 .. w_n) / n
    std    = sqrt(sum((w_i - mean)^2) / n)
    spike  = recorded >= warmup  and  (x - mean) > k * std
    record   x, or mean + k * std where x is a spike                    (the ring's next slot)
             (x whole from the window // 2-th spike in a row: a level that stays is taken)

A step is skipped for a spike when any watched value is one. Every finite step is recorded, a
spike at the threshold it crossed (``mean + k * std``, winsorized): a window that left spikes out
would freeze where a loss that moves on (a new phase of the schedule, a harder stretch of data)
leaves it, and skip every step after, while one that took them whole would be blinded by the
first spike of a burst (its std inflated, the next bad steps pass). At the threshold a burst
stays visible; a loss that stays high for half a window of spikes in a row has moved on, and is
recorded whole from then on. A burst of spikes is what ``leanstep train``'s escalation (a
rollback) is for.

The guard's decisions are tested against a plain-Python float32 model bit for bit, so every
value is rounded where that model rounds it: the sums run as an explicit tree of elementwise adds
over a power-of-two buffer (:func:`tree_sum`), whose order a reference can repeat, and optimization
barriers keep XLA from fusing a square into the sum after it (one rounding where NumPy makes two)
and from dividing by the broadcast count as a product with its reciprocal.

Example:
  >>> import jax.numpy as jnp
  >>> guard = SpikeGuard(window=8, k=3.0, warmup=4, watch=("loss",))
  >>> state = guard.init()
  >>> for loss in [2.0, 2.1, 1.9, 2.0, 2.05]:
  ...     spike, state = guard.decide(state, {"loss": jnp.float32(loss)}, jnp.array(True))
  >>> bool(spike), int(state.recorded)
  (False, 5)
  >>> bool(guard.decide(state, {"loss": jnp.float32(9.0)}, jnp.array(True))[0])
  True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.common.checks import is_int

__all__ = ["MAX_WINDOW", "WATCHABLE", "SpikeGuard", "SpikeState", "tree_sum"]

#: What the guard may watch: the step's loss, its gradient norm (before clipping), its update norm.
WATCHABLE = ("loss", "grad_norm", "update_norm")
#: The longest window: 2**24 steps, the largest count a float32 holds exactly (64 MiB of ring a
#: watched value).
MAX_WINDOW = 2**24
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def tree_sum(values: jax.Array) -> jax.Array:
    """The sum of the last axis (a power of two long) as a tree of elementwise adds, halving it.

    Example:
      >>> tree_sum(jnp.array([1.0, 2.0, 3.0, 4.0]))  # (1 + 3) + (2 + 4)
      Array(10., dtype=float32)
    """
    while values.shape[-1] > 1:
        half = values.shape[-1] // 2
        values = values[..., :half] + values[..., half:]
    return values[..., 0]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "recorded", "spikes", "streak", "update_scale"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SpikeState:
    """The guard's window, in the train state.

    Attributes:
      values: float32 ``(watched, buffer)``: a ring of the last ``window`` recorded values of each
        watched quantity (``buffer``, the window rounded up to a power of two; the rest stays 0).
      recorded: int32, finite steps recorded so far (the ring's next slot is ``recorded % window``).
      spikes: int32, steps skipped for a spike so far.
      streak: int32, spikes in a row up to now (a finite step that is none resets it).
      update_scale: float32, what the step multiplies the optimizer's updates by: 1, or less
        for a while after ``leanstep train`` rolled back past a burst of spikes (for optax's
        AdamW, a lower learning rate). The guard never changes it; the loop sets it.
    """

    values: jax.Array
    recorded: jax.Array
    spikes: jax.Array
    streak: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    update_scale: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones((), jnp.float32))

    def with_update_scale(self, scale: float) -> SpikeState:
        """This window with ``update_scale`` set to ``scale`` (computed from the old value: its placement kept)."""
        return dataclasses.replace(self, update_scale=self.update_scale * 0 + jnp.float32(scale))


@dataclasses.dataclass(frozen=True)
class SpikeGuard:
    """The guard's settings (static; see the module doc).

    Attributes:
      window: values each statistic is over, an int in ``[2, MAX_WINDOW]`` (2**24).
      k: how many standard deviations above the mean is a spike, > 0 and finite in float32 (6 as
        MaxText and OLMo-core).
      warmup: recorded steps before any step is judged, an int in ``[2, 2**31 - 1]`` (the window
        needs values; the steps recorded are an int32).
      watch: a tuple of :data:`WATCHABLE` names; the loss alone by default. The gradient norm's
        distribution has a heavy tail: on ``leanstep train``'s default run (1,096 steps) it
        crosses mean + 6 std 6 times, the loss never (``docs/reliability.md``).

    Raises:
      ValueError: a setting outside its form, named.
    """

    window: int = 100
    k: float = 6.0
    warmup: int = 100
    watch: tuple[str, ...] = ("loss",)

    def __post_init__(self) -> None:
        # The window's count is divided as a float32 (exact to 2**24) and its steps are counted
        # in int32: bounded here, not where they would overflow inside the compiled step.
        if not is_int(self.window) or not 2 <= self.window <= MAX_WINDOW:
            raise ValueError(
                f"SpikeGuard.window must be an int in [2, {MAX_WINDOW}] (steps; its count is a float32, exact to "
                f"2**24), got {self.window!r}"
            )
        if isinstance(self.k, bool) or not isinstance(self.k, (int, float)) or not 0 < self.k <= _FLOAT32_MAX:
            raise ValueError(f"SpikeGuard.k must be a positive number, finite in float32, got {self.k!r}")
        if not is_int(self.warmup) or not 2 <= self.warmup <= _INT32_MAX:
            raise ValueError(
                f"SpikeGuard.warmup must be an int in [2, {_INT32_MAX}] (steps, counted in int32), got {self.warmup!r}"
            )
        watch = tuple(self.watch) if isinstance(self.watch, (tuple, list)) else (self.watch,)
        if not watch or any(name not in WATCHABLE for name in watch) or len(set(watch)) != len(watch):
            raise ValueError(f"SpikeGuard.watch must name some of {WATCHABLE}, each once, got {self.watch!r}")
        object.__setattr__(self, "watch", watch)

    @classmethod
    def from_string(cls, spec: str) -> SpikeGuard | None:
        """``"none"`` (None), ``"on"`` (the defaults), or settings, comma-separated:
        ``"k=6,window=100,warmup=100,watch=loss+grad_norm+update_norm"``.

        Raises:
          ValueError: another form, naming it and the expected one.

        Example:
          >>> SpikeGuard.from_string("k=4,window=50,warmup=50").k, SpikeGuard.from_string("none")
          (4.0, None)
        """
        expected = "none, on, or k=X,window=N,warmup=N,watch=NAME+NAME (names of loss, grad_norm, update_norm)"
        if not isinstance(spec, str):
            raise TypeError(f"a spike guard is a string, got {type(spec).__name__}")
        spec = spec.strip().lower()
        if spec in ("none", "on"):
            return None if spec == "none" else cls()
        fields: dict[str, Any] = {}
        for part in (p.strip() for p in spec.split(",")):
            name, sep, value = part.partition("=")
            if not sep or name not in ("k", "window", "warmup", "watch") or name in fields:
                raise ValueError(f"unknown or repeated spike-guard setting {part!r} in {spec!r}; expected {expected}")
            try:
                fields[name] = (
                    tuple(value.split("+")) if name == "watch" else float(value) if name == "k" else int(value)
                )
            except ValueError:
                raise ValueError(f"spike-guard setting {part!r} is not a number; expected {expected}") from None
        try:
            return cls(**fields)
        except ValueError as error:
            raise ValueError(f"{error}; expected {expected}") from None

    @property
    def patience(self) -> int:
        """Spikes in a row recorded at their threshold; from the next one on they are recorded whole:
        half the window (a burst shorter than that stays visible, a level that stays is taken)."""
        return max(self.window // 2, 1)

    @property
    def buffer(self) -> int:
        """The ring's length in memory: ``window`` rounded up to a power of two."""
        return 1 << (self.window - 1).bit_length()

    def init(self) -> SpikeState:
        """An empty window."""
        zero = jnp.zeros((), jnp.int32)
        return SpikeState(
            jnp.zeros((len(self.watch), self.buffer), jnp.float32), zero, zero, zero, jnp.ones((), jnp.float32)
        )

    def decide(
        self, state: SpikeState, values: dict[str, jax.Array], finite: jax.Array
    ) -> tuple[jax.Array, SpikeState]:
        """``(spike, new_state)`` for a step whose watched ``values`` are given; ``finite``: the
        step passed the finiteness guard. A finite step is recorded, spike or not."""
        x = jnp.stack([jnp.asarray(values[name], jnp.float32) for name in self.watch])
        n = jnp.minimum(state.recorded, self.window)
        count = n.astype(jnp.float32)
        slots = jnp.arange(self.buffer) < n
        # Each rounded where a plain-Python reference rounds it (see the module doc).
        barrier = jax.lax.optimization_barrier
        divisor = barrier(jnp.broadcast_to(jnp.maximum(count, 1.0), (len(self.watch),)))
        mean = barrier(tree_sum(jnp.where(slots, state.values, 0.0)) / divisor)
        deviation = state.values - mean[:, None]
        variance = barrier(tree_sum(jnp.where(slots, barrier(deviation * deviation), 0.0)) / divisor)
        spread = barrier(jnp.float32(self.k) * jnp.sqrt(variance))
        judged = state.recorded >= self.warmup
        over = judged & jnp.isfinite(x) & ((x - mean) > spread)  # each watched value beyond its threshold
        spike = finite & jnp.any(over)
        record = finite
        slot = state.recorded % self.window
        # A spike is recorded at the threshold it crossed, unless it is the patience-th in a row:
        # a loss that stays there has moved on, and its values are taken whole from then on.
        clip = over & (state.streak < self.patience)
        kept = jnp.where(clip, mean + spread, x)
        values_new = jnp.where(record, state.values.at[:, slot].set(kept), state.values)
        streak = jnp.where(
            finite, jnp.where(spike, jnp.minimum(state.streak, jnp.int32(2**31 - 2)) + 1, 0), state.streak
        )
        return spike, SpikeState(
            values_new,
            jnp.where(record, jnp.minimum(state.recorded, jnp.int32(2**31 - 2)) + 1, state.recorded),
            state.spikes + spike.astype(jnp.int32),
            streak.astype(jnp.int32),
            state.update_scale,
        )
