"""Ceiling division: ``pagedkv.arith.ceil_div`` is the exact ceiling of a / b for every int pair."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.arith import ceil_div

nonzero = st.integers(-(1 << 70), 1 << 70).filter(lambda b: b != 0)


@given(st.integers(-(1 << 70), 1 << 70), nonzero)
def test_ceil_div_is_the_exact_ceiling_for_any_signs(a: int, b: int) -> None:
    # Fraction keeps a / b exact: math.ceil of a float quotient is wrong past 2**53.
    assert ceil_div(a, b) == math.ceil(Fraction(a, b))


@given(st.integers(0, 1 << 20), st.integers(1, 1 << 10))
def test_ceil_div_is_the_fewest_pieces_of_b_that_cover_a(a: int, b: int) -> None:
    n = ceil_div(a, b)
    assert (n - 1) * b < a <= n * b or a == n == 0


def test_ceil_div_is_exact_where_a_float_quotient_is_not() -> None:
    a = (1 << 60) + 1
    assert ceil_div(a, 1 << 7) == (1 << 53) + 1
    assert math.ceil(a / (1 << 7)) == 1 << 53  # the inline float form loses the remainder


def test_ceil_div_refuses_a_zero_divisor() -> None:
    with pytest.raises(ZeroDivisionError):
        ceil_div(5, 0)


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=20), st.integers(1, 64))
def test_ceil_div_works_element_wise_on_an_integer_tensor(values: list[int], b: int) -> None:
    got = ceil_div(torch.tensor(values, dtype=torch.int64), b)
    assert got.dtype == torch.int64
    assert got.tolist() == [ceil_div(v, b) for v in values]
