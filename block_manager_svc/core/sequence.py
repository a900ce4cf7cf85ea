"""Per-sequence bookkeeping: its block table and what is needed to hash it."""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(slots=True)
class Sequence:
    """One sequence's view of the pool.

    Only the tokens of the not-yet-full tail are kept (`pending_tokens`):
    everything before is summarised by `last_hash`, the chain hash of the last
    full block, which is all that hashing the next block needs. `pending_tokens`
    is None once any token id was not supplied: from then on the content is
    unknown and no further block of this sequence can enter the prefix cache.
    """

    seq_id: str
    block_ids: list[int]
    num_tokens: int
    pending_tokens: array | None
    last_hash: bytes
    num_hashed_blocks: int
    priority: int
    arrival: int
    # Fork group: the arrival of the group's first sequence (see core/preemption.py).
    group: int = 0
    # Set while swapped out: its CPU blocks (block_ids is then empty).
    cpu_block_ids: list[int] | None = None
