"""The physical GPU blocks: reference counts, the free list, the prefix index.

Every block is in exactly one of three states:
  free        ref 0, no cached content; on `free_list`
  cached      ref 0, holds a registered prefix block; in the eviction policy
  referenced  ref > 0, in at least one sequence's table (may be registered)
so free + cached + referenced == total at all times. All operations are O(1)
per block touched; nothing here scans the pool.

Callers check room with `num_available` before mutating, which is how every
operation above this stays all-or-nothing: allocation never fails halfway.
"""

from __future__ import annotations

from block_manager_svc.core.eviction import EvictionPolicy


class BlockPool:
    __slots__ = ("num_blocks", "ref_counts", "free_list", "block_hash", "index", "evictable", "num_evicted")

    def __init__(self, num_blocks: int, evictable: EvictionPolicy) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # A stack: pop() hands out low ids first, which keeps tables tidy to read.
        self.free_list: list[int] = list(range(num_blocks - 1, -1, -1))
        # The registered content hash of each block (None when not in the index).
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Prefix-cache index: content hash -> the block holding that content.
        self.index: dict[bytes, int] = {}
        self.evictable = evictable
        self.num_evicted = 0

    # --- capacity -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_cached(self) -> int:
        return len(self.evictable)

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free ones plus evictable cached ones."""
        return len(self.free_list) + len(self.evictable)

    # --- allocation -----------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """n blocks with ref count 1; the caller has checked `num_available`."""
        free_list = self.free_list
        ref_counts = self.ref_counts
        out: list[int] = []
        for _ in range(n):
            block = free_list.pop() if free_list else self._evict_one()
            ref_counts[block] = 1
            out.append(block)
        return out

    def take_one(self) -> int:
        block = self.free_list.pop() if self.free_list else self._evict_one()
        self.ref_counts[block] = 1
        return block

    def _evict_one(self) -> int:
        block = self.evictable.pop_victim()
        h = self.block_hash[block]
        if h is not None:
            if self.index.get(h) == block:
                del self.index[h]
            self.block_hash[block] = None
        self.num_evicted += 1
        return block

    # --- references -----------------------------------------------------------
    def incref(self, block: int) -> None:
        """Add a reference; a cached block becomes referenced (a prefix hit)."""
        if self.ref_counts[block] == 0:
            self.evictable.remove(block)
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop a reference; True when the block became unreferenced."""
        ref = self.ref_counts[block] - 1
        self.ref_counts[block] = ref
        if ref:
            return False
        if self.block_hash[block] is None:
            self.free_list.append(block)
        else:
            self.evictable.add(block)
        return True

    # --- prefix index ---------------------------------------------------------
    def register(self, block: int, content_hash: bytes) -> bool:
        """Make a full block findable by its content hash.

        First writer wins: when another block already holds the same content,
        this one stays unregistered (it is freed, not cached, when released).
        """
        if self.block_hash[block] is not None or content_hash in self.index:
            return False
        self.index[content_hash] = block
        self.block_hash[block] = content_hash
        return True

    def lookup(self, content_hash: bytes) -> int | None:
        return self.index.get(content_hash)
