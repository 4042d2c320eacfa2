"""Compile once per machine: JAX's persistent compilation cache, set up and counted.

.. code-block:: text

    cache.py              enable_compile_cache(): the folder, its settings, its warnings
    atomic_file_cache.py  cache entries written by rename, bounded by LRU, no lock
    count.py              CompileCount: what each compile found in the cache
"""

from leanstep.compilation.cache import disable_compile_cache, enable_compile_cache
from leanstep.compilation.count import CompileCount

__all__ = ["CompileCount", "disable_compile_cache", "enable_compile_cache"]
