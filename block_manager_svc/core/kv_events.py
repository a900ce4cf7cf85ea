"""What the block pool tells the KV-event hub: typed records, one per change of the prefix index.

The pool appends them to ``BlockPool.events`` (when recording is on) and the servicer's core
stage drains them after every call into block_manager_svc/events.py, which numbers them and
fans them out (gRPC watchers, the ZeroMQ publisher). They name blocks and chain hashes only;
which tenant caused them is the hub's business. With several KV-cache groups (core/kv_groups.py)
each names the group whose block it is (`group`, 0 with one group); the hashes are the chain
hashes, the same for every group.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BlockStored:
    """`block` entered the prefix cache under `block_hash`, chained on `parent_hash`
    (None for a chain's first block). `token_ids`: the block's tokens, for vLLM-format
    BlockStored events; None when recording started without them."""

    block: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: array[int] | None = None
    group: int = 0


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """The cached block registered under `block_hash` was evicted: the hash names nothing now."""

    block_hash: bytes
    group: int = 0


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """Every hash of the prefix index was forgotten (ResetPrefixCache)."""


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared
ALL_BLOCKS_CLEARED = AllBlocksCleared()
