"""Which unreferenced cached block to give up when the free list is empty.

A policy only orders the evictable set; the block pool decides when to evict
and keeps the prefix index consistent. The pool also tells the policy which
cached blocks are *leaves* of the prefix tree (no block in the index hashes
on top of them): evicting an inner block would leave a hole, making every
block below it unreachable to lookups, so both policies take leaves first and
fall back to an inner block only when no cached leaf exists at all (which
only happens when a duplicate registration made a referenced block the child
of a cached one).

Two orders, chosen by the `eviction_policy` setting:

* `lru`: vLLM's, least recently released first. O(1) per operation.
* `lru-size` (default of the service): Greedy-Dual-Size-Frequency over
  prefix runs. Each cached block gets, when it is released, the score

      H = L + F * C / S,    C / S = block_size + miss_cost_tokens / depth

  where L is the inflation clock (the score of the last victim: everything
  released later starts above everything evicted so far, which is recency),
  F = 1 + the number of prefix hits the block has served (frequency),
  depth = the block's position in its prefix chain, in blocks: the size S of
  the cached run a request needs from the root to use this block, and
  C = S * block_size + miss_cost_tokens is the cost of a miss on that run:
  its tokens to re-prefill plus a fixed per-miss overhead (an extra prefill
  pass, its queueing and launch cost) expressed in tokens. The leaf with the
  lowest H goes first, so large, rarely hit, cold runs go before small hot
  ones. See docs/policies.md for why. O(log n) per operation: a binary heap
  with lazy deletion (a generation per block), compacted when stale entries
  outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Protocol

from pagedkv import defaults

DEFAULT_MISS_COST_TOKENS = 64


class EvictionPolicy(Protocol):
    """Orders unreferenced blocks that still hold prefix-cache content."""

    name: str

    def add(self, block: int, is_leaf: bool, depth: int) -> None:
        """`block` lost its last reference but keeps its cached content.

        `is_leaf`: no registered block names it as parent. `depth`: its
        position in its prefix chain, in blocks (1 = first block)."""

    def remove(self, block: int) -> None:
        """`block` was referenced again (a prefix hit); it is no longer evictable."""

    def set_leaf(self, block: int, is_leaf: bool) -> None:
        """A cached block gained its first or lost its last registered child."""

    def touch(self, block: int) -> None:
        """A prefix lookup hit `block` (cached or referenced)."""

    def pop_victim(self) -> int:
        """Remove and return the block to evict next (its history is dropped:
        it leaves the prefix index). The set is not empty."""

    def is_leaf(self, block: int) -> bool:
        """Whether the policy holds cached `block` as a leaf (for invariant checks)."""

    def __len__(self) -> int: ...

    def __contains__(self, block: int) -> bool: ...


class LruEviction:
    """Least recently released first (vLLM's order), leaves first.

    Sequences release their blocks tail first and a block's children are only
    ever held by sequences that also hold it, so in release order a chain's
    deepest blocks are older than their parents: the oldest cached block is a
    leaf. That is checked when a victim is popped (the pool binds its prefix
    tree, see `bind`); the one exception (a referenced block registered as the
    child of a cached duplicate) is set aside and comes back, as the most
    recent, once it is a leaf again. O(1) amortized per operation, and nothing
    but an OrderedDict insert on the release path.
    """

    name = "lru"
    exact_leaves = False  # leaf status is checked lazily, at pop time

    def __init__(self, num_blocks: int = 0) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._aside: OrderedDict[int, None] = OrderedDict()  # cached, popped while inner
        self._block_hash: list[bytes | None] | None = None
        self._child_count: dict[bytes, int] = {}

    def bind(self, block_hash: list[bytes | None], child_count: dict[bytes, int]) -> None:
        self._block_hash = block_hash
        self._child_count = child_count

    def add(self, block: int, is_leaf: bool = True, depth: int = 1) -> None:
        self._order[block] = None

    def remove(self, block: int) -> None:
        if block in self._order:
            del self._order[block]
        else:
            del self._aside[block]

    def set_leaf(self, block: int, is_leaf: bool) -> None:
        if is_leaf and block in self._aside:
            del self._aside[block]
            self._order[block] = None

    def touch(self, block: int) -> None:
        pass

    def pop_victim(self) -> int:
        order, block_hash, children = self._order, self._block_hash, self._child_count
        while order:
            block = order.popitem(last=False)[0]
            if block_hash is None or block_hash[block] not in children:
                return block
            self._aside[block] = None
        return self._aside.popitem(last=False)[0]

    def is_leaf(self, block: int) -> bool:
        return block not in self._aside

    def __len__(self) -> int:
        return len(self._order) + len(self._aside)

    def __contains__(self, block: int) -> bool:
        return block in self._order or block in self._aside


_NOT_CACHED, _LEAF, _INNER = 0, 1, 2


class LruSizeEviction:
    """Greedy-Dual-Size-Frequency over prefix runs, leaves first (see module doc).

    Leaves live in a binary heap of (score, tick, block) with lazy deletion:
    `_gen[block]` is the tick of the block's live entry (0: none), so removing
    is O(1) and stale entries are skipped when popped; the heap is rebuilt
    when stale entries outnumber live ones. The newest leaf entry waits in
    `_pending` and enters with the next pop through heappushpop, which is O(1)
    when it is the smallest, the common case when a chain is evicted from its
    tail (each evicted leaf exposes its parent). Inner cached blocks wait in
    insertion order and are only taken when no leaf is cached.
    """

    name = "lru-size"
    exact_leaves = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int = defaults.BLOCK_SIZE,
        miss_cost_tokens: float = DEFAULT_MISS_COST_TOKENS,
    ) -> None:
        self.block_size = block_size
        self.miss_cost_tokens = miss_cost_tokens
        self.clock = 0.0  # L, the inflation clock
        self._score = [0.0] * num_blocks
        self._hits = [0] * num_blocks
        self._state = bytearray(num_blocks)
        self._gen = [0] * num_blocks
        self._tick = 0
        self._leaves: list[tuple[float, int, int]] = []
        self._pending: tuple[float, int, int] | None = None
        self._inner: OrderedDict[int, None] = OrderedDict()
        self._len = 0

    def score(self, block: int, depth: int) -> float:
        """H = L + F * (block_size + miss_cost_tokens / depth)."""
        freq = 1 + self._hits[block]
        return self.clock + freq * (self.block_size + self.miss_cost_tokens / (depth if depth > 0 else 1))

    def _push_leaf(self, block: int) -> None:
        self._tick = tick = self._tick + 1
        self._gen[block] = tick
        self._state[block] = _LEAF
        pending = self._pending
        if pending is not None:
            heapq.heappush(self._leaves, pending)
        self._pending = (self._score[block], tick, block)

    def add(self, block: int, is_leaf: bool = True, depth: int = 1) -> None:
        self._score[block] = self.score(block, depth)
        self._len += 1
        if is_leaf:
            self._push_leaf(block)
        else:
            self._state[block] = _INNER
            self._inner[block] = None

    def remove(self, block: int) -> None:
        if self._state[block] == _INNER:
            del self._inner[block]
        self._state[block] = _NOT_CACHED
        self._gen[block] = 0
        self._len -= 1

    def set_leaf(self, block: int, is_leaf: bool) -> None:
        state = self._state[block]
        if is_leaf:
            if state == _INNER:
                del self._inner[block]
                # Keeps the score it was released with: exposing a parent is not a use.
                self._push_leaf(block)
        elif state == _LEAF:
            self._gen[block] = 0
            self._state[block] = _INNER
            self._inner[block] = None

    def touch(self, block: int) -> None:
        self._hits[block] += 1

    def pop_victim(self) -> int:
        heap, gen = self._leaves, self._gen
        pending = self._pending
        if pending is not None:
            self._pending = None
            entry: tuple[float, int, int] | None = heapq.heappushpop(heap, pending) if heap else pending
        else:
            entry = heapq.heappop(heap) if heap else None
        while entry is not None:
            score, tick, block = entry
            if gen[block] == tick:
                gen[block] = 0
                self._hits[block] = 0
                self._state[block] = _NOT_CACHED
                self._len -= 1
                if score > self.clock:
                    self.clock = score
                if len(heap) > 2 * self._len + 64:
                    self._compact()
                return block
            entry = heapq.heappop(heap) if heap else None
        if not self._inner:
            raise IndexError("pop_victim on an empty eviction policy")
        block = self._inner.popitem(last=False)[0]
        self._hits[block] = 0
        self._state[block] = _NOT_CACHED
        self._len -= 1
        return block

    def _compact(self) -> None:
        gen = self._gen
        heap = [e for e in self._leaves if gen[e[2]] == e[1]]
        heapq.heapify(heap)
        self._leaves = heap

    def is_leaf(self, block: int) -> bool:
        return self._state[block] == _LEAF

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return self._state[block] != _NOT_CACHED


POLICIES = ("lru", "lru-size")


def make_eviction_policy(
    name: str,
    num_blocks: int = 0,
    block_size: int = defaults.BLOCK_SIZE,
    miss_cost_tokens: float = DEFAULT_MISS_COST_TOKENS,
) -> EvictionPolicy:
    if name == "lru":
        return LruEviction(num_blocks)
    if name == "lru-size":
        return LruSizeEviction(num_blocks, block_size, miss_cost_tokens)
    raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})")
