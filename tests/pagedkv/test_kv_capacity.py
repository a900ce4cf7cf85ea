"""Capacity as bytes: bytes per block from model dims x KV dtype, blocks from a memory budget, blocks for
a sequence's tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import kv_capacity as kc

dims = st.tuples(
    st.integers(1, 96),  # layers
    st.integers(1, 16),  # KV heads
    st.integers(1, 512),  # head_dim
    st.sampled_from([1, 8, 16, 32, 128]),  # block size
)
model_bytes = st.sampled_from([1, 2, 4])


@given(dims, st.sampled_from(kc.KV_CACHE_DTYPES), model_bytes)
def test_block_bytes_is_every_row_of_every_layer_k_and_v(
    d: tuple[int, int, int, int], kv: str, mb: int
) -> None:
    layers, heads, head_dim, bs = d
    row = head_dim + 4 if kv != "auto" else head_dim * mb  # 8-bit: one byte a value + an fp32 scale
    assert kc.block_bytes(layers, heads, head_dim, bs, kv, mb) == layers * 2 * bs * heads * row


@given(st.integers(0, 1 << 44), st.integers(1, 1 << 30))
def test_blocks_for_memory_is_the_largest_count_that_fits(budget: int, per_block: int) -> None:
    n = kc.blocks_for_memory(budget, per_block)
    assert n * per_block <= budget < (n + 1) * per_block


@given(st.integers(0, 1 << 40), st.sampled_from([1, 8, 16, 32, 128]))
def test_blocks_for_tokens_is_the_fewest_blocks_that_hold_them(tokens: int, bs: int) -> None:
    n = kc.blocks_for_tokens(tokens, bs)
    assert n * bs >= tokens and (n - 1) * bs < tokens or tokens == n == 0


@given(dims, model_bytes, st.floats(0.001, 64.0))
def test_an_8bit_cache_holds_more_blocks_in_the_same_budget(
    d: tuple[int, int, int, int], mb: int, gib: float
) -> None:
    layers, heads, head_dim, bs = d
    budget = kc.memory_bytes(gib)
    wide = kc.blocks_for_memory(budget, kc.block_bytes(layers, heads, head_dim, bs, "auto", mb))
    for kv in ("int8", "fp8_e4m3"):
        narrow = kc.blocks_for_memory(budget, kc.block_bytes(layers, heads, head_dim, bs, kv, mb))
        # 8-bit holds at least as many blocks whenever a row of model-dtype values outweighs the 8-bit
        # row and its scale, and never more otherwise
        if head_dim * mb >= head_dim + 4:
            assert narrow >= wide
        else:
            assert narrow <= wide


@given(st.integers(57, 512))
def test_int8_holds_at_least_3_5x_the_fp32_blocks_from_head_dim_57(head_dim: int) -> None:
    fp32 = kc.block_bytes(30, 3, head_dim, 16, "auto", 4)
    int8 = kc.block_bytes(30, 3, head_dim, 16, "int8", 4)
    assert kc.blocks_per_gib(int8) >= 3.5 * kc.blocks_per_gib(fp32) - 1


def test_smollm2_135m_figures() -> None:
    """30 layers, 3 KV heads, head_dim 64, 16-token blocks: 737,280 fp32 bytes against 195,840."""
    assert kc.block_bytes(30, 3, 64, 16, "auto", 4) == 737_280
    assert kc.block_bytes(30, 3, 64, 16, "int8", 4) == 195_840
    assert kc.blocks_per_gib(195_840) / kc.blocks_per_gib(737_280) == pytest.approx(3.76, abs=0.01)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: kc.block_bytes(1, 1, 64, 16, "int4", 4),
            "kv_cache_dtype must be one of auto, int8, fp8_e4m3",
        ),
        (lambda: kc.block_bytes(0, 1, 64, 16, "auto", 4), "num_layers must be >= 1"),
        (lambda: kc.blocks_for_memory(10, 0), "bytes_per_block must be >= 1"),
        (lambda: kc.memory_bytes(float("nan")), "must be >= 0 GiB"),
        (lambda: kc.memory_bytes(-1.0), "must be >= 0 GiB"),
    ],
)
def test_bad_values_are_refused(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]
