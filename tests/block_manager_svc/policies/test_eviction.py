"""Eviction policies: leaves first, LRU order, GDSF order, O(log n) bookkeeping."""

from __future__ import annotations

import pytest

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.eviction import LruEviction, LruSizeEviction, make_eviction_policy

BS = 4


def make(policy: str, num_blocks: int = 16, **kw: object) -> BlockManager:
    return BlockManager(
        CoreConfig(
            num_gpu_blocks=num_blocks,
            block_size=BS,
            eviction_policy=policy,
            **{"preemption_mode": "off", **kw},
        )
    )  # type: ignore[arg-type]


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_factory_knows_both_and_rejects_others() -> None:
    assert isinstance(make_eviction_policy("lru", 4), LruEviction)
    assert isinstance(make_eviction_policy("lru-size", 4), LruSizeEviction)
    with pytest.raises(ValueError, match="lru-size"):
        make_eviction_policy("fifo", 4)
    with pytest.raises(ValueError):
        CoreConfig(num_gpu_blocks=4, eviction_policy="fifo")


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_chain_is_evicted_from_its_leaf_and_keeps_no_hole(policy: str) -> None:
    bm = make(policy, num_blocks=6)
    a = bm.allocate("a", 17, toks(17))  # 4 full blocks + 1 partial
    bm.commit("a", 17)
    bm.free("a")
    assert bm.stats().num_cached_blocks == 4
    bm.allocate("b", 12)  # 2 free + 1 evicted
    bm.free("b")
    bm.allocate("c", 8)
    bm.free("c")
    bm.check_invariants()
    # Whatever is still cached is a root-anchored prefix of the chain.
    cached = [b for b in a.block_ids[:4] if b in bm.pool.eviction_policy]
    assert cached == a.block_ids[: len(cached)]
    r = bm.allocate("d", 17, toks(17))
    assert r.num_cached_tokens == len(cached) * BS


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_shared_parent_is_kept_until_all_children_are_gone(policy: str) -> None:
    bm = make(policy, num_blocks=8)
    base = toks(8)
    x = bm.allocate("x", 13, base + toks(5, 100))  # p0 p1 x2 (x3 partial)
    bm.commit("x", 13)
    y = bm.allocate("y", 13, base + toks(5, 200))  # p0 p1 hit, y2, (y3 partial)
    bm.commit("y", 13)
    p0, p1, x2, y2 = x.block_ids[0], x.block_ids[1], x.block_ids[2], y.block_ids[2]
    bm.free("x")
    bm.free("y")
    assert bm.stats().num_cached_blocks == 4 and bm.stats().num_free_blocks == 4
    for i in range(4):
        bm.allocate(f"f{i}", 4)  # the free blocks go first
    assert bm.stats().num_evicted_blocks == 0
    bm.allocate("g1", 4)
    bm.allocate("g2", 4)
    cached = set(b for b in (p0, p1, x2, y2) if b in bm.pool.eviction_policy)
    assert cached == {p0, p1}, "both children go before their shared parent"
    bm.allocate("g3", 4)
    assert p0 in bm.pool.eviction_policy and p1 not in bm.pool.eviction_policy
    bm.check_invariants()


def test_lru_size_evicts_a_large_cold_run_before_a_small_hot_one() -> None:
    bm = make("lru-size", num_blocks=40, miss_cost_tokens=64)
    small = toks(9, 1000)  # 2 full blocks
    large = toks(65, 5000)  # 16 full blocks
    for i in range(3):  # the small prompt is hit often
        bm.allocate(f"s{i}", len(small), small)
        bm.commit(f"s{i}", len(small))
        bm.free(f"s{i}")
    bm.allocate("L", len(large), large)
    bm.commit("L", len(large))
    bm.free("L")  # released after the small one: more recent
    st = bm.stats()
    assert st.num_cached_blocks == 18
    # Need 26 blocks: 22 free + 4 evicted. Under LRU the small run (older) would go.
    bm.allocate("new", 104)
    assert bm.stats().num_evicted_blocks == 4
    r = bm.allocate("s9", len(small), small)
    assert r.num_cached_tokens == 8  # the hot small prefix survived
    bm.check_invariants()


def test_lru_evicts_the_older_small_run_in_the_same_situation() -> None:
    bm = make("lru", num_blocks=40)
    small = toks(9, 1000)
    large = toks(65, 5000)
    for i in range(3):
        bm.allocate(f"s{i}", len(small), small)
        bm.commit(f"s{i}", len(small))
        bm.free(f"s{i}")
    bm.allocate("L", len(large), large)
    bm.commit("L", len(large))
    bm.free("L")
    bm.allocate("new", 104)
    r = bm.allocate("s9", len(small), small)
    assert r.num_cached_tokens == 0  # vLLM's order: least recently released first


def test_gdsf_scores_follow_the_formula_and_the_clock_inflates() -> None:
    pol = LruSizeEviction(8, block_size=16, miss_cost_tokens=64)
    pol.add(0, True, 1)  # F=1: 16 + 64/1 = 80
    pol.touch(1)
    pol.add(1, True, 4)  # F=2: 2 * (16 + 16) = 64
    pol.add(2, True, 8)  # F=1: 16 + 8 = 24
    assert pol._score[:3] == [80.0, 64.0, 24.0]
    assert pol.pop_victim() == 2 and pol.clock == 24.0
    pol.add(3, True, 8)  # released after the clock moved: 24 + 24
    assert pol._score[3] == 48.0
    assert [pol.pop_victim() for _ in range(3)] == [3, 1, 0]
    assert len(pol) == 0


def test_gdsf_inner_blocks_wait_and_removed_entries_are_skipped() -> None:
    pol = LruSizeEviction(8, block_size=16, miss_cost_tokens=0)
    pol.add(0, False, 1)
    pol.add(1, True, 2)
    pol.add(2, True, 2)
    pol.remove(1)  # a prefix hit
    assert 1 not in pol and len(pol) == 2
    assert pol.pop_victim() == 2
    assert not pol.is_leaf(0)
    assert pol.pop_victim() == 0  # fallback: no leaf left
    pol.add(4, False, 1)
    pol.set_leaf(4, True)
    assert pol.is_leaf(4) and pol.pop_victim() == 4


def test_gdsf_heap_is_compacted_under_churn() -> None:
    pol = LruSizeEviction(64, block_size=16)
    for _ in range(200):
        for b in range(64):
            pol.add(b, True, 1)
        for b in range(64):
            pol.remove(b)
        pol.add(0, True, 1)
        assert pol.pop_victim() == 0
    assert len(pol._leaves) <= 2 * len(pol) + 64 + 64
