"""Which unreferenced cached block to give up when the free list is empty.

A policy only orders the evictable set; the block pool decides when to evict
and keeps the prefix index consistent. The interface is small so that other
orders (size- and frequency-aware ones) plug in by setting.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders unreferenced blocks that still hold prefix-cache content."""

    name: str

    def add(self, block: int) -> None:
        """`block` lost its last reference but keeps its cached content."""

    def remove(self, block: int) -> None:
        """`block` was referenced again (a prefix hit); it is no longer evictable."""

    def pop_victim(self) -> int:
        """Remove and return the block to evict next. The set is not empty."""

    def __len__(self) -> int: ...

    def __contains__(self, block: int) -> bool: ...


class LruEviction:
    """Least recently released first (vLLM's order).

    Sequences release their blocks tail first, so within one prefix chain the
    deepest blocks become older than their parents and go first: a chain loses
    its leaves before its root and never keeps a hole. O(1) per operation.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        self._order[block] = None

    def remove(self, block: int) -> None:
        del self._order[block]

    def pop_victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order


def make_eviction_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LruEviction()
    raise ValueError(f"unknown eviction policy {name!r} (known: lru)")
