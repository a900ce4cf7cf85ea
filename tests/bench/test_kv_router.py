"""bench/kv_router.py: the router's per-pool index follows stored/removed/cleared events."""

from __future__ import annotations

from bench.kv_router import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PoolIndex,
    PrefixAwareRouter,
    chain_keys,
)

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS)


def test_index_follows_events() -> None:
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    keys = chain_keys(prompt, BS)
    assert len(keys) == 3
    idx = PoolIndex()
    # The engine's hashes are opaque to the router: chains are rebuilt from token ids + parents.
    idx.apply(EventBatch(0.0, [stored([11, 12], None, prompt[:8])]))
    assert idx.overlap(keys) == 2
    idx.apply(EventBatch(0.0, [stored([13], 12, prompt[8:12])]))
    assert idx.overlap(keys) == 3
    idx.apply(EventBatch(0.0, [BlockRemoved(block_hashes=[12])]))
    assert idx.overlap(keys) == 1  # a hole: only the leading run counts
    idx.apply(EventBatch(0.0, [stored([99], 7777, [1, 2, 3, 4])]))  # parent never seen: not keyed
    assert 99 not in idx.by_engine_hash
    idx.apply(EventBatch(0.0, [AllBlocksCleared()]))
    assert idx.overlap(keys) == 0 and not idx.keys


class _Fixed:
    def __init__(self, n: int) -> None:
        self.n = n

    def overlap(self, keys: list[int]) -> int:
        return min(self.n, len(keys))


def test_router_prefers_overlap_then_load() -> None:
    prompt = list(range(16))
    r = PrefixAwareRouter([_Fixed(0), _Fixed(4)], BS)  # type: ignore[list-item]
    assert r.pick(prompt, [0, 0]) == 1
    assert r.pick(prompt, [0, 3]) == 1  # full overlap (3) beats the load term (2)
    r = PrefixAwareRouter([_Fixed(0), _Fixed(0)], BS)  # type: ignore[list-item]
    assert r.pick(prompt, [5, 1]) == 1  # no overlap anywhere: the less loaded pool
