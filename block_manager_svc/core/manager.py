"""The block manager's decisions: Allocate, Append, Fork, Free, Step.

Pure Python, no I/O, no clock: the gRPC servicer (or an in-process engine)
calls these under its own lock. Every public method validates everything and
checks room *before* it mutates anything, so it either fully happens or raises
a `CoreError` with the state untouched. Work is O(blocks touched) per call: no
scans over the pool or over all sequences.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

from block_manager_svc.core.block_pool import BlockPool
from block_manager_svc.core.errors import (
    AlreadyExists,
    CoreError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from block_manager_svc.core.eviction import make_eviction_policy
from array import array

from block_manager_svc.core.prefix_cache import ROOT_HASH, chain_hash, chain_hashes, encode_tokens
from block_manager_svc.core.results import (
    AllocateResult,
    AppendResult,
    BlockTable,
    CacheOps,
    ItemError,
    Stats,
    StepResult,
)
from block_manager_svc.core.sequence import Sequence

MAX_SEQ_ID_LEN = 256
MAX_TOKEN_ID = 2**32 - 1


@dataclass(slots=True, frozen=True)
class CoreConfig:
    num_gpu_blocks: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    eviction_policy: str = "lru"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")


def _check_seq_id(seq_id: str, what: str = "seq_id") -> None:
    if not seq_id:
        raise InvalidArgument(f"{what} must not be empty")
    if len(seq_id) > MAX_SEQ_ID_LEN:
        raise InvalidArgument(f"{what} is {len(seq_id)} characters long; the limit is {MAX_SEQ_ID_LEN}")


def _encode_token_ids(token_ids: SequenceT[int], num_tokens: int, what: str = "token_ids") -> array:
    """Validate and pack token ids once; hashing works on the packed form."""
    if len(token_ids) != num_tokens:
        raise InvalidArgument(
            f"{what} has {len(token_ids)} entries but num_tokens is {num_tokens}; they must match"
        )
    try:
        return encode_tokens(token_ids)
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(f"{what} must be integers in [0, 2**32): {e}") from None


class BlockManager:
    """Owns block tables, reference counts and the prefix-cache index."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_gpu_blocks, make_eviction_policy(config.eviction_policy))
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_cow_copies = 0

    # --- helpers ------------------------------------------------------------
    def _get(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            _check_seq_id(seq_id)
            raise NotFound(f"sequence {seq_id!r} does not exist")
        return seq

    def _exhausted(self, what: str, needed: int, available: int) -> ResourceExhausted:
        pool = self.pool
        return ResourceExhausted(
            f"{what} needs {needed} blocks but only {available} are available "
            f"({pool.num_free} free, {pool.num_cached} cached evictable, "
            f"{pool.num_blocks} total)"
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- Allocate -----------------------------------------------------------
    def allocate(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: SequenceT[int] | None = None,
        priority: int = 0,
    ) -> AllocateResult:
        """Blocks for a new sequence's prompt, reusing cached prefix blocks.

        Hits are whole blocks and never include the block holding the prompt's
        last token: the frontend must compute at least one token to get logits,
        and writing KV into a block other sequences read would race.
        """
        _check_seq_id(seq_id)
        if seq_id in self.seqs:
            raise AlreadyExists(f"sequence {seq_id!r} already exists")
        if num_tokens < 1:
            raise InvalidArgument("num_tokens must be at least 1")
        tokens = None
        if token_ids is not None and len(token_ids) > 0:
            tokens = _encode_token_ids(token_ids, num_tokens)
        bs = self.block_size
        pool = self.pool
        total_blocks = self._blocks_for(num_tokens)
        if total_blocks > pool.num_blocks:
            raise InvalidArgument(
                f"a prompt of {num_tokens} tokens needs {total_blocks} blocks of {bs}, "
                f"more than the whole pool ({pool.num_blocks} blocks)"
            )

        num_full = num_tokens // bs
        hashes: list[bytes] = []
        hits: list[int] = []
        if tokens is not None and self.config.enable_prefix_caching:
            hashes = chain_hashes(ROOT_HASH, tokens, bs, num_full)
            max_hits = (num_tokens - 1) // bs
            index = pool.index
            for h in hashes[:max_hits]:
                block = index.get(h)
                if block is None:
                    break
                hits.append(block)
        ref_counts = pool.ref_counts
        hits_from_cache = sum(1 for b in hits if ref_counts[b] == 0)
        needed = total_blocks - len(hits)
        available = pool.num_available - hits_from_cache
        if needed > available:
            raise self._exhausted(f"allocating {num_tokens} tokens for {seq_id!r}", needed, available)

        # Commit: nothing below can fail.
        for b in hits:
            pool.incref(b)
        block_ids = hits + pool.take(needed)
        for i in range(len(hits), len(hashes)):
            pool.register(block_ids[i], hashes[i])
        pending: array | None = None
        if tokens is not None:
            self.prefix_query_tokens += num_tokens
            self.prefix_hit_tokens += len(hits) * bs
            pending = tokens[num_full * bs :]
            last_hash = hashes[-1] if hashes else ROOT_HASH
            num_hashed = len(hashes)
        else:
            pending, last_hash, num_hashed = None, ROOT_HASH, 0
        if not self.config.enable_prefix_caching:
            pending = None
        self._arrivals += 1
        self.seqs[seq_id] = Sequence(
            seq_id=seq_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            pending_tokens=pending,
            last_hash=last_hash,
            num_hashed_blocks=num_hashed,
            priority=priority,
            arrival=self._arrivals,
        )
        return AllocateResult(block_ids=list(block_ids), num_cached_tokens=len(hits) * bs)

    # --- Append -------------------------------------------------------------
    def _plan_append(self, seq: Sequence, num_tokens: int) -> tuple[bool, int]:
        """(copy_on_write, blocks needed) for growing `seq`; raises if it cannot."""
        if num_tokens < 1:
            raise InvalidArgument("num_tokens must be at least 1")
        bs = self.block_size
        pool = self.pool
        cur = seq.num_tokens
        after = -(-(cur + num_tokens) // bs)
        if after > pool.num_blocks:
            raise InvalidArgument(
                f"sequence {seq.seq_id!r} would need {after} blocks for {cur + num_tokens} tokens, "
                f"more than the whole pool ({pool.num_blocks} blocks)"
            )
        cow = cur % bs != 0 and pool.ref_counts[seq.block_ids[-1]] > 1
        needed = after - len(seq.block_ids) + cow
        if needed > pool.num_available:
            raise self._exhausted(
                f"appending {num_tokens} tokens to {seq.seq_id!r}", needed, pool.num_available
            )
        return cow, needed

    def _apply_append(
        self, seq: Sequence, num_tokens: int, token_ids: array | None, cow: bool, needed: int
    ) -> tuple[list[int], tuple[int, int] | None]:
        pool = self.pool
        copy: tuple[int, int] | None = None
        new_blocks: list[int] = []
        if cow:
            old = seq.block_ids[-1]
            fresh = pool.take_one()
            pool.decref(old)  # still referenced by the other sharers
            seq.block_ids[-1] = fresh
            copy = (old, fresh)
            new_blocks.append(fresh)
            self.num_cow_copies += 1
            needed -= 1
        if needed:
            grown = pool.take(needed)
            seq.block_ids.extend(grown)
            new_blocks.extend(grown)
        seq.num_tokens += num_tokens
        pending = seq.pending_tokens
        if pending is not None:
            if token_ids is None:
                seq.pending_tokens = None
            else:
                pending.extend(token_ids)
                if len(pending) >= self.block_size:
                    self._register_full_blocks(seq, pending)
        return new_blocks, copy

    def _register_full_blocks(self, seq: Sequence, pending: array) -> None:
        bs = self.block_size
        pool = self.pool
        h = seq.last_hash
        i = 0
        while len(pending) - i >= bs:
            h = chain_hash(h, pending[i : i + bs])
            pool.register(seq.block_ids[seq.num_hashed_blocks], h)
            seq.num_hashed_blocks += 1
            i += bs
        seq.last_hash = h
        del pending[:i]

    def append(
        self, seq_id: str, num_tokens: int, token_ids: SequenceT[int] | None = None
    ) -> AppendResult:
        """Room for `num_tokens` more tokens; copy-on-write if the tail is shared."""
        seq = self._get(seq_id)
        tokens = None
        if token_ids is not None and len(token_ids) > 0:
            tokens = _encode_token_ids(token_ids, num_tokens)
        cow, needed = self._plan_append(seq, num_tokens)
        new_blocks, copy = self._apply_append(seq, num_tokens, tokens, cow, needed)
        ops = CacheOps(copies=[copy] if copy else [])
        return AppendResult(new_block_ids=new_blocks, ops=ops, replaced_last_block=copy is not None)

    # --- Fork / Free --------------------------------------------------------
    def fork(self, parent_seq_id: str, child_seq_id: str) -> list[int]:
        """The child shares every block of the parent (copy-on-write later)."""
        _check_seq_id(child_seq_id, "child_seq_id")
        parent = self.seqs.get(parent_seq_id)
        if parent is None:
            _check_seq_id(parent_seq_id, "parent_seq_id")
            raise NotFound(f"parent sequence {parent_seq_id!r} does not exist")
        if child_seq_id in self.seqs:
            raise AlreadyExists(f"sequence {child_seq_id!r} already exists")
        for b in parent.block_ids:
            self.pool.incref(b)
        self._arrivals += 1
        self.seqs[child_seq_id] = Sequence(
            seq_id=child_seq_id,
            block_ids=list(parent.block_ids),
            num_tokens=parent.num_tokens,
            pending_tokens=None if parent.pending_tokens is None else array("I", parent.pending_tokens),
            last_hash=parent.last_hash,
            num_hashed_blocks=parent.num_hashed_blocks,
            priority=parent.priority,
            arrival=self._arrivals,
        )
        return list(parent.block_ids)

    def free(self, seq_id: str) -> int:
        """Release a sequence; returns how many blocks became unreferenced.

        Tail first, so that under LRU a chain's deepest blocks are the oldest
        and are evicted before their parents.
        """
        seq = self._get(seq_id)
        del self.seqs[seq_id]
        decref = self.pool.decref
        return sum(1 for b in reversed(seq.block_ids) if decref(b))

    # --- queries ------------------------------------------------------------
    def block_table(self, seq_id: str) -> BlockTable:
        seq = self._get(seq_id)
        return BlockTable(block_ids=list(seq.block_ids), num_tokens=seq.num_tokens)

    def stats(self) -> Stats:
        pool = self.pool
        free, cached = pool.num_free, pool.num_cached
        return Stats(
            block_size=self.block_size,
            num_gpu_blocks=pool.num_blocks,
            num_free_blocks=free,
            num_cached_blocks=cached,
            num_used_blocks=pool.num_blocks - free - cached,
            num_sequences=len(self.seqs),
            num_hashed_blocks=len(pool.index),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_evicted_blocks=pool.num_evicted,
            num_cow_copies=self.num_cow_copies,
        )

    # --- Step ---------------------------------------------------------------
    def step(
        self,
        append_seq_ids: SequenceT[str],
        append_num_tokens: SequenceT[int] | None = None,
        append_token_ids: SequenceT[int] | None = None,
        free_seq_ids: SequenceT[str] = (),
        appends: SequenceT[tuple[str, int, SequenceT[int] | None]] = (),
    ) -> StepResult:
        """One scheduler step: frees first (they make room), then `appends`,
        then the packed appends.

        Items are independent and each is atomic: a rejected item is reported
        in the result and changes nothing, the others still apply. Packed
        inputs are parallel arrays (a count per sequence, token ids
        concatenated) because that is what the wire carries cheaply; `None`
        counts mean one token each, `None` token ids mean the ids are unknown.
        `appends` holds (seq_id, num_tokens, token_ids or None) items whose
        results come back one per item in `item_results`.
        """
        result = StepResult()
        n = len(append_seq_ids)
        if append_num_tokens is not None and len(append_num_tokens) == 0:
            append_num_tokens = None
        if append_token_ids is not None and len(append_token_ids) == 0:
            append_token_ids = None
        if append_num_tokens is not None and len(append_num_tokens) != n:
            raise InvalidArgument(
                f"append_num_tokens has {len(append_num_tokens)} entries for {n} sequences; they must match"
            )
        if append_token_ids is not None:
            expected = n if append_num_tokens is None else sum(append_num_tokens)
            if len(append_token_ids) != expected:
                raise InvalidArgument(
                    f"append_token_ids has {len(append_token_ids)} entries but the counts add up to "
                    f"{expected}; they must match"
                )
            append_token_ids = _encode_token_ids(append_token_ids, expected, "append_token_ids")

        released = result.released
        for j, seq_id in enumerate(free_seq_ids):
            try:
                released.append(self.free(seq_id))
            except CoreError as e:
                released.append(0)
                result.free_errors.append(ItemError(j, seq_id, e.code, e.message))

        item_results = result.item_results
        for j, (seq_id, k, token_ids) in enumerate(appends):
            try:
                item_results.append(self.append(seq_id, k, token_ids))
            except CoreError as e:
                item_results.append(None)
                result.item_errors.append(ItemError(j, seq_id, e.code, e.message))

        seqs = self.seqs
        bs = self.block_size
        ref_counts = self.pool.ref_counts
        register = self._register_full_blocks
        offset = 0
        for i in range(n):
            seq_id = append_seq_ids[i]
            seq = seqs.get(seq_id)
            if append_num_tokens is None:
                k = 1
                if seq is not None:
                    # Decode fast path: one token that fits in a private tail.
                    cur = seq.num_tokens
                    if cur % bs and ref_counts[seq.block_ids[-1]] == 1:
                        seq.num_tokens = cur + 1
                        pending = seq.pending_tokens
                        if pending is not None:
                            if append_token_ids is None:
                                seq.pending_tokens = None
                            else:
                                pending.append(append_token_ids[i])
                                if len(pending) == bs:
                                    register(seq, pending)
                        continue
                tokens = None if append_token_ids is None else append_token_ids[i : i + 1]
            else:
                k = append_num_tokens[i]
                tokens = None if append_token_ids is None else append_token_ids[offset : offset + k]
                offset += k
            self._step_append_slow(result, i, seq_id, seq, k, tokens)
        return result

    def _step_append_slow(
        self, result: StepResult, i: int, seq_id: str, seq: Sequence | None, k: int, tokens: array | None
    ) -> None:
        try:
            if seq is None:
                self._get(seq_id)  # raises the precise error
                raise AssertionError("unreachable")
            cow, needed = self._plan_append(seq, k)
        except CoreError as e:
            result.append_errors.append(ItemError(i, seq_id, e.code, e.message))
            return
        blocks, copy = self._apply_append(seq, k, tokens, cow, needed)
        if copy is not None:
            result.ops.copies.append(copy)
            result.replaced_index.append(i)
        for b in blocks:
            result.new_block_index.append(i)
            result.new_block_ids.append(b)

    # --- invariants (tests and debug tooling; O(pool)) ----------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        pool = self.pool
        counts = [0] * pool.num_blocks
        for seq in self.seqs.values():
            assert len(seq.block_ids) == self._blocks_for(seq.num_tokens), seq.seq_id
            for b in seq.block_ids:
                counts[b] += 1
        assert counts == pool.ref_counts, "ref counts differ from the tables"
        free = set(pool.free_list)
        assert len(free) == len(pool.free_list), "a block is on the free list twice"
        for b in range(pool.num_blocks):
            in_free = b in free
            in_cache = b in pool.evictable
            referenced = counts[b] > 0
            assert in_free + in_cache + referenced == 1, f"block {b} is in {in_free, in_cache, referenced}"
            if in_free:
                assert pool.block_hash[b] is None, f"free block {b} still has a hash"
            if in_cache:
                assert pool.block_hash[b] is not None, f"cached block {b} has no hash"
        for h, b in pool.index.items():
            assert pool.block_hash[b] == h, f"index entry for block {b} disagrees"
        assert pool.num_free + pool.num_cached + sum(1 for c in counts if c) == pool.num_blocks
