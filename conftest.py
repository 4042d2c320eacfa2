"""Strict test setup shared by every test module and doctest."""

import jax

# Implicit rank promotion hides shape bugs; tests must spell broadcasting out.
jax.config.update("jax_numpy_rank_promotion", "raise")
