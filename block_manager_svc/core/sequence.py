"""Per-sequence bookkeeping: its block table and what is needed to hash it;
and the rule for what a sequence id may be."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from pagedkv.block_manager_svc.core.errors import InvalidArgument

MAX_SEQ_ID_LEN = 256
# With authentication on, the servicer keys each sequence by its tenant's
# namespace, ``tenant + SEP + client id`` (pagedkv.auth.Tenant.prefix), so that
# tenant A's "seq-1" is not tenant B's. The core never reads the tenant out of
# it (the tenant is passed as data); only the id check below looks past it.
SEP = "\x1f"  # ASCII unit separator: never valid in a client id (not printable)


def check_seq_id(seq_id: str, what: str = "seq_id") -> None:
    """A sequence id is non-empty printable text of at most MAX_SEQ_ID_LEN characters."""
    if not seq_id:
        raise InvalidArgument(f"{what} must not be empty")
    if len(seq_id) > MAX_SEQ_ID_LEN or not seq_id.isprintable():
        _check_seq_id_slow(seq_id, what)


def _check_seq_id_slow(seq_id: str, what: str) -> None:
    # A tenant-namespaced id ("tenant<SEP>id", built by the servicer) is
    # judged by its client part: that is what the client sent and sees.
    local = seq_id.rpartition(SEP)[2] if SEP in seq_id else seq_id
    if not local:
        raise InvalidArgument(f"{what} must not be empty")
    if len(local) > MAX_SEQ_ID_LEN:
        raise InvalidArgument(f"{what} is {len(local)} characters long; the limit is {MAX_SEQ_ID_LEN}")
    if not local.isprintable():
        raise InvalidArgument(f"{what} must be printable text (no control characters)")


@dataclass(slots=True)
class SeqState:
    """One sequence's view of the pool.

    Only the tokens after the last hashed block are kept (`pending_tokens`):
    everything before is summarised by `last_hash`, the chain hash of the last
    hashed block, which is all that hashing the next block needs. Blocks are
    hashed (and enter the prefix cache) at Commit, not when they fill up, so
    `pending_tokens` may span several full blocks whose KV is not written yet.
    It is None once any token id was not supplied: from then on the content is
    unknown and no further block of this sequence can enter the prefix cache.

    `pending_hashes` are the chain hashes of the first full blocks of
    `pending_tokens` that Allocate already computed for its prefix lookup, so
    Commit registers them without hashing them a second time; blocks filled by
    appends are hashed once, at Commit.

    `num_committed` is the largest Commit so far: the leading tokens whose KV
    the client said is written. It survives swap-out/in (the KV moves with the
    blocks) and is inherited by a fork (the child shares those blocks).

    `tenant` is who the sequence is charged to ("" with tenancy off); it is
    set once at admission and inherited by forks.

    `ahead_block` is a block granted ahead of need (Grant, -1: none): private,
    charged to the sequence and freed with it, but not in `block_ids` (so
    `len(block_ids)` stays the blocks its tokens fill). The first append that
    needs a new block takes it instead of a block from the pool, so the
    frontend, which was told its id, may write the next block's KV before
    telling the manager of those tokens. It is never shared (a fork does not
    inherit it) and never swapped (swap-out releases it).

    With several KV-cache groups (core/kv_groups.py), `block_ids` is group 0's
    table (full attention) and `kv_tables[g - 1]` group g's: a full group's
    whole table, a window group's live tail (its first entry is block index
    len(block_ids) - len(tail)). Empty with one group. While swapped,
    `cpu_kv_tables` holds the other groups' CPU blocks likewise.
    """

    seq_id: str
    block_ids: list[int]
    num_tokens: int
    pending_tokens: array[int] | None
    last_hash: bytes
    num_hashed_blocks: int
    priority: int
    arrival: int
    # Fork group: the arrival of the group's first sequence (core/preemption.py).
    group: int = 0
    # Set while swapped out: its CPU blocks (block_ids is then empty).
    cpu_block_ids: list[int] | None = None
    num_committed: int = 0
    pending_hashes: list[bytes] = field(default_factory=list)
    tenant: str = ""
    ahead_block: int = -1
    kv_tables: list[list[int]] = field(default_factory=list)
    cpu_kv_tables: list[list[int]] | None = None
