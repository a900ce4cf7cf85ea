"""The physical GPU blocks: reference counts, the free list, the prefix index.

Every block is in exactly one of three states:
  free        ref 0, no cached content; on `free_list`
  cached      ref 0, holds a registered prefix block; in `eviction_policy`
  referenced  ref > 0, in at least one sequence's table (may be registered)
so free + cached + referenced == total at all times. All operations are O(1)
per block touched; nothing here scans the pool.

Callers check room with `num_available` before mutating, which is how every
operation above this stays all-or-nothing: allocation never fails halfway.

The index is a tree: each registered block remembers its parent's hash, and
`child_count[h]` counts registered blocks whose parent hash is h. A cached
block with no registered child is a leaf; the eviction policy is told when a
cached block gains its first or loses its last child, so it can take leaves
first and never leave a hole in a cached chain.
"""

from __future__ import annotations

from array import array

from pagedkv.block_manager_svc.core.eviction import EvictionPolicy
from pagedkv.block_manager_svc.core.kv_events import ALL_BLOCKS_CLEARED, BlockRemoved, BlockStored, PoolEvent
from pagedkv.block_manager_svc.core.kv_groups import split_key
from pagedkv.block_manager_svc.core.prefix_cache import DIGEST_SIZE


class BlockPool:
    __slots__ = (
        "num_blocks",
        "ref_counts",
        "free_list",
        "block_hash",
        "parent_hash",
        "depth",
        "child_count",
        "index",
        "eviction_policy",
        "num_evicted",
        "events",
    )

    def __init__(self, num_blocks: int, eviction_policy: EvictionPolicy) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # A stack: pop() hands out low ids first, which keeps tables tidy to read.
        self.free_list: list[int] = list(range(num_blocks - 1, -1, -1))
        # The registered content hash of each block (None when not in the index).
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # For registered blocks: the parent's hash and the depth in the chain (1 = first block).
        self.parent_hash: list[bytes | None] = [None] * num_blocks
        self.depth: list[int] = [0] * num_blocks
        # Parent hash -> registered blocks hashing on top of it (entries > 0 only).
        self.child_count: dict[bytes, int] = {}
        # Prefix-cache index: content hash -> the block holding that content.
        self.index: dict[bytes, int] = {}
        # Orders the cached (unreferenced, registered) blocks: which one to evict next.
        self.eviction_policy = eviction_policy
        bind = getattr(eviction_policy, "bind", None)
        if bind is not None:
            bind(self.block_hash, self.child_count)
        self.num_evicted = 0
        # KV events: None = off, the default and the core's zero-cost path; else
        # a plain list the pool appends to and the servicer drains after every
        # call (BlockManager.take_events -> block_manager_svc/events.py):
        # typed records (core/kv_events.py): BlockStored when a block is
        # registered (its token ids feed vLLM-format events), BlockRemoved when a
        # registered block is evicted, AllBlocksCleared when the index is reset.
        self.events: list[PoolEvent] | None = None

    # --- capacity -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_cached(self) -> int:
        return len(self.eviction_policy)

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free ones plus evictable cached ones."""
        return len(self.free_list) + len(self.eviction_policy)

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
        block = self.eviction_policy.pop_victim()
        h = self.block_hash[block]
        if h is not None:
            if self.index.get(h) == block:
                del self.index[h]
                if self.events is not None:
                    self.events.append(BlockRemoved(*split_key(h)))
            self.block_hash[block] = None
            parent = self.parent_hash[block]
            self.parent_hash[block] = None
            if parent is not None:
                left = self.child_count[parent] - 1
                if left:
                    self.child_count[parent] = left
                else:
                    del self.child_count[parent]
                    p = self.index.get(parent)
                    if p is not None and self.ref_counts[p] == 0:
                        self.eviction_policy.set_leaf(p, True)
        self.num_evicted += 1
        return block

    # --- references -----------------------------------------------------------
    def incref(self, block: int) -> None:
        """Add a reference; a cached block becomes referenced (a prefix hit)."""
        if self.ref_counts[block] == 0:
            self.eviction_policy.remove(block)
        self.ref_counts[block] += 1

    def hit(self, block: int) -> None:
        """A prefix-cache hit: a reference plus a use the eviction policy counts."""
        self.eviction_policy.touch(block)
        self.incref(block)

    def decref(self, block: int) -> bool:
        """Drop a reference; True when the block became unreferenced."""
        ref = self.ref_counts[block] - 1
        self.ref_counts[block] = ref
        if ref:
            return False
        h = self.block_hash[block]
        if h is None:
            self.free_list.append(block)
        else:
            self.eviction_policy.add(block, h not in self.child_count, self.depth[block])
        return True

    # --- prefix index ---------------------------------------------------------
    def register(
        self,
        block: int,
        content_hash: bytes,
        parent: bytes | None = None,
        depth: int = 1,
        tokens: array[int] | None = None,
    ) -> bool:
        """Make a full (referenced) block findable by its content hash.

        `parent` is the hash of the chain's previous block (the root hash for
        a first block), `depth` the block's position in the chain (1-based).
        First writer wins: when another block already holds the same content,
        this one stays unregistered (it is freed, not cached, when released).
        `tokens`: the block's token ids, only for the KV-event stream.
        """
        if self.block_hash[block] is not None or content_hash in self.index:
            return False
        self.index[content_hash] = block
        self.block_hash[block] = content_hash
        self.depth[block] = depth
        if self.events is not None:
            if len(content_hash) > DIGEST_SIZE:  # another KV group's key (core/kv_groups.py)
                h, group = split_key(content_hash)
                up = None if parent is None else split_key(parent)[0]
                self.events.append(BlockStored(block, h, up, tokens, group))
            else:
                self.events.append(BlockStored(block, content_hash, parent, tokens))
        if parent is not None:
            self.parent_hash[block] = parent
            count = self.child_count.get(parent, 0)
            self.child_count[parent] = count + 1
            if not count:
                p = self.index.get(parent)
                if p is not None and self.ref_counts[p] == 0:
                    self.eviction_policy.set_leaf(p, False)
        return True

    def clear_index(self) -> tuple[int, int]:
        """Forget every registered hash: (index entries dropped, cached blocks freed).

        Cached blocks go to the free list; referenced blocks keep their
        references but lose their hash, so they are freed, not cached, when
        released. O(pool); the containers the eviction policy was bound to are
        cleared in place. Events get one AllBlocksCleared.
        """
        cleared = len(self.index)
        freed = 0
        block_hash, ref_counts = self.block_hash, self.ref_counts
        for b in range(self.num_blocks):
            if block_hash[b] is None:
                continue
            if ref_counts[b] == 0:
                self.eviction_policy.remove(b)
                self.free_list.append(b)
                freed += 1
            block_hash[b] = None
            self.parent_hash[b] = None
            self.depth[b] = 0
        self.index.clear()
        self.child_count.clear()
        if self.events is not None:
            self.events.append(ALL_BLOCKS_CLEARED)
        return cleared, freed
