"""Tests for leanstep.blocks.microbatches: the contiguous, strided and presplit splitters.

References: NumPy slicing (row order and strides), and the device-block property of the
strided split checked by brute force over every device count that divides the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstep.blocks.microbatches import (
    SPLITS,
    get_splitter,
    presplit_microbatches,
    split_microbatches,
    split_strided_microbatches,
)


def test_split_microbatches_keeps_row_order() -> None:
    batch = {"a": jnp.arange(12.0).reshape(6, 2), "nested": [jnp.arange(6), jnp.zeros((6, 1, 3))]}
    split = split_microbatches(batch, 3)
    assert split["nested"][1].shape == (3, 2, 1, 3)
    for j in range(3):
        want = np.asarray(batch["a"])[2 * j : 2 * j + 2]
        np.testing.assert_array_equal(np.asarray(split["a"][j]), want)
        np.testing.assert_array_equal(np.asarray(split["nested"][0][j]), [2 * j, 2 * j + 1])


def test_mismatched_leading_sizes_name_the_leaf() -> None:
    batch = {"x": jnp.zeros((4, 2)), "y": [jnp.zeros((4,)), jnp.zeros((3, 1))]}
    message = r"batch\['y'\]\[1\] has leading size 3 but batch\['x'\] has 4"
    with pytest.raises(ValueError, match=message):
        split_microbatches(batch, 2)
    with pytest.raises(ValueError, match=r"batch\['s'\] is a scalar"):
        split_microbatches({"s": jnp.float32(1.0), "x": jnp.zeros(4)}, 2)
    with pytest.raises(ValueError, match="at least one array leaf"):
        split_microbatches({}, 1)
    with pytest.raises(ValueError, match="batch size is 0"):
        split_microbatches({"x": jnp.zeros((0, 3))}, 1)


def test_traced_num_microbatches_raises_type_error() -> None:
    with pytest.raises(TypeError, match="num_microbatches must be a static Python int"):
        jax.jit(split_microbatches)({"x": jnp.zeros(4)}, 2)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 6), num_mb=st.integers(1, 5), width=st.integers(1, 3))
def test_split_strided_microbatches_matches_numpy(rows, num_mb, width):
    size = rows * num_mb
    x = np.arange(size * width, dtype=np.float32).reshape(size, width)
    ids = np.arange(size, dtype=np.int32)
    split = split_strided_microbatches({"x": x, "ids": ids}, num_mb)
    for j in range(num_mb):
        np.testing.assert_array_equal(split["x"][j], x[j::num_mb])
        np.testing.assert_array_equal(split["ids"][j], ids[j::num_mb])
    # Each of D contiguous row blocks (D * num_mb | size) meets every microbatch in one block of axis 1.
    for num_shards in (d for d in range(1, rows + 1) if rows % d == 0):
        block = rows // num_shards
        for d in range(num_shards):
            own = set(range(d * size // num_shards, (d + 1) * size // num_shards))
            held = set(np.asarray(split["ids"][:, d * block : (d + 1) * block]).ravel().tolist())
            assert held == own


def test_split_strided_microbatches_errors():
    with pytest.raises(ValueError, match="batch size 6 is not divisible by num_microbatches=4"):
        split_strided_microbatches({"x": np.zeros(6)}, 4)
    with pytest.raises(TypeError, match="num_microbatches"):
        split_strided_microbatches({"x": np.zeros(6)}, 2.0)


def test_presplit_passes_a_split_batch_through_and_refuses_others():
    split = split_microbatches({"x": jnp.arange(6.0), "y": jnp.zeros((6, 2))}, 3)
    assert presplit_microbatches(split, 3) is split
    with pytest.raises(
        ValueError,
        match=r"batch\['x'\] has shape \(3, 2\); a presplit batch needs leaves of shape "
        r"\(num_microbatches=2, rows, ...\)",
    ):
        presplit_microbatches(split, 2)
    with pytest.raises(ValueError, match="share their rows axis"):
        presplit_microbatches({"x": jnp.zeros((2, 3)), "y": jnp.zeros((2, 4))}, 2)
    with pytest.raises(ValueError, match="batch size is 0"):
        presplit_microbatches({"x": jnp.zeros((2, 0))}, 2)


def test_get_splitter_resolves_names_and_callables():
    assert {name: get_splitter(name) for name in SPLITS} == SPLITS
    custom = lambda batch, num_microbatches: batch
    assert get_splitter(custom) is custom
    with pytest.raises(ValueError, match="unknown split='row'; expected one of 'contiguous', 'strided', 'presplit'"):
        get_splitter("row")
    with pytest.raises(TypeError, match="split must be a name or a callable"):
        get_splitter(3)
