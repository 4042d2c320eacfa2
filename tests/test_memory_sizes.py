"""leanstep.common.memory_sizes: parsing and formatting memory sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstep.common.memory_sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1000000", 10**6),
        (" 64 kib ", 64 * 1024),
        ("1.5KiB", 1536),
        ("3b", 3),
        (7, 7),
        (".5MB", 500_000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from([("", 1), ("KB", 1000), ("MiB", 2**20), ("gb", 10**9), ("TiB", 2**40)]))
def test_parse_bytes_multiplies_by_the_unit(number, unit):
    assert parse_bytes(f"{number}{unit[0]}") == number * unit[1]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("lots", "is not a size"),
        ("12XB", "is not a size"),
        ("0.3B", "not a whole number of bytes"),
        ("0MiB", "must be positive"),
        ("-5", "is not a size"),
        ("", "is not a size"),
        (True, "is not a size"),
    ],
)
def test_parse_bytes_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (5 * 2**40, "5120.0 GiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
