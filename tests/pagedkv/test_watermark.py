"""``pagedkv.watermark.never_admitted``: the one answer to "can this prompt ever be admitted", and
the block manager's core agrees with it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.block_manager_svc.core.errors import InvalidArgument, ResourceExhausted
from pagedkv.block_manager_svc.core.manager import BlockManager, CoreConfig
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.watermark import never_admitted, watermark_blocks

pools = st.tuples(
    st.integers(1, 64),  # GPU blocks
    st.floats(0.0, 0.9),  # watermark fraction
    st.sampled_from([1, 2, 4, 16]),  # block size
)


@given(pools, st.integers(1, 2048))
def test_a_sequence_is_never_admitted_exactly_past_the_room_above_the_watermark(
    pool: tuple[int, float, int], tokens: int
) -> None:
    n, fraction, bs = pool
    wm = watermark_blocks(fraction, n)
    why = never_admitted(tokens, bs, n, wm)
    need = blocks_for_tokens(tokens, bs)
    assert (why is None) == (need <= n - wm)
    if why is not None:
        assert why == (
            f"{tokens} tokens need {need} blocks of {bs}, more than the {n - wm} an admission may take "
            f"(the pool has {n} blocks, {wm} held back by the watermark): they can never be admitted"
        )


def _core(n: int, wm: int, bs: int) -> BlockManager:
    return BlockManager(
        CoreConfig(
            num_gpu_blocks=n, block_size=bs, watermark_blocks=wm, preemption_mode="off", eviction_policy="lru"
        )
    )


@given(pools, st.integers(1, 2048))
def test_the_core_admits_into_an_empty_pool_exactly_what_is_not_refused(
    pool: tuple[int, float, int], tokens: int
) -> None:
    n, fraction, bs = pool
    wm = watermark_blocks(fraction, n)
    bm = _core(n, wm, bs)
    if never_admitted(tokens, bs, n, wm) is None:
        bm.allocate("s", tokens, list(range(tokens)))
    else:
        with pytest.raises((InvalidArgument, ResourceExhausted)):
            bm.allocate("s", tokens, list(range(tokens)))


@given(pools, st.integers(1, 512), st.integers(1, 512), st.booleans())
def test_prefix_cache_hits_do_not_admit_what_is_refused(
    pool: tuple[int, float, int], shared: int, own: int, free_first: bool
) -> None:
    # A first sequence commits a prefix (and is freed, leaving it cached, or keeps it); a second
    # sequence that starts with that prefix hits it, yet is admitted only if never_admitted allows.
    n, fraction, bs = pool
    wm = watermark_blocks(fraction, n)
    bm = _core(n, wm, bs)
    prefix = list(range(shared))
    if never_admitted(shared, bs, n, wm) is not None:
        return
    bm.allocate("first", shared, prefix)
    bm.commit("first", shared)
    if free_first:
        bm.free("first")
    tokens = prefix + list(range(10_000, 10_000 + own))
    if never_admitted(len(tokens), bs, n, wm) is not None:
        with pytest.raises((InvalidArgument, ResourceExhausted)):
            bm.allocate("second", len(tokens), tokens)
