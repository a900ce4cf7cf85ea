"""The block manager: the single-sequence operations and Step, over one pool.

Allocate, Append, Commit, Rollback, Fork, Free, Preempt, SwapIn,
ResetPrefixCache, the block-table and stats queries, and Step (a loop over the
single-sequence operations in the packed order: rollbacks, commits, frees,
appends, allocations, forks, swap-ins, grants). Pure Python, no I/O, no clock:
the gRPC servicer (or an in-process engine) calls these under its own lock.
Every public method validates everything and checks room *before* it mutates
anything, so it either fully happens or raises a `CoreError` with the state untouched. Work is O(blocks
touched) per call: no scans over the pool or over all sequences.

Each decision beyond this lives in its own module: which block to evict
(eviction.py), who is preempted and how, and swap-in (preemption.py, with the
swap-or-recompute cost model in swap_planner.py), what a tenant is charged
(tenants.py), what the prefix cache matches (prefix_cache.py), and what must
always hold (invariants.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

from pagedkv import defaults
from pagedkv.block_manager_svc.core.block_pool import BlockPool
from pagedkv.block_manager_svc.core.cpu_pool import CpuPool
from pagedkv.block_manager_svc.core.errors import (
    AlreadyExists,
    CoreError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from pagedkv.block_manager_svc.core.eviction import DEFAULT_MISS_COST_TOKENS, POLICIES, make_eviction_policy
from pagedkv.block_manager_svc.core.invariants import check_invariants
from pagedkv.block_manager_svc.core.kv_events import PoolEvent
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup, check_kv_groups, group_key
from pagedkv.block_manager_svc.core.preemption import Preempter, PreemptionPlan, StepScope
from pagedkv.block_manager_svc.core.prefix_cache import (
    ROOT_HASH,
    chain_hash,
    chain_hashes,
    encode_tokens,
    root_hash,
)
from pagedkv.block_manager_svc.core.results import (
    AllocateResult,
    AppendResult,
    BlockTable,
    CacheOps,
    GroupDeltas,
    ItemError,
    Preemption,
    Stats,
    StepResult,
    SwapInResult,
)
from pagedkv.block_manager_svc.core.sequence import MAX_SEQ_ID_LEN, SeqState, check_seq_id
from pagedkv.block_manager_svc.core.step_batch import StepBatch
from pagedkv.block_manager_svc.core.swap_planner import (
    DEFAULT_HOST_LINK_BYTES_PER_S,
    DEFAULT_KV_BYTES_PER_BLOCK,
    DEFAULT_PREFILL_TOKENS_PER_S,
    MODES,
    CostModel,
)
from pagedkv.block_manager_svc.core.tenants import NULL_LEDGER, Ledger, NullLedger, TenantLedger
from pagedkv.kv_capacity import blocks_for_memory, blocks_for_tokens, check_kv_cache_dtype
from pagedkv.watermark import admission_room

__all__ = ["MAX_SEQ_ID_LEN", "MAX_TOKEN_ID", "BlockManager", "CoreConfig"]

MAX_TOKEN_ID = 2**32 - 1


@dataclass(slots=True, frozen=True)
class CoreConfig:
    num_gpu_blocks: int
    block_size: int = defaults.BLOCK_SIZE
    num_cpu_blocks: int = 0
    eviction_policy: str = defaults.EVICTION_POLICY
    enable_prefix_caching: bool = True
    # Memory policies (docs/policies.md): the service's default (pagedkv/defaults.py). "off" = a
    # sequence that cannot grow gets RESOURCE_EXHAUSTED and nothing is preempted.
    preemption_mode: str = defaults.PREEMPTION_MODE
    # Free + evictable blocks Allocate and SwapIn must leave untouched, so that
    # admitting new work does not immediately force preemption of running work.
    watermark_blocks: int = 0
    # The swap-or-recompute cost model (core/swap_planner.py).
    kv_bytes_per_block: int = DEFAULT_KV_BYTES_PER_BLOCK
    host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    # lru-size only: the fixed cost of a prefix miss, in tokens (core/eviction.py).
    miss_cost_tokens: float = DEFAULT_MISS_COST_TOKENS
    # Capacity as bytes (pagedkv/kv_capacity.py): the KV dtype every cache host and worker must use,
    # and the budget the GPU pool was sized from (num_gpu_blocks = budget // kv_bytes_per_block;
    # 0 = counted in blocks, kv_bytes_per_block then only feeds the cost model).
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int = 0
    # The model's KV-cache groups (core/kv_groups.py): one block table per group per sequence.
    # Group 0 is full attention; one group (the default) is the behaviour before groups existed.
    kv_groups: tuple[KVGroup, ...] = ONE_GROUP

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {POLICIES}, got {self.eviction_policy!r}")
        if self.preemption_mode not in MODES:
            raise ValueError(f"preemption_mode must be one of {MODES}, got {self.preemption_mode!r}")
        if not 0 <= self.watermark_blocks < self.num_gpu_blocks:
            raise ValueError(f"watermark_blocks must be in [0, num_gpu_blocks), got {self.watermark_blocks}")
        if self.miss_cost_tokens < 0:
            raise ValueError(f"miss_cost_tokens must be >= 0, got {self.miss_cost_tokens}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_groups(self.kv_groups)
        if self.kv_cache_memory_bytes and (
            blocks_for_memory(self.kv_cache_memory_bytes, self.kv_bytes_per_block) != self.num_gpu_blocks
        ):
            raise ValueError(
                f"num_gpu_blocks {self.num_gpu_blocks} is not the {self.kv_cache_memory_bytes}-byte budget "
                f"over {self.kv_bytes_per_block} bytes per block"
            )
        CostModel(self.kv_bytes_per_block, self.host_link_bytes_per_s, self.prefill_tokens_per_s)


def _tails_private(tables: list[list[int]], ref_counts: list[int], hashes: list[bytes | None]) -> bool:
    """Whether every table's last block is the sequence's own and in no prefix cache (a decode
    token needs no copy)."""
    return all(ref_counts[t[-1]] == 1 and hashes[t[-1]] is None for t in tables)


def _encode_token_ids(token_ids: SequenceT[int], num_tokens: int, what: str = "token_ids") -> array[int]:
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
    """Owns block tables, reference counts, the prefix-cache index, the CPU
    swap pool and the preemption order."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(
            config.num_gpu_blocks,
            make_eviction_policy(
                config.eviction_policy, config.num_gpu_blocks, config.block_size, config.miss_cost_tokens
            ),
        )
        self.cpu = CpuPool(config.num_cpu_blocks)
        # KV-cache groups (core/kv_groups.py); `multi`: more than one, so sequences keep
        # `kv_tables` too. Every path below that `multi` guards is untouched with one group.
        self.kv_groups = config.kv_groups
        self.multi = len(config.kv_groups) > 1
        self.cost_model = CostModel(
            config.kv_bytes_per_block, config.host_link_bytes_per_s, config.prefill_tokens_per_s
        )
        self.seqs: dict[str, SeqState] = {}  # running: blocks on the GPU
        self.swapped: dict[str, SeqState] = {}  # preempted by swap: blocks in the CPU pool
        self.groups: dict[int, set[str]] = {}  # fork group id -> members (groups of two or more)
        # Who yields and how, and swap-in (core/preemption.py): it owns the victim queue and the
        # preemption counters, and sees of this manager only what its constructor is given.
        self.preemption = Preempter(
            mode=config.preemption_mode,
            block_size=config.block_size,
            watermark_blocks=config.watermark_blocks,
            cost_model=self.cost_model,
            pool=self.pool,
            cpu=self.cpu,
            seqs=self.seqs,
            swapped=self.swapped,
            groups=self.groups,
            release=self.free,
            exhausted=self.exhausted,
        )
        self.preempt_on = self.preemption.enabled
        self._arrivals = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_committed_blocks = 0
        self.num_cow_copies = 0
        # Per-tenant usage and quotas (core/tenants.py); the null ledger = tenancy off.
        self.ledger: Ledger = NULL_LEDGER
        self.num_prefix_cache_resets = 0

    # --- helpers ------------------------------------------------------------
    def get_running(self, seq_id: str) -> SeqState:
        """The running sequence `seq_id`, or the precise error for why there is none."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            check_seq_id(seq_id)
            if seq_id in self.swapped:
                raise FailedPrecondition(
                    f"sequence {seq_id!r} is swapped out to the CPU pool; SwapIn it before growing it"
                )
            how = self.preemption.recently_preempted.get(seq_id)
            if how is not None:
                raise NotFound(
                    f"sequence {seq_id!r} does not exist: it was preempted for {how} earlier in this "
                    f"call; re-Allocate it to continue",
                    reason="SEQUENCE_PREEMPTED",
                )
            raise NotFound(f"sequence {seq_id!r} does not exist")
        return seq

    def exhausted(self, what: str, needed: int, available: int, reserve: int = 0) -> ResourceExhausted:
        pool = self.pool
        extra = f", {reserve} held back by the admission watermark" if reserve else ""
        return ResourceExhausted(
            f"{what} needs {needed} blocks but only {available} are available "
            f"({pool.num_free} free, {pool.num_cached} cached evictable, "
            f"{pool.num_blocks} total{extra})"
        )

    # --- Allocate -----------------------------------------------------------
    def allocate(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: SequenceT[int] | None = None,
        priority: int = 0,
        salt: str = "",
        tenant: str = "",
        skip_prefix_hits: bool = False,
    ) -> AllocateResult:
        """Blocks for a new sequence's prompt, reusing cached prefix blocks.

        Hits are whole committed blocks (see `commit`): a block allocated but
        not committed yet is never a hit, for this client or any other. They
        never include the block holding the prompt's last token: the frontend
        must compute at least one token to get logits, and writing KV into a
        block other sequences read would race.

        `tenant` is who the sequence is charged to (core/tenants.py; "" with
        tenancy off). The tenant and a non-empty `salt` are the hash chain's
        extra keys (`root_hash(salt, tenant)`): only sequences of the same
        tenant with the same salt share cached blocks. The prompt's chain
        hashes are computed once, here, and kept on the sequence for Commit.

        `skip_prefix_hits` (vLLM's skip_reading_prefix_cache): no hits, every block is new, so the
        client computes the whole prompt (prompt logprobs need every position); the hashes are kept
        all the same, so its blocks enter the prefix cache at Commit where no other block already
        holds their content.
        """
        check_seq_id(seq_id)
        if seq_id in self.seqs or seq_id in self.swapped:
            raise AlreadyExists(f"sequence {seq_id!r} already exists")
        if num_tokens < 1:
            raise InvalidArgument("num_tokens must be at least 1")
        tokens = None
        if token_ids is not None and len(token_ids) > 0:
            tokens = _encode_token_ids(token_ids, num_tokens)
        bs = self.block_size
        pool = self.pool
        total_blocks = blocks_for_tokens(num_tokens, bs)
        if total_blocks > pool.num_blocks:
            raise InvalidArgument(
                f"a prompt of {num_tokens} tokens needs {total_blocks} blocks of {bs}, "
                f"more than the whole pool ({pool.num_blocks} blocks)"
            )

        num_full = num_tokens // bs
        root = root_hash(salt.encode(), tenant.encode()) if salt or tenant else ROOT_HASH
        hashes: list[bytes] = []
        hits: list[int] = []
        kv_hits: list[list[int]] = [[] for _ in self.kv_groups[1:]]
        if tokens is not None and self.config.enable_prefix_caching:
            hashes = chain_hashes(root, tokens, bs, num_full)
            max_hits = 0 if skip_prefix_hits else (num_tokens - 1) // bs
            if self.multi:
                hits, kv_hits = self._group_hits(hashes, max_hits)
            else:
                index = pool.index
                for h in hashes[:max_hits]:
                    block = index.get(h)
                    if block is None:
                        break
                    hits.append(block)
        ref_counts = pool.ref_counts
        hits_from_cache = sum(1 for b in hits if ref_counts[b] == 0)
        needed = total_blocks - len(hits)
        if self.multi:
            # Every other group takes the blocks after the hit too; a window group's hits
            # are only the last window's (core/kv_groups.py).
            hits_from_cache += sum(1 for g in kv_hits for b in g if ref_counts[b] == 0)
            needed *= len(self.kv_groups)
            peak = total_blocks + sum(total_blocks - len(hits) + len(g) for g in kv_hits)
            if peak > pool.num_blocks:
                raise InvalidArgument(
                    f"a prompt of {num_tokens} tokens needs {peak} blocks of {bs} over its "
                    f"{len(self.kv_groups)} KV groups, more than the whole pool ({pool.num_blocks} blocks)"
                )
        watermark = self.config.watermark_blocks
        available = admission_room(pool.num_available - hits_from_cache, watermark)
        if needed > available:
            raise self.exhausted(
                f"allocating {num_tokens} tokens for {seq_id!r}", needed, max(available, 0), watermark
            )
        nh = len(hits)
        ledger = self.ledger
        if tokens is not None and not skip_prefix_hits:
            ledger.admit(tenant, needed + hits_from_cache, num_tokens, nh * bs)
        else:
            ledger.admit(tenant, needed + hits_from_cache, 0, 0)

        # Apply: nothing below can fail. The new blocks are NOT registered in
        # the prefix cache: their KV does not exist until the client commits it.
        for b in hits:
            pool.hit(b)
        kv_tables: list[list[int]] = []
        if self.multi:
            fresh = total_blocks - nh
            for g in kv_hits:
                for b in g:
                    pool.hit(b)
                kv_tables.append(g + pool.take(fresh))
            needed = fresh
        block_ids = hits + pool.take(needed)
        pending: array[int] | None = None
        last_hash, num_hashed = root, 0
        if tokens is not None:
            if not skip_prefix_hits:  # a prompt that skips hits asked for none
                self.prefix_query_tokens += num_tokens
                self.prefix_hit_tokens += nh * bs
            if self.config.enable_prefix_caching:
                pending = tokens[nh * bs :]
                last_hash = hashes[nh - 1] if nh else root
                num_hashed = nh
                del hashes[:nh]  # the rest are the pending full blocks' hashes
        self._arrivals += 1
        arrival = self.preemption.arrival_for(seq_id, self._arrivals)
        self.seqs[seq_id] = SeqState(
            seq_id=seq_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            pending_tokens=pending,
            last_hash=last_hash,
            num_hashed_blocks=num_hashed,
            priority=priority,
            arrival=arrival,
            group=self._arrivals,
            num_committed=nh * bs,  # hits are committed KV by construction
            pending_hashes=hashes,
            tenant=tenant,
            kv_tables=kv_tables,
        )
        if self.preempt_on:
            self.preemption.running(seq_id, priority, arrival)
        return AllocateResult(
            block_ids=list(block_ids), num_cached_tokens=nh * bs, kv_block_ids=[list(t) for t in kv_tables]
        )

    def _group_hits(self, hashes: list[bytes], max_hits: int) -> tuple[list[int], list[list[int]]]:
        """The longest prefix hit every KV group can serve: (group 0's hit blocks, each other
        group's). A full group needs every block up to the hit point L; a window group only
        those of the window before it, [first_live(L*B), L) (the earlier ones may be gone).
        O(L) index lookups per group."""
        index, bs, groups = self.pool.index, self.block_size, self.kv_groups
        limit = min(len(hashes), max_hits)
        for g, group in enumerate(groups):
            if not group.window_tokens:
                k = 0
                while k < limit and group_key(hashes[k], g) in index:
                    k += 1
                limit = k
        # For each window group, run[j]: how many blocks in a row are cached up to block j - 1.
        runs: list[tuple[int, KVGroup, list[int]]] = []
        for g, group in enumerate(groups):
            if group.window_tokens:
                run = [0] * (limit + 1)
                for j in range(limit):
                    run[j + 1] = run[j] + 1 if group_key(hashes[j], g) in index else 0
                runs.append((g, group, run))
        hit = limit
        while hit and not all(run[hit] >= hit - group.first_live(hit * bs, bs) for _, group, run in runs):
            hit -= 1
        tables = [
            [index[group_key(hashes[j], g)] for j in range(group.first_live(hit * bs, bs), hit)]
            for g, group in enumerate(groups)
        ]
        return tables[0], tables[1:]

    # --- Append -------------------------------------------------------------
    def append(self, seq_id: str, num_tokens: int, token_ids: SequenceT[int] | None = None) -> AppendResult:
        """Room for `num_tokens` more tokens; copy-on-write if the tail is shared.

        With preemption enabled, a sequence that cannot grow preempts
        lower-ranked sequences (core/preemption.py); they are listed in the
        result and their swap_out ops come first in `ops`."""
        self.preemption.new_call()
        seq = self.get_running(seq_id)
        tokens = None
        if token_ids is not None and len(token_ids) > 0:
            tokens = _encode_token_ids(token_ids, num_tokens)
        cow, needed, plan = self._plan_append(seq, num_tokens)
        ops = CacheOps()
        preempted = self.preemption.apply(plan, ops) if plan is not None else []
        new_blocks, copy, kv_grown = self._apply_append(seq, num_tokens, tokens, cow, needed)
        if copy:
            ops.copies.append(copy)
        kv_new: list[list[int]] = []
        kv_replaced: list[bool] = []
        if kv_grown:
            for new, copy_g in kv_grown:
                kv_new.append(new)
                kv_replaced.append(copy_g is not None)
                if copy_g is not None:
                    ops.copies.append(copy_g)
        return AppendResult(
            new_block_ids=new_blocks,
            ops=ops,
            replaced_last_block=copy is not None,
            preempted=preempted,
            kv_new_block_ids=kv_new,
            kv_replaced_last_block=kv_replaced,
        )

    def _plan_append(
        self, seq: SeqState, num_tokens: int, scope: StepScope | None = None, pos: int = 0
    ) -> tuple[int, int, PreemptionPlan | None]:
        """(copy_on_write, blocks needed, preemptions) for growing `seq`; raises if it cannot.

        When the pool is short and preemption is enabled, the plan names the
        victims whose release makes room; nothing is applied yet."""
        if num_tokens < 1:
            raise InvalidArgument("num_tokens must be at least 1")
        bs = self.block_size
        pool = self.pool
        cur = seq.num_tokens
        after = blocks_for_tokens(cur + num_tokens, bs)
        if after > pool.num_blocks:
            raise InvalidArgument(
                f"sequence {seq.seq_id!r} would need {after} blocks for {cur + num_tokens} tokens, "
                f"more than the whole pool ({pool.num_blocks} blocks)"
            )
        # Whether the tail is shared (copy-on-write); with several KV groups a mask, bit g for group g.
        # A partial tail in the prefix cache is copied too: a rollback into a block a fork sibling
        # committed leaves one, and a cached block's content is what its hash names.
        tail = seq.block_ids[-1] if cur % bs else -1
        cow: int = tail >= 0 and (pool.ref_counts[tail] > 1 or pool.block_hash[tail] is not None)
        needed = after - len(seq.block_ids) + cow
        if self.multi:
            cow, needed = self._plan_append_groups(seq, after, cow, needed)
        # A block granted ahead is the first new block the growth takes (never the copy-on-write
        # copy: the frontend may already have written the next block's KV into it).
        from_pool = needed - (seq.ahead_block >= 0 and after > len(seq.block_ids))
        if from_pool:
            self.ledger.check_gpu(seq.tenant, from_pool)
        available = pool.num_available
        if from_pool <= available:
            return cow, needed, None
        if self.preempt_on:
            grown = scope.grown_groups(pos) if scope is not None else None
            plan = self.preemption.plan(seq, from_pool - available, grown)
            if plan is not None:
                return cow, needed, plan
        raise self.exhausted(f"appending {num_tokens} tokens to {seq.seq_id!r}", from_pool, available)

    def _plan_append_groups(self, seq: SeqState, after: int, cow: int, needed: int) -> tuple[int, int]:
        """`_plan_append` over every KV group: (copy-on-write mask, bit g = group g's tail is
        shared; blocks needed in all groups). Raises when the grown tables cannot all fit."""
        n = len(seq.block_ids)
        ref_counts = self.pool.ref_counts
        hashes = self.pool.block_hash
        mask = int(cow)
        grow = after - n
        partial = seq.num_tokens % self.block_size != 0
        for g, table in enumerate(seq.kv_tables, 1):
            if partial and (ref_counts[table[-1]] > 1 or hashes[table[-1]] is not None):
                mask |= 1 << g
                needed += 1
            needed += grow
        # Never fits: the full groups alone outgrow the pool (window groups shrink as commits come).
        full = after * sum(1 for group in self.kv_groups if not group.window_tokens)
        if full > self.pool.num_blocks:
            raise InvalidArgument(
                f"sequence {seq.seq_id!r} would need {full} blocks in its full-attention KV groups, "
                f"more than the whole pool ({self.pool.num_blocks} blocks)"
            )
        return mask, needed

    def _apply_append_groups(
        self, seq: SeqState, mask: int, after: int
    ) -> list[tuple[list[int], tuple[int, int] | None]]:
        """Grow groups 1.. to `after` blocks (copy-on-write first where `mask` says); returns
        what each got: (new blocks, the copy or None)."""
        pool = self.pool
        grown: list[tuple[list[int], tuple[int, int] | None]] = []
        n = len(seq.block_ids)
        taken = 0
        for g, table in enumerate(seq.kv_tables, 1):
            new: list[int] = []
            copy: tuple[int, int] | None = None
            if mask >> g & 1:
                old = table[-1]
                fresh = pool.take_one()
                if pool.decref(old):  # a cached tail nobody else holds (after a rollback)
                    taken -= 1
                table[-1] = fresh
                copy = (old, fresh)
                new.append(fresh)
                self.num_cow_copies += 1
                taken += 1
            if after > n:
                more = pool.take(after - n)
                table.extend(more)
                new.extend(more)
                taken += after - n
            grown.append((new, copy))
        self.ledger.charge_gpu(seq.tenant, taken)
        return grown

    def _apply_append(
        self, seq: SeqState, num_tokens: int, token_ids: array[int] | None, cow: int, needed: int
    ) -> tuple[list[int], tuple[int, int] | None, list[tuple[list[int], tuple[int, int] | None]]]:
        """Grow `seq` as planned: (group 0's new blocks, its copy or None, the other groups')."""
        pool = self.pool
        copy: tuple[int, int] | None = None
        new_blocks: list[int] = []
        kv_grown: list[tuple[list[int], tuple[int, int] | None]] = []
        if self.multi:
            after = blocks_for_tokens(seq.num_tokens + num_tokens, self.block_size)
            kv_grown = self._apply_append_groups(seq, cow, after)
            cow &= 1
            needed = after - len(seq.block_ids) + cow
        if cow:
            old = seq.block_ids[-1]
            fresh = pool.take_one()
            # Still referenced by the other sharers, or (after a rollback) a cached block now idle.
            idle = pool.decref(old)
            seq.block_ids[-1] = fresh
            copy = (old, fresh)
            new_blocks.append(fresh)
            self.num_cow_copies += 1
            self.ledger.charge_gpu(seq.tenant, 1 - idle)
            needed -= 1
        if needed:
            grown = []
            if seq.ahead_block >= 0:  # already charged at its grant
                grown.append(seq.ahead_block)
                seq.ahead_block = -1
            self.ledger.charge_gpu(seq.tenant, needed - len(grown))
            grown.extend(pool.take(needed - len(grown)))
            seq.block_ids.extend(grown)
            new_blocks.extend(grown)
        seq.num_tokens += num_tokens
        pending = seq.pending_tokens
        if pending is not None:
            if token_ids is None:
                seq.pending_tokens = None
                seq.pending_hashes = []
            else:
                pending.extend(token_ids)
        return new_blocks, copy, kv_grown

    # --- Commit -------------------------------------------------------------
    def commit(self, seq_id: str, num_computed_tokens: int) -> int:
        """The KV of the sequence's first `num_computed_tokens` tokens is written.

        Its full blocks whose token ids are known enter the prefix cache now
        (and the KV events fire now), never earlier: a hit always names KV
        that exists. Idempotent; a value below an earlier commit is a no-op.
        Returns the sequence's committed full blocks (num_committed // block_size).

        A block that is already registered (a prefix hit, or a fork sibling
        committed it first) is skipped; so is one whose content another block
        already holds (first writer wins: it is freed, not cached, later).
        """
        seq = self.get_running(seq_id)
        if num_computed_tokens < 0:
            raise InvalidArgument("num_computed_tokens must be >= 0")
        if num_computed_tokens > seq.num_tokens:
            raise InvalidArgument(
                f"num_computed_tokens {num_computed_tokens} is more than the {seq.num_tokens} tokens of "
                f"sequence {seq_id!r}"
            )
        if num_computed_tokens > seq.num_committed:
            seq.num_committed = num_computed_tokens
            pending = seq.pending_tokens
            if pending is not None:
                self._register_full_blocks(seq, pending, num_computed_tokens // self.block_size)
            if self.multi:
                self._slide_windows(seq)
        return seq.num_committed // self.block_size

    def _slide_windows(self, seq: SeqState) -> None:
        """Release the blocks of `seq`'s window groups that fell wholly before the window of its
        next position to compute (its committed count): committed ones to the evictable prefix
        cache, the others to the free list. Oldest first, so LRU evicts the oldest first."""
        n, c, bs = len(seq.block_ids), seq.num_committed, self.block_size
        decref = self.pool.decref
        released = 0
        for g, table in enumerate(seq.kv_tables, 1):
            drop = self.kv_groups[g].first_live(c, bs) - (n - len(table))
            if drop > 0:
                released += sum(1 for b in table[:drop] if decref(b))
                del table[:drop]
        if released:
            self.ledger.charge_gpu(seq.tenant, -released)

    def _register_full_blocks(self, seq: SeqState, pending: array[int], upto: int) -> None:
        """Register the sequence's blocks [num_hashed_blocks, upto): with the
        hashes Allocate kept, hashing only blocks filled since."""
        bs = self.block_size
        pool = self.pool
        with_tokens = pool.events is not None
        kv_tables = seq.kv_tables
        kept = seq.pending_hashes
        num_kept = len(kept)
        h = seq.last_hash
        depth = seq.num_hashed_blocks
        i = k = 0
        while depth < upto and len(pending) - i >= bs:
            parent = h
            if k < num_kept:
                h = kept[k]
                k += 1
            else:
                h = chain_hash(h, pending[i : i + bs])
            depth += 1
            if pool.register(
                seq.block_ids[depth - 1],
                h,
                parent if depth > 1 else None,
                depth,
                pending[i : i + bs] if with_tokens else None,
            ):
                self.num_committed_blocks += 1
            if kv_tables:
                self._register_in_groups(seq, h, parent, depth, pending[i : i + bs] if with_tokens else None)
            i += bs
        seq.num_hashed_blocks = depth
        seq.last_hash = h
        del pending[:i]
        if k:
            del kept[:k]

    def _register_in_groups(
        self, seq: SeqState, h: bytes, parent: bytes, depth: int, tokens: array[int] | None
    ) -> None:
        """Register block `depth - 1` of groups 1.. under their own keys (core/kv_groups.py). A full
        group's blocks chain on their parents; a window group's stand alone (a window hit needs no
        chain from the root, and each can be evicted on its own)."""
        n = len(seq.block_ids)
        pool = self.pool
        for g, table in enumerate(seq.kv_tables, 1):
            pos = depth - 1 - (n - len(table))
            if pos < 0:
                continue  # already released (cannot happen while hashing keeps up with commits)
            full = not self.kv_groups[g].window_tokens
            up = group_key(parent, g) if full and depth > 1 else None
            if pool.register(table[pos], group_key(h, g), up, depth, tokens):
                self.num_committed_blocks += 1

    # --- Rollback -------------------------------------------------------------
    def rollback(self, seq_id: str, num_tokens: int) -> int:
        """Shorten a running sequence to its first `num_tokens` tokens; returns how many blocks
        became unreferenced.

        For speculative decoding: the slots of proposed tokens that verification rejected are
        taken back. In every KV group, the blocks wholly past the new length leave the table,
        tail first (one nobody else references returns to the pool; one a fork shares stays
        its sharer's). The slots past the new length in the new last block are free again: the
        next append writes there, copying the block first when a fork shares it, so a shared
        block is never written past its owner's length. The token ids kept for hashing are cut
        too, so the tokens appended next are the ones hashed.

        Refused below the committed count (FAILED_PRECONDITION): committed KV may already be
        someone's prefix-cache hit, and the KV of rejected tokens must never be committed, so
        it is rolled back before any commit names it. Idempotent: the current length is a no-op.
        A block granted ahead stays granted.
        """
        seq = self.get_running(seq_id)
        if num_tokens < 1:
            raise InvalidArgument("a rollback keeps at least 1 token (Free the sequence to drop it)")
        if num_tokens > seq.num_tokens:
            raise InvalidArgument(
                f"cannot roll sequence {seq_id!r} back to {num_tokens} tokens: it has only {seq.num_tokens}"
            )
        if num_tokens < seq.num_committed:
            raise FailedPrecondition(
                f"cannot roll sequence {seq_id!r} back to {num_tokens} tokens: its first "
                f"{seq.num_committed} are committed",
                reason="ROLLBACK_BELOW_COMMITTED",
            )
        if num_tokens == seq.num_tokens:
            return 0
        bs = self.block_size
        keep = blocks_for_tokens(num_tokens, bs)
        n = len(seq.block_ids)
        decref = self.pool.decref
        released = sum(1 for b in reversed(seq.block_ids[keep:]) if decref(b))
        del seq.block_ids[keep:]
        for table in seq.kv_tables:
            cut = max(0, keep - (n - len(table)))  # a window table starts at block n - len(table)
            released += sum(1 for b in reversed(table[cut:]) if decref(b))
            del table[cut:]
        if released:
            self.ledger.charge_gpu(seq.tenant, -released)
        pending = seq.pending_tokens
        if pending is not None:
            kept = num_tokens - seq.num_hashed_blocks * bs  # >= 0: hashed blocks are committed
            del pending[kept:]
            del seq.pending_hashes[kept // bs :]
        seq.num_tokens = num_tokens
        return released

    # --- Fork / Free --------------------------------------------------------
    def fork(self, parent_seq_id: str, child_seq_id: str) -> list[int]:
        """The child shares every block of the parent (copy-on-write later)."""
        check_seq_id(child_seq_id, "child_seq_id")
        parent = self.seqs.get(parent_seq_id)
        if parent is None:
            check_seq_id(parent_seq_id, "parent_seq_id")
            if parent_seq_id in self.swapped:
                raise FailedPrecondition(
                    f"parent sequence {parent_seq_id!r} is swapped out; SwapIn it before forking it"
                )
            raise NotFound(f"parent sequence {parent_seq_id!r} does not exist")
        if child_seq_id in self.seqs or child_seq_id in self.swapped:
            raise AlreadyExists(f"sequence {child_seq_id!r} already exists")
        self.ledger.add_sequence(parent.tenant)  # the child is the parent's tenant's
        for b in parent.block_ids:
            self.pool.incref(b)
        for table in parent.kv_tables:
            for b in table:
                self.pool.incref(b)
        self._arrivals += 1
        self.seqs[child_seq_id] = SeqState(
            seq_id=child_seq_id,
            block_ids=list(parent.block_ids),
            num_tokens=parent.num_tokens,
            pending_tokens=None if parent.pending_tokens is None else array("I", parent.pending_tokens),
            last_hash=parent.last_hash,
            num_hashed_blocks=parent.num_hashed_blocks,
            priority=parent.priority,
            arrival=self._arrivals,
            group=parent.group,
            num_committed=parent.num_committed,
            pending_hashes=list(parent.pending_hashes),
            tenant=parent.tenant,
            kv_tables=[list(t) for t in parent.kv_tables],
        )
        members = self.groups.get(parent.group)
        if members is None:
            self.groups[parent.group] = {parent_seq_id, child_seq_id}
        else:
            members.add(child_seq_id)
        if self.preempt_on:
            self.preemption.running(child_seq_id, parent.priority, self._arrivals)
        return list(parent.block_ids)

    def free(self, seq_id: str) -> int:
        """Release a sequence; returns how many GPU blocks became unreferenced.

        Tail first, so that under LRU a chain's deepest blocks are the oldest
        and are evicted before their parents. A swapped sequence releases its
        CPU blocks (and returns 0).
        """
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            seq = self.swapped.pop(seq_id, None)
            if seq is None:
                check_seq_id(seq_id)
                raise NotFound(f"sequence {seq_id!r} does not exist")
            self._leave_group(seq)
            cpu_decref = self.cpu.decref
            dropped = sum(1 for c in seq.cpu_block_ids or () if cpu_decref(c))
            for table in seq.cpu_kv_tables or ():
                dropped += sum(1 for c in table if cpu_decref(c))
            self.ledger.released(seq.tenant, 0, dropped)
            return 0
        if self.preempt_on:
            self.preemption.gone(seq_id)
        if seq.group in self.groups:
            self._leave_group(seq)
        decref = self.pool.decref
        released = self.drop_ahead(seq)
        released += sum(1 for b in reversed(seq.block_ids) if decref(b))
        for table in seq.kv_tables:
            released += sum(1 for b in reversed(table) if decref(b))
        self.ledger.released(seq.tenant, released, 0)
        return released

    # --- Grant ----------------------------------------------------------------
    def grant(self, seq_id: str) -> int:
        """Hold the running sequence's next block for it now, ahead of need; returns its id.

        A frontend that knows the block its sequence grows into may compute the next block's
        tokens before telling the manager of them (their appends wait for a Step it makes anyway),
        so an iteration that only appends needs no round trip at all. One block ahead at most:
        a sequence that holds one gets the same one back. A grant never preempts and never takes
        the admission watermark's blocks (like Allocate): without that room it is refused."""
        seq = self.get_running(seq_id)
        if seq.ahead_block >= 0:
            return seq.ahead_block
        if self.multi:
            raise FailedPrecondition(
                f"a block ahead of need is one block of one table; with {len(self.kv_groups)} KV groups "
                f"{seq_id!r} would need one per group, which this manager does not grant",
                reason="GRANT_UNSUPPORTED_WITH_KV_GROUPS",
            )
        pool = self.pool
        if len(seq.block_ids) + 1 > pool.num_blocks:
            raise InvalidArgument(
                f"sequence {seq_id!r} holds {len(seq.block_ids)} blocks; one more is more than the "
                f"whole pool ({pool.num_blocks} blocks)"
            )
        self.ledger.check_gpu(seq.tenant, 1)
        watermark = self.config.watermark_blocks
        available = admission_room(pool.num_available, watermark)
        if available < 1:
            raise self.exhausted(f"granting {seq_id!r} a block ahead", 1, max(available, 0), watermark)
        self.ledger.charge_gpu(seq.tenant, 1)
        seq.ahead_block = pool.take_one()
        return seq.ahead_block

    def drop_ahead(self, seq: SeqState) -> int:
        """Give back the sequence's block granted ahead, if any; returns the blocks freed (0 or 1).
        The caller accounts it to the tenant (free and swap-out release blocks together)."""
        b = seq.ahead_block
        if b < 0:
            return 0
        seq.ahead_block = -1
        return int(self.pool.decref(b))

    def _leave_group(self, seq: SeqState) -> None:
        members = self.groups.get(seq.group)
        if members is not None:
            members.discard(seq.seq_id)
            if len(members) < 2:
                del self.groups[seq.group]

    # --- Step ---------------------------------------------------------------
    def step(self, batch: StepBatch) -> StepResult:
        """Everything one engine iteration needs, as a loop over the
        single-sequence operations in this order: rollbacks (proposed tokens the
        last worker step rejected; first, so that no commit of this step can name
        their KV), commits (what the last worker step computed), frees (they make
        room), the forks marked ``fork_before_appends`` (beam search), appends,
        allocations (new requests), the other forks, swap-ins, grants
        (blocks held ahead of need, last so that they take no room the others need).

        `batch` is packed parallel arrays (core/step_batch.py), because that is
        what the wire carries cheaply and what a scheduler holds; its shapes are
        the builder's to check (the handlers do it for the wire), so there is
        one path and no wire format here. Allocations are `batch.tenant`'s
        (see `allocate`).

        With preemption enabled, an append that does not fit preempts
        lower-ranked sequences that have not grown earlier in this step; a
        victim's own later item then fails (NOT_FOUND or FAILED_PRECONDITION).
        Allocations and swap-ins never preempt: they need room above the
        admission watermark.

        Items are independent and each is atomic: a rejected item is reported
        in the result and changes nothing, the others still apply.
        """
        result = StepResult()
        if self.multi:
            result.kv_groups = [GroupDeltas() for _ in self.kv_groups[1:]]
        self.preemption.new_call()
        lengths = batch.rollback_num_tokens
        for j, seq_id in enumerate(batch.rollback_seq_ids):
            try:
                result.rollback_released.append(self.rollback(seq_id, lengths[j]))
            except CoreError as e:
                result.rollback_released.append(0)
                result.rollback_errors.append(ItemError(j, seq_id, e.code, e.message))
        counts = batch.commit_num_computed_tokens
        for j, seq_id in enumerate(batch.commit_seq_ids):
            try:
                self.commit(seq_id, counts[j])
            except CoreError as e:
                result.commit_errors.append(ItemError(j, seq_id, e.code, e.message))

        released = result.released
        for j, seq_id in enumerate(batch.free_seq_ids):
            try:
                released.append(self.free(seq_id))
            except CoreError as e:
                released.append(0)
                result.free_errors.append(ItemError(j, seq_id, e.code, e.message))

        if batch.fork_before_appends:
            self._step_forks(result, batch, before_appends=True)
        if batch.append_seq_ids:
            self._step_appends(result, batch)

        alloc_tokens = batch.alloc_token_ids
        alloc_num_tokens = batch.alloc_num_tokens
        priorities = batch.alloc_priorities
        salts = batch.alloc_salts
        skips = batch.alloc_skip_prefix_hits
        tenant = batch.tenant
        offset = 0
        for j, seq_id in enumerate(batch.alloc_seq_ids):
            k = alloc_num_tokens[j]
            tokens = None
            if alloc_tokens is not None:
                tokens = alloc_tokens[offset : offset + k]
                offset += k
            try:
                r = self.allocate(
                    seq_id,
                    k,
                    tokens,
                    priorities[j] if priorities else 0,
                    salts[j] if salts else "",
                    tenant,
                    skip_prefix_hits=bool(skips and skips[j]),
                )
            except CoreError as e:
                result.alloc_num_cached_tokens.append(0)
                result.alloc_errors.append(ItemError(j, seq_id, e.code, e.message))
                continue
            result.alloc_num_cached_tokens.append(r.num_cached_tokens)
            result.alloc_block_index.extend([j] * len(r.block_ids))
            result.alloc_block_ids.extend(r.block_ids)
            for deltas, table in zip(result.kv_groups, r.kv_block_ids, strict=True):
                deltas.alloc_block_index.extend([j] * len(table))
                deltas.alloc_block_ids.extend(table)

        self._step_forks(result, batch, before_appends=False)

        for j, seq_id in enumerate(batch.swap_in_seq_ids):
            try:
                result.swap_in_results.append(self.swap_in(seq_id))
            except CoreError as e:
                result.swap_in_results.append(None)
                result.swap_in_errors.append(ItemError(j, seq_id, e.code, e.message))

        for j, seq_id in enumerate(batch.grant_seq_ids):
            try:
                result.grant_block_ids.append(self.grant(seq_id))
                result.grant_index.append(j)
            except CoreError as e:
                result.grant_errors.append(ItemError(j, seq_id, e.code, e.message))
        for deltas in result.kv_groups:
            result.ops.copies.extend(deltas.copies)
        return result

    def _step_forks(self, result: StepResult, batch: StepBatch, *, before_appends: bool) -> None:
        """The Step's forks marked ``fork_before_appends`` (``before_appends``) or the others.
        A fork before the appends gives the child the parent's table as it was before this
        Step's appends, so each may append a different next token (beam search): the first
        write into their shared last block copies it."""
        children = batch.fork_child_seq_ids
        early = batch.fork_before_appends
        for j, parent in enumerate(batch.fork_parent_seq_ids):
            if bool(early and early[j]) != before_appends:
                continue
            child = children[j]
            try:
                self.fork(parent, child)
            except CoreError as e:
                result.fork_errors.append(ItemError(j, child, e.code, e.message))

    def _step_appends(self, result: StepResult, batch: StepBatch) -> None:
        """Step's appends: `append` per item, in order, with the decode fast path inlined
        (one token into a private, non-full tail block: no new block, no plan)."""
        seq_ids = batch.append_seq_ids
        counts = batch.append_num_tokens
        token_ids = batch.append_token_ids
        tokens_known = batch.append_tokens_known
        scope = StepScope(self.seqs, seq_ids) if self.preempt_on else None
        n = len(seq_ids)
        if counts is None and tokens_known is None:
            # The decode step: one token each, every id known (or none), so item i's id is
            # token_ids[i]. Runs of fast items alternate with single items that need more.
            i = 0
            while True:
                i = self._step_decode_run(seq_ids, token_ids, i)
                if i == n:
                    return
                tokens = None if token_ids is None else token_ids[i : i + 1]
                self._step_append_item(result, i, seq_ids[i], 1, tokens, scope)
                i += 1
        seqs = self.seqs
        bs = self.block_size
        ref_counts = self.pool.ref_counts
        hashes = self.pool.block_hash
        offset = 0
        for i, seq_id in enumerate(seq_ids):
            known = token_ids is not None and (tokens_known is None or tokens_known[i])
            if counts is None:
                k = 1
                seq = seqs.get(seq_id)
                if seq is not None:
                    cur = seq.num_tokens
                    if (
                        cur % bs
                        and ref_counts[seq.block_ids[-1]] == 1
                        and hashes[seq.block_ids[-1]] is None
                        and (not seq.kv_tables or _tails_private(seq.kv_tables, ref_counts, hashes))
                    ):
                        seq.num_tokens = cur + 1
                        pending = seq.pending_tokens
                        if pending is not None:
                            if known:
                                pending.append(token_ids[offset])  # type: ignore[index]
                            else:
                                seq.pending_tokens = None
                                seq.pending_hashes = []
                        if known:
                            offset += 1
                        continue
            else:
                k = counts[i]
            tokens = None
            if known:
                tokens = token_ids[offset : offset + k]  # type: ignore[index]
                offset += k
            self._step_append_item(result, i, seq_id, k, tokens, scope)

    def _step_decode_run(self, seq_ids: SequenceT[str], token_ids: array[int] | None, start: int) -> int:
        """From item `start` on, one token into each sequence's private, non-full tail block,
        until an item needs anything else; returns that item's position (len: all done)."""
        seqs = self.seqs
        bs = self.block_size
        ref_counts = self.pool.ref_counts
        hashes = self.pool.block_hash
        n = len(seq_ids)
        i = start
        while i < n:
            seq = seqs.get(seq_ids[i])
            if seq is None:
                return i
            cur = seq.num_tokens
            if not cur % bs or ref_counts[seq.block_ids[-1]] != 1 or hashes[seq.block_ids[-1]] is not None:
                return i
            if seq.kv_tables and not _tails_private(seq.kv_tables, ref_counts, hashes):
                return i
            seq.num_tokens = cur + 1
            pending = seq.pending_tokens
            if pending is not None:
                if token_ids is not None:
                    pending.append(token_ids[i])
                else:
                    seq.pending_tokens = None
                    seq.pending_hashes = []
            i += 1
        return n

    def _step_append_item(
        self,
        result: StepResult,
        i: int,
        seq_id: str,
        k: int,
        tokens: array[int] | None,
        scope: StepScope | None,
    ) -> None:
        """Append item i the general way (new blocks, copy-on-write, preemption); a refusal
        becomes the item's error."""
        try:
            seq = self.get_running(seq_id)  # raises the precise error
            cow, needed, plan = self._plan_append(seq, k, scope, i)
        except CoreError as e:
            result.append_errors.append(ItemError(i, seq_id, e.code, e.message))
            return
        if plan is not None:
            before = len(result.preempted)
            result.preempted.extend(self.preemption.apply(plan, result.ops))
            result.preempted_by.extend([i] * (len(result.preempted) - before))
        blocks, copy, kv_grown = self._apply_append(seq, k, tokens, cow, needed)
        if copy is not None:
            result.ops.copies.append(copy)
            result.replaced_index.append(i)
        for b in blocks:
            result.new_block_index.append(i)
            result.new_block_ids.append(b)
        for deltas, (new, copy_g) in zip(result.kv_groups, kv_grown, strict=True):
            if copy_g is not None:
                deltas.copies.append(copy_g)  # into ops.copies after group 0's, at the end
                deltas.replaced_index.append(i)
            deltas.new_block_index.extend([i] * len(new))
            deltas.new_block_ids.extend(new)

    # --- Preempt / SwapIn (core/preemption.py) -------------------------------
    def preempt(self, seq_id: str, mode: str | None = None) -> tuple[list[Preemption], CacheOps]:
        """Preempt a running sequence and its fork group now, by the cost model.

        For the frontend's own decisions (e.g. the growing sequence itself is
        the lowest-ranked one and Append said RESOURCE_EXHAUSTED). `mode`
        overrides the configured mode ("auto", "swap" or "recompute")."""
        return self.preemption.preempt(self.get_running(seq_id), mode)

    def swap_in(self, seq_id: str) -> SwapInResult:
        """Bring a swapped sequence and its swapped fork group back to the GPU."""
        seq = self.swapped.get(seq_id)
        if seq is None:
            check_seq_id(seq_id)
            if seq_id in self.seqs:
                raise FailedPrecondition(
                    f"sequence {seq_id!r} is not swapped out (it is running)",
                    reason="SEQUENCE_NOT_SWAPPED_OUT",
                )
            raise NotFound(f"sequence {seq_id!r} does not exist")
        return self.preemption.swap_in(seq)

    # --- queries ------------------------------------------------------------
    def block_table(self, seq_id: str) -> BlockTable:
        swapped = self.swapped.get(seq_id)
        if swapped is not None:
            return BlockTable(
                block_ids=[],
                num_tokens=swapped.num_tokens,
                swapped=True,
                cpu_block_ids=list(swapped.cpu_block_ids or ()),
                kv_cpu_block_ids=[list(t) for t in swapped.cpu_kv_tables or ()],
            )
        seq = self.get_running(seq_id)
        return BlockTable(
            block_ids=list(seq.block_ids),
            num_tokens=seq.num_tokens,
            kv_block_ids=[list(t) for t in seq.kv_tables],
        )

    def stats(self) -> Stats:
        pool, pre = self.pool, self.preemption
        free, cached = pool.num_free, pool.num_cached
        return Stats(
            block_size=self.block_size,
            num_gpu_blocks=pool.num_blocks,
            num_free_blocks=free,
            num_cached_blocks=cached,
            num_used_blocks=pool.num_blocks - free - cached,
            num_sequences=len(self.seqs) + len(self.swapped),
            num_hashed_blocks=len(pool.index),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_evicted_blocks=pool.num_evicted,
            num_cow_copies=self.num_cow_copies,
            num_cpu_blocks=self.cpu.num_blocks,
            num_free_cpu_blocks=self.cpu.num_free,
            num_swapped_sequences=len(self.swapped),
            num_preemptions_swap=pre.num_preemptions_swap,
            num_preemptions_recompute=pre.num_preemptions_recompute,
            num_swapped_out_blocks=pre.num_swapped_out_blocks,
            num_swapped_in_blocks=pre.num_swapped_in_blocks,
            preemption_cost_s=pre.preemption_cost_s,
            num_prefix_cache_resets=self.num_prefix_cache_resets,
            num_committed_blocks=self.num_committed_blocks,
        )

    # --- ResetPrefixCache ---------------------------------------------------
    @property
    def prefix_cache_drops(self) -> int:
        """Grows whenever registered blocks leave the prefix cache: evictions plus resets
        (StepResponse.prefix_cache_drops, for the engine's admission hints)."""
        return self.pool.num_evicted + self.num_prefix_cache_resets

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget all prefix-cache content: (hashes dropped, cached blocks freed).

        For when the KV the hashes name no longer exists (the cache host died
        and a new, empty one took its place). Sequences, their tables and ref
        counts are untouched; their blocks just stop being findable, and a
        running sequence keeps hashing its later full blocks on its own chain
        (`last_hash`), which names its own tokens, so a later hit is still
        correct once the frontend recomputed them. Cannot fail; counted in
        Stats.num_prefix_cache_resets.
        """
        cleared, freed = self.pool.clear_index()
        self.num_prefix_cache_resets += 1
        return cleared, freed

    # --- KV events ----------------------------------------------------------------
    def enable_events(self, on: bool) -> None:
        """Record KV events (off by default: then registering a block costs one test)."""
        pool = self.pool
        if not on:
            pool.events = None
        elif pool.events is None:
            pool.events = []

    def take_events(self) -> list[PoolEvent]:
        """The KV events recorded since the last call, oldest first (see BlockPool.events).
        The servicer drains them after every call, under the state lock."""
        pool = self.pool
        events = pool.events
        if not events:
            return []
        pool.events = []
        return events

    # --- tenancy and invariants ----------------------------------------------
    def enable_tenancy(self, ledger: TenantLedger) -> None:
        """Charge tenants from now on; usage is recomputed from the tables by
        each sequence's tenant (O(pool))."""
        ledger.usage = ledger.recount(self.seqs, self.swapped)
        self.ledger = self.preemption.ledger = ledger

    @property
    def tenants(self) -> TenantLedger | None:
        """The tenant ledger, or None with tenancy off (for stats and metrics)."""
        ledger = self.ledger
        return None if isinstance(ledger, NullLedger) else ledger

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (core/invariants.py)."""
        check_invariants(self)
