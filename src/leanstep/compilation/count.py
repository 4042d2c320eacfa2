"""A count, in the current thread, of the XLA programs compiled and those JAX's persistent cache had.

Example:
  >>> import jax, jax.numpy as jnp
  >>> with CompileCount() as count:  # one program, compiled or loaded from the cache
  ...     _ = jax.jit(lambda x: x * 2 + 1).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).compile()
  >>> count.compiled
  1
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import jax

from leanstep.compilation.cache import cache_directory

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["CompileCount"]


class CompileCount:
    """Counts, in the current thread, the XLA programs compiled and those the persistent cache had.

    Attributes:
      compiled: backend compiles (each a cache load or a real compile).
      looked_up: of those, how many the persistent cache was asked for (0: the cache is off).
      hits: of those, how many it had.
      seconds: time in backend compiles (or cache loads), tracing and lowering left out.
    """

    def __init__(self) -> None:
        self.compiled = self.looked_up = self.hits = 0
        self.seconds = 0.0
        self._thread = threading.get_ident()
        self._cache_on = False

    def _event(self, event: str, **kwargs: str | int) -> None:
        del kwargs
        if threading.get_ident() != self._thread:
            return
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            self.looked_up += 1
        elif event == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def _duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        del kwargs
        if event == "/jax/core/compile/backend_compile_duration" and threading.get_ident() == self._thread:
            self.compiled += 1
            self.seconds += duration_secs

    def __enter__(self) -> Self:
        self._thread = threading.get_ident()
        # JAX asks its cache even with no folder set (and finds nothing): that is no cache.
        self._cache_on = cache_directory() is not None
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_duration_listener(self._duration)

    def to_json(self) -> dict[str, Any]:
        """``{"programs", "cache": "hit" | "miss" | "off", "from_cache", "backend_seconds"}``."""
        if self.looked_up == 0 or not self._cache_on:
            cache = "off"
        else:
            cache = "hit" if self.hits == self.looked_up else "miss"
        return {
            "programs": self.compiled,
            "cache": cache,
            "from_cache": self.hits,
            "backend_seconds": round(self.seconds, 4),
        }
