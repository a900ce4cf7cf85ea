"""Per-sequence bookkeeping: its block table and what is needed to hash it."""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(slots=True)
class Sequence:
    """One sequence's view of the pool.

    Only the tokens after the last hashed block are kept (`pending_tokens`):
    everything before is summarised by `last_hash`, the chain hash of the last
    hashed block, which is all that hashing the next block needs. Blocks are
    hashed (and enter the prefix cache) at Commit, not when they fill up, so
    `pending_tokens` may span several full blocks whose KV is not written yet.
    It is None once any token id was not supplied: from then on the content is
    unknown and no further block of this sequence can enter the prefix cache.

    `num_committed` is the largest Commit so far: the leading tokens whose KV
    the client said is written. It survives swap-out/in (the KV moves with the
    blocks) and is inherited by a fork (the child shares those blocks).
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
    num_committed: int = 0

    def __setstate__(self, state: object) -> None:
        """Snapshots written before Commit existed lack `num_committed`: the old manager
        registered everything a sequence held, so all of it counts as committed."""
        _, slots = state if isinstance(state, tuple) else (None, state)
        for k, v in (slots or {}).items():  # type: ignore[union-attr]
            setattr(self, k, v)
        if not hasattr(self, "num_committed"):
            self.num_committed = self.num_tokens
