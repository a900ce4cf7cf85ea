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
from block_manager_svc.core.cpu_pool import CpuPool
from block_manager_svc.core.errors import (
    AlreadyExists,
    CoreError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from block_manager_svc.core.eviction import DEFAULT_MISS_COST_TOKENS, POLICIES, make_eviction_policy
from block_manager_svc.core.preemption import VictimQueue
from block_manager_svc.core.swap_planner import (
    DEFAULT_HOST_LINK_BYTES_PER_S,
    DEFAULT_KV_BYTES_PER_BLOCK,
    DEFAULT_PREFILL_TOKENS_PER_S,
    MODES,
    CostModel,
    PreemptionMode,
    SwapDecision,
    decide,
)
from array import array

from block_manager_svc.core.prefix_cache import ROOT_HASH, chain_hash, chain_hashes, encode_tokens, root_hash
from block_manager_svc.core.results import (
    AllocateResult,
    AppendResult,
    BlockTable,
    CacheOps,
    ItemError,
    Preemption,
    Stats,
    StepResult,
    SwapInResult,
)
from block_manager_svc.core.sequence import Sequence
from block_manager_svc.core.tenants import SEP, TenantLedger, quota_message, tenant_of

MAX_SEQ_ID_LEN = 256
_MAX_REQUEUED = 65_536
MAX_TOKEN_ID = 2**32 - 1


@dataclass(slots=True, frozen=True)
class CoreConfig:
    num_gpu_blocks: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    eviction_policy: str = "lru"
    enable_prefix_caching: bool = True
    # Memory policies (docs/policies.md). "off" = a sequence that cannot grow
    # gets RESOURCE_EXHAUSTED and nothing is preempted (the core's default;
    # the service defaults to "auto").
    preemption_mode: str = "off"
    # Free + evictable blocks Allocate and SwapIn must leave untouched, so that
    # admitting new work does not immediately force preemption of running work.
    watermark_blocks: int = 0
    # The swap-or-recompute cost model (core/swap_planner.py).
    kv_bytes_per_block: int = DEFAULT_KV_BYTES_PER_BLOCK
    host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    # lru-size only: the fixed cost of a prefix miss, in tokens (core/eviction.py).
    miss_cost_tokens: float = DEFAULT_MISS_COST_TOKENS

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
            raise ValueError(
                f"watermark_blocks must be in [0, num_gpu_blocks), got {self.watermark_blocks}"
            )
        if self.miss_cost_tokens < 0:
            raise ValueError(f"miss_cost_tokens must be >= 0, got {self.miss_cost_tokens}")
        CostModel(self.kv_bytes_per_block, self.host_link_bytes_per_s, self.prefill_tokens_per_s)


def _check_seq_id(seq_id: str, what: str = "seq_id") -> None:
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


class _StepScope:
    """Which fork groups already grew earlier in this step (never preempted).

    Built only when a step first needs to preempt: O(step size) once."""

    __slots__ = ("seqs", "ids", "upto", "groups")

    def __init__(self, seqs: dict[str, Sequence], packed_ids: SequenceT[str]) -> None:
        self.seqs = seqs
        self.ids = packed_ids
        self.upto = 0
        self.groups: set[int] = set()

    def grown_groups(self, pos: int) -> set[int]:
        """Groups of the append items before position `pos`."""
        ids, seqs, groups = self.ids, self.seqs, self.groups
        while self.upto < pos:
            seq = seqs.get(ids[self.upto])
            if seq is not None:
                groups.add(seq.group)
            self.upto += 1
        return groups


@dataclass(slots=True)
class _PreemptionPlan:
    """Victim groups, in order, with the decision for each (nothing applied yet)."""

    victims: list[tuple[list[str], SwapDecision, int]]  # (members, decision, distinct GPU blocks)


class BlockManager:
    """Owns block tables, reference counts, the prefix-cache index, the CPU
    swap pool and the preemption order."""

    tenants: TenantLedger | None = None  # class default: snapshots from before tenancy existed
    num_prefix_cache_resets: int = 0  # class default: snapshots from before ResetPrefixCache
    num_committed_blocks: int = 0  # class default: snapshots from before Commit

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
        self.cost_model = CostModel(
            config.kv_bytes_per_block, config.host_link_bytes_per_s, config.prefill_tokens_per_s
        )
        self.seqs: dict[str, Sequence] = {}  # running: blocks on the GPU
        self.swapped: dict[str, Sequence] = {}  # preempted by swap: blocks in the CPU pool
        self.victims = VictimQueue()  # running sequences in preemption order (when enabled)
        self.groups: dict[int, set[str]] = {}  # fork groups of two or more
        self._preempt_on = config.preemption_mode != "off"
        self._watermark = config.watermark_blocks
        self._recently_preempted: dict[str, str] = {}  # by the current call, for messages
        # Recompute victims' arrivals, restored when the frontend re-Allocates
        # them under the same id, so they keep their place in the preemption
        # order (vLLM keeps a request's arrival across preemption). Bounded.
        self._requeued: dict[str, int] = {}
        self._arrivals = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_committed_blocks = 0
        self.num_cow_copies = 0
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.preemption_cost_s = 0.0
        # Per-tenant usage and quotas; None = tenancy off (core/tenants.py).
        self.tenants: TenantLedger | None = None

    # --- helpers ------------------------------------------------------------
    def _get(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            _check_seq_id(seq_id)
            if seq_id in self.swapped:
                raise FailedPrecondition(
                    f"sequence {seq_id!r} is swapped out to the CPU pool; SwapIn it before growing it"
                )
            how = self._recently_preempted.get(seq_id)
            if how is not None:
                raise NotFound(
                    f"sequence {seq_id!r} does not exist: it was preempted for {how} earlier in this "
                    f"call; re-Allocate it to continue"
                )
            raise NotFound(f"sequence {seq_id!r} does not exist")
        return seq

    def _exhausted(self, what: str, needed: int, available: int, reserve: int = 0) -> ResourceExhausted:
        pool = self.pool
        extra = f", {reserve} held back by the admission watermark" if reserve else ""
        return ResourceExhausted(
            f"{what} needs {needed} blocks but only {available} are available "
            f"({pool.num_free} free, {pool.num_cached} cached evictable, "
            f"{pool.num_blocks} total{extra})"
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
        salt: str = "",
    ) -> AllocateResult:
        """Blocks for a new sequence's prompt, reusing cached prefix blocks.

        Hits are whole committed blocks (see `commit`): a block allocated but
        not committed yet is never a hit, for this client or any other. They
        never include the block holding the prompt's last token: the frontend must compute at least one token to get logits,
        and writing KV into a block other sequences read would race.

        A non-empty `salt` starts the hash chain from `root_hash(salt)`: only
        sequences with the same salt share cached blocks (per-tenant isolation).
        """
        _check_seq_id(seq_id)
        if seq_id in self.seqs or seq_id in self.swapped:
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
        root = root_hash(salt.encode()) if salt else ROOT_HASH
        hashes: list[bytes] = []
        hits: list[int] = []
        if tokens is not None and self.config.enable_prefix_caching:
            hashes = chain_hashes(root, tokens, bs, num_full)
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
        available = pool.num_available - hits_from_cache - self._watermark
        if needed > available:
            raise self._exhausted(
                f"allocating {num_tokens} tokens for {seq_id!r}", needed, max(available, 0), self._watermark
            )
        tenants = self.tenants
        if tenants is not None:
            tenant = tenant_of(seq_id)
            usage, quota = tenants.of(tenant), tenants.quota(tenant)
            if quota.max_sequences and usage.sequences >= quota.max_sequences:
                raise ResourceExhausted(quota_message(tenant, "max_sequences", usage.sequences, 1,
                                                      quota.max_sequences))
            charge = needed + hits_from_cache
            if quota.max_gpu_blocks and usage.gpu_blocks + charge > quota.max_gpu_blocks:
                raise ResourceExhausted(quota_message(tenant, "max_gpu_blocks", usage.gpu_blocks, charge,
                                                      quota.max_gpu_blocks))
            usage.sequences += 1
            usage.gpu_blocks += charge
            if tokens is not None:
                usage.prefix_query_tokens += num_tokens
                usage.prefix_hit_tokens += len(hits) * bs

        # Apply: nothing below can fail. The new blocks are NOT registered in
        # the prefix cache: their KV does not exist until the client commits it.
        for b in hits:
            pool.hit(b)
        block_ids = hits + pool.take(needed)
        nh = len(hits)
        pending: array | None = None
        last_hash, num_hashed = root, 0
        if tokens is not None:
            self.prefix_query_tokens += num_tokens
            self.prefix_hit_tokens += nh * bs
            if self.config.enable_prefix_caching:
                pending = tokens[nh * bs :]
                last_hash = hashes[nh - 1] if nh else root
                num_hashed = nh
        self._arrivals += 1
        arrival = self._arrivals
        if self._requeued:
            arrival = self._requeued.pop(seq_id, arrival)
        self.seqs[seq_id] = Sequence(
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
        )
        if self._preempt_on:
            self.victims.push(seq_id, priority, arrival)
        return AllocateResult(block_ids=list(block_ids), num_cached_tokens=nh * bs)

    # --- Append -------------------------------------------------------------
    def _plan_append(
        self, seq: Sequence, num_tokens: int, scope: _StepScope | None = None, pos: int = 0
    ) -> tuple[bool, int, _PreemptionPlan | None]:
        """(copy_on_write, blocks needed, preemptions) for growing `seq`; raises if it cannot.

        When the pool is short and preemption is enabled, the plan names the
        victims whose release makes room; nothing is applied yet."""
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
        if self.tenants is not None and needed:
            self._check_gpu_quota(seq.seq_id, needed)
        available = pool.num_available
        if needed <= available:
            return cow, needed, None
        if self._preempt_on:
            grown = scope.grown_groups(pos) if scope is not None else None
            plan = self._plan_preemption(seq, needed - available, grown)
            if plan is not None:
                return cow, needed, plan
        raise self._exhausted(f"appending {num_tokens} tokens to {seq.seq_id!r}", needed, available)

    def _check_gpu_quota(self, seq_id: str, needed: int) -> None:
        tenants = self.tenants
        assert tenants is not None
        tenant = tenant_of(seq_id)
        limit = tenants.quota(tenant).max_gpu_blocks
        used = tenants.of(tenant).gpu_blocks
        if limit and used + needed > limit:
            raise ResourceExhausted(quota_message(tenant, "max_gpu_blocks", used, needed, limit))

    def _apply_append(
        self, seq: Sequence, num_tokens: int, token_ids: array | None, cow: bool, needed: int
    ) -> tuple[list[int], tuple[int, int] | None]:
        pool = self.pool
        if self.tenants is not None and needed:
            self.tenants.of(tenant_of(seq.seq_id)).gpu_blocks += needed
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
        return new_blocks, copy

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
        seq = self._get(seq_id)
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
        return seq.num_committed // self.block_size

    def _register_full_blocks(self, seq: Sequence, pending: array, upto: int) -> None:
        """Hash and register the sequence's blocks [num_hashed_blocks, upto)."""
        bs = self.block_size
        pool = self.pool
        h = seq.last_hash
        depth = seq.num_hashed_blocks
        i = 0
        while depth < upto and len(pending) - i >= bs:
            parent = h
            h = chain_hash(h, pending[i : i + bs])
            depth += 1
            if pool.register(seq.block_ids[depth - 1], h, parent if depth > 1 else None, depth,
                             pending[i : i + bs] if pool.events is not None else None):
                self.num_committed_blocks += 1
            i += bs
        seq.num_hashed_blocks = depth
        seq.last_hash = h
        del pending[:i]

    def append(
        self, seq_id: str, num_tokens: int, token_ids: SequenceT[int] | None = None
    ) -> AppendResult:
        """Room for `num_tokens` more tokens; copy-on-write if the tail is shared.

        With preemption enabled, a sequence that cannot grow preempts
        lower-ranked sequences (see `_plan_preemption`); they are listed in the
        result and their swap_out ops come first in `ops`."""
        if self._recently_preempted:
            self._recently_preempted.clear()
        return self._append(seq_id, num_tokens, token_ids)

    def _append(self, seq_id: str, num_tokens: int, token_ids: SequenceT[int] | None) -> AppendResult:
        seq = self._get(seq_id)
        tokens = None
        if token_ids is not None and len(token_ids) > 0:
            tokens = _encode_token_ids(token_ids, num_tokens)
        cow, needed, plan = self._plan_append(seq, num_tokens)
        ops = CacheOps()
        preempted = self._apply_preemption(plan, ops) if plan is not None else []
        new_blocks, copy = self._apply_append(seq, num_tokens, tokens, cow, needed)
        if copy:
            ops.copies.append(copy)
        return AppendResult(
            new_block_ids=new_blocks, ops=ops, replaced_last_block=copy is not None, preempted=preempted
        )

    # --- Fork / Free --------------------------------------------------------
    def fork(self, parent_seq_id: str, child_seq_id: str) -> list[int]:
        """The child shares every block of the parent (copy-on-write later)."""
        _check_seq_id(child_seq_id, "child_seq_id")
        parent = self.seqs.get(parent_seq_id)
        if parent is None:
            _check_seq_id(parent_seq_id, "parent_seq_id")
            if parent_seq_id in self.swapped:
                raise FailedPrecondition(
                    f"parent sequence {parent_seq_id!r} is swapped out; SwapIn it before forking it"
                )
            raise NotFound(f"parent sequence {parent_seq_id!r} does not exist")
        if child_seq_id in self.seqs or child_seq_id in self.swapped:
            raise AlreadyExists(f"sequence {child_seq_id!r} already exists")
        tenants = self.tenants
        if tenants is not None:
            tenant = tenant_of(child_seq_id)
            if tenant != tenant_of(parent_seq_id):
                raise InvalidArgument("parent and child must belong to the same tenant")
            usage, limit = tenants.of(tenant), tenants.quota(tenant).max_sequences
            if limit and usage.sequences >= limit:
                raise ResourceExhausted(quota_message(tenant, "max_sequences", usage.sequences, 1, limit))
            usage.sequences += 1
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
            group=parent.group,
            num_committed=parent.num_committed,
        )
        members = self.groups.get(parent.group)
        if members is None:
            self.groups[parent.group] = {parent_seq_id, child_seq_id}
        else:
            members.add(child_seq_id)
        if self._preempt_on:
            self.victims.push(child_seq_id, parent.priority, self._arrivals)
        return list(parent.block_ids)

    def free(self, seq_id: str) -> int:
        """Release a sequence; returns how many blocks became unreferenced.

        Tail first, so that under LRU a chain's deepest blocks are the oldest
        and are evicted before their parents.
        """
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            seq = self.swapped.pop(seq_id, None)
            if seq is None:
                _check_seq_id(seq_id)
                raise NotFound(f"sequence {seq_id!r} does not exist")
            self._leave_group(seq)
            cpu_decref = self.cpu.decref
            dropped = sum(1 for c in seq.cpu_block_ids or () if cpu_decref(c))
            if self.tenants is not None:
                usage = self.tenants.of(tenant_of(seq_id))
                usage.cpu_blocks -= dropped
                usage.sequences -= 1
            return 0  # no GPU block: it held CPU blocks only
        if self._preempt_on:
            self.victims.discard(seq_id)
        if seq.group in self.groups:
            self._leave_group(seq)
        decref = self.pool.decref
        released = sum(1 for b in reversed(seq.block_ids) if decref(b))
        if self.tenants is not None:
            usage = self.tenants.of(tenant_of(seq_id))
            usage.gpu_blocks -= released
            usage.sequences -= 1
        return released

    def _leave_group(self, seq: Sequence) -> None:
        members = self.groups.get(seq.group)
        if members is not None:
            members.discard(seq.seq_id)
            if len(members) < 2:
                del self.groups[seq.group]

    # --- queries ------------------------------------------------------------
    def block_table(self, seq_id: str) -> BlockTable:
        swapped = self.swapped.get(seq_id)
        if swapped is not None:
            return BlockTable(
                block_ids=[], num_tokens=swapped.num_tokens, swapped=True,
                cpu_block_ids=list(swapped.cpu_block_ids or ()),
            )
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
            num_sequences=len(self.seqs) + len(self.swapped),
            num_hashed_blocks=len(pool.index),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_evicted_blocks=pool.num_evicted,
            num_cow_copies=self.num_cow_copies,
            num_cpu_blocks=self.cpu.num_blocks,
            num_free_cpu_blocks=self.cpu.num_free,
            num_swapped_sequences=len(self.swapped),
            num_preemptions_swap=self.num_preemptions_swap,
            num_preemptions_recompute=self.num_preemptions_recompute,
            num_swapped_out_blocks=self.num_swapped_out_blocks,
            num_swapped_in_blocks=self.num_swapped_in_blocks,
            preemption_cost_s=self.preemption_cost_s,
            num_prefix_cache_resets=self.num_prefix_cache_resets,
            num_committed_blocks=self.num_committed_blocks,
        )

    # --- ResetPrefixCache ---------------------------------------------------
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
        self.num_prefix_cache_resets = self.num_prefix_cache_resets + 1
        return cleared, freed

    # --- Step ---------------------------------------------------------------
    def step(
        self,
        append_seq_ids: SequenceT[str] = (),
        append_num_tokens: SequenceT[int] | None = None,
        append_token_ids: SequenceT[int] | None = None,
        free_seq_ids: SequenceT[str] = (),
        swap_in_seq_ids: SequenceT[str] = (),
        *,
        append_tokens_known: SequenceT[bool] | None = None,
        commit_seq_ids: SequenceT[str] = (),
        commit_num_computed_tokens: SequenceT[int] = (),
        alloc_seq_ids: SequenceT[str] = (),
        alloc_num_tokens: SequenceT[int] = (),
        alloc_token_ids: SequenceT[int] | None = None,
        alloc_priorities: SequenceT[int] | None = None,
        alloc_salts: SequenceT[str] | None = None,
        fork_parent_seq_ids: SequenceT[str] = (),
        fork_child_seq_ids: SequenceT[str] = (),
    ) -> StepResult:
        """Everything one engine iteration needs, in this order: commits
        (what the last worker step computed), frees (they make room), appends,
        allocations (new requests), forks, swap-ins.

        Every input is a set of parallel (packed) arrays, because that is what
        the wire carries cheaply and what a scheduler holds; the servicer
        converts the sub-message form to this one, so there is one path.
        Appends: `None` counts mean one token each; `None` token ids mean
        unknown for all; `append_tokens_known[i]` False says item i's ids (which
        are then absent from `append_token_ids`) are unknown.
        Allocations: one count per item, token ids concatenated (or None =
        unknown for all), priorities and salts one per item or None (0 / "").

        With preemption enabled, an append that does not fit preempts
        lower-ranked sequences that have not grown earlier in this step; a
        victim's own later item then fails (NOT_FOUND or FAILED_PRECONDITION).
        Allocations and swap-ins never preempt: they need room above the
        admission watermark.

        Items are independent and each is atomic: a rejected item is reported
        in the result and changes nothing, the others still apply. Malformed
        arrays (lengths that do not match) reject the whole step up front.
        """
        result = StepResult()
        n = len(append_seq_ids)
        if append_num_tokens is not None and len(append_num_tokens) == 0:
            append_num_tokens = None
        if append_token_ids is not None and len(append_token_ids) == 0 and append_tokens_known is None:
            append_token_ids = None
        if append_num_tokens is not None and len(append_num_tokens) != n:
            raise InvalidArgument(
                f"append_num_tokens has {len(append_num_tokens)} entries for {n} sequences; they must match"
            )
        if append_tokens_known is not None and len(append_tokens_known) != n:
            raise InvalidArgument("append_tokens_known must have one entry per append")
        if append_token_ids is not None:
            if append_tokens_known is None:
                expected = n if append_num_tokens is None else sum(append_num_tokens)
            else:
                expected = sum(
                    (1 if append_num_tokens is None else append_num_tokens[i])
                    for i in range(n) if append_tokens_known[i]
                )
            if len(append_token_ids) != expected:
                raise InvalidArgument(
                    f"append_token_ids has {len(append_token_ids)} entries but the counts add up to "
                    f"{expected}; they must match"
                )
            append_token_ids = _encode_token_ids(append_token_ids, expected, "append_token_ids")
        if len(commit_num_computed_tokens) != len(commit_seq_ids):
            raise InvalidArgument(
                f"commit_num_computed_tokens has {len(commit_num_computed_tokens)} entries for "
                f"{len(commit_seq_ids)} sequences; they must match"
            )
        na = len(alloc_seq_ids)
        if len(alloc_num_tokens) != na:
            raise InvalidArgument(
                f"alloc_num_tokens has {len(alloc_num_tokens)} entries for {na} allocations; they must match"
            )
        for what, arr in (("alloc_priorities", alloc_priorities), ("alloc_cache_salts", alloc_salts)):
            if arr is not None and len(arr) and len(arr) != na:
                raise InvalidArgument(f"{what} has {len(arr)} entries for {na} allocations; one each, or none")
        if alloc_token_ids is not None and len(alloc_token_ids):
            expected = sum(alloc_num_tokens)
            if len(alloc_token_ids) != expected:
                raise InvalidArgument(
                    f"alloc_token_ids has {len(alloc_token_ids)} entries but alloc_num_tokens adds up to "
                    f"{expected}; they must match"
                )
            alloc_token_ids = _encode_token_ids(alloc_token_ids, expected, "alloc_token_ids")
        else:
            alloc_token_ids = None
        if len(fork_child_seq_ids) != len(fork_parent_seq_ids):
            raise InvalidArgument(
                f"fork_child_seq_ids has {len(fork_child_seq_ids)} entries for {len(fork_parent_seq_ids)} "
                "parents; they must match"
            )

        if self._recently_preempted:
            self._recently_preempted.clear()
        for j, seq_id in enumerate(commit_seq_ids):
            try:
                self.commit(seq_id, commit_num_computed_tokens[j])
            except CoreError as e:
                result.commit_errors.append(ItemError(j, seq_id, e.code, e.message))

        released = result.released
        for j, seq_id in enumerate(free_seq_ids):
            try:
                released.append(self.free(seq_id))
            except CoreError as e:
                released.append(0)
                result.free_errors.append(ItemError(j, seq_id, e.code, e.message))

        scope = _StepScope(self.seqs, append_seq_ids) if self._preempt_on and n else None
        seqs = self.seqs
        bs = self.block_size
        ref_counts = self.pool.ref_counts
        offset = 0
        for i in range(n):
            seq_id = append_seq_ids[i]
            seq = seqs.get(seq_id)
            known = append_token_ids is not None and (append_tokens_known is None or append_tokens_known[i])
            if append_num_tokens is None:
                k = 1
                if seq is not None:
                    # Decode fast path: one token that fits in a private tail.
                    cur = seq.num_tokens
                    if cur % bs and ref_counts[seq.block_ids[-1]] == 1:
                        seq.num_tokens = cur + 1
                        pending = seq.pending_tokens
                        if pending is not None:
                            if known:
                                pending.append(append_token_ids[offset])  # type: ignore[index]
                            else:
                                seq.pending_tokens = None
                        if known:
                            offset += 1
                        continue
            else:
                k = append_num_tokens[i]
            tokens = None
            if known:
                tokens = append_token_ids[offset : offset + k]  # type: ignore[index]
                offset += k
            self._step_append(result, i, seq_id, seq, k, tokens, scope)

        alloc_cached, alloc_index, alloc_ids = result.alloc_num_cached_tokens, result.alloc_block_index, result.alloc_block_ids
        offset = 0
        for j in range(na):
            seq_id = alloc_seq_ids[j]
            k = alloc_num_tokens[j]
            tokens = None
            if alloc_token_ids is not None:
                tokens = alloc_token_ids[offset : offset + k]
                offset += k
            try:
                r = self.allocate(
                    seq_id, k, tokens, alloc_priorities[j] if alloc_priorities else 0,
                    alloc_salts[j] if alloc_salts else "",
                )
            except CoreError as e:
                alloc_cached.append(0)
                result.alloc_errors.append(ItemError(j, seq_id, e.code, e.message))
                continue
            alloc_cached.append(r.num_cached_tokens)
            alloc_index.extend([j] * len(r.block_ids))
            alloc_ids.extend(r.block_ids)

        for j, parent in enumerate(fork_parent_seq_ids):
            child = fork_child_seq_ids[j]
            try:
                self.fork(parent, child)
            except CoreError as e:
                result.fork_errors.append(ItemError(j, child, e.code, e.message))

        for j, seq_id in enumerate(swap_in_seq_ids):
            try:
                result.swap_in_results.append(self.swap_in(seq_id))
            except CoreError as e:
                result.swap_in_results.append(None)
                result.swap_in_errors.append(ItemError(j, seq_id, e.code, e.message))
        return result

    def _step_append(
        self,
        result: StepResult,
        i: int,
        seq_id: str,
        seq: Sequence | None,
        k: int,
        tokens: array | None,
        scope: _StepScope | None,
    ) -> None:
        try:
            if seq is None:
                self._get(seq_id)  # raises the precise error
                raise AssertionError("unreachable")
            cow, needed, plan = self._plan_append(seq, k, scope, i)
        except CoreError as e:
            result.append_errors.append(ItemError(i, seq_id, e.code, e.message))
            return
        if plan is not None:
            before = len(result.preempted)
            result.preempted.extend(self._apply_preemption(plan, result.ops))
            result.preempted_by.extend([i] * (len(result.preempted) - before))
        blocks, copy = self._apply_append(seq, k, tokens, cow, needed)
        if copy is not None:
            result.ops.copies.append(copy)
            result.replaced_index.append(i)
        for b in blocks:
            result.new_block_index.append(i)
            result.new_block_ids.append(b)

    # --- Preemption ---------------------------------------------------------
    def _group_of(self, seq: Sequence) -> list[str]:
        members = self.groups.get(seq.group)
        return sorted(members) if members is not None else [seq.seq_id]

    def _price_group(
        self, members: list[str], drop: dict[int, int], mode: str, cpu_free: int
    ) -> tuple[SwapDecision, int, int]:
        """(decision, distinct GPU blocks, blocks freed) for preempting one group,
        given the references already dropped by earlier victims in `drop`."""
        seqs, ref_counts = self.seqs, self.pool.ref_counts
        distinct: set[int] = set()
        freed = 0
        for m in members:
            for b in seqs[m].block_ids:
                d = drop.get(b, 0) + 1
                drop[b] = d
                if d == ref_counts[b]:
                    freed += 1
                distinct.add(b)
        # Tokens the re-prefill cannot get from the prefix cache: everything but
        # the leading hashed blocks that other (non-victim) sequences keep referenced.
        bs, block_hash = self.block_size, self.pool.block_hash
        recompute = 0
        for m in members:
            seq = seqs[m]
            kept = 0
            for b in seq.block_ids[: seq.num_hashed_blocks]:
                if block_hash[b] is None or ref_counts[b] <= drop[b]:
                    break
                kept += 1
            recompute += seq.num_tokens - kept * bs
        decision = decide(mode, self.cost_model, len(distinct), recompute, cpu_free)
        return decision, len(distinct), freed

    def _plan_preemption(
        self, grower: Sequence, shortfall: int, grown_groups: set[int] | None
    ) -> _PreemptionPlan | None:
        """Victims that free at least `shortfall` blocks, or None.

        Candidates rank below the grower (lower priority, or the same priority
        and a later arrival: vLLM's order), are not in its fork group and have
        not grown earlier in this step; each candidate's whole fork group goes.
        Pure: computes on the side, applies nothing."""
        key = (grower.priority, -grower.arrival)
        seqs = self.seqs
        excluded = {grower.group}
        if grown_groups:
            excluded |= grown_groups
        victims: list[tuple[list[str], SwapDecision, int]] = []
        drop: dict[int, int] = {}
        gain = 0
        cpu_free = self.cpu.num_free
        mode = self.config.preemption_mode
        if self.tenants is None:
            candidates = self.victims.candidates(lambda sid: True)
        else:
            # Tenancy: a tenant only ever preempts its own sequences (its quota
            # was checked before planning), so no tenant loses blocks to another.
            tenant = tenant_of(grower.seq_id)
            prefix = tenant + SEP
            candidates = self.victims.candidates(lambda sid: sid.startswith(prefix))
            room = self.tenants.cpu_room(tenant)
            if room is not None:
                cpu_free = min(cpu_free, room)
        try:
            for sid in candidates:
                seq = seqs[sid]
                if (seq.priority, -seq.arrival) >= key:
                    break  # everyone after ranks above the grower
                if seq.group in excluded:
                    continue
                excluded.add(seq.group)
                members = self._group_of(seq)
                decision, distinct, freed = self._price_group(members, drop, mode, cpu_free)
                if decision.mode is PreemptionMode.SWAP:
                    cpu_free -= distinct
                victims.append((members, decision, distinct))
                gain += freed
                if gain >= shortfall:
                    return _PreemptionPlan(victims)
        finally:
            candidates.close()
        return None

    def _apply_preemption(self, plan: _PreemptionPlan, ops: CacheOps) -> list[Preemption]:
        out: list[Preemption] = []
        for members, decision, distinct in plan.victims:
            self.preemption_cost_s += decision.cost_s
            share = decision.cost_s / len(members)
            if decision.mode is PreemptionMode.SWAP:
                out.extend(self._swap_out_group(members, ops, share))
                self.num_swapped_out_blocks += distinct
            else:
                out.extend(self._drop_group(members, share))
        return out

    def _swap_out_group(self, members: list[str], ops: CacheOps, share: float) -> list[Preemption]:
        """Copy the group's blocks to the CPU pool (one CPU block per distinct
        GPU block, shared as on the GPU) and release the GPU blocks.

        A released block is reusable in this same reply: workers run the
        reply's swap_out ops before its copies, swap-ins and forward pass."""
        cpu, pool = self.cpu, self.pool
        memo: dict[int, int] = {}
        out = []
        gpu_released = 0
        for m in members:
            seq = self.seqs.pop(m)
            self.victims.discard(m)
            cpu_ids = []
            for b in seq.block_ids:
                c = memo.get(b)
                if c is None:
                    c = memo[b] = cpu.take_one()
                    ops.swap_out.append((b, c))
                else:
                    cpu.incref(c)
                cpu_ids.append(c)
            for b in reversed(seq.block_ids):
                gpu_released += pool.decref(b)
            out.append(Preemption(m, PreemptionMode.SWAP.value, seq.num_tokens, len(seq.block_ids), share))
            seq.block_ids = []
            seq.cpu_block_ids = cpu_ids
            self.swapped[m] = seq
            self._recently_preempted[m] = "swap"
        self.num_preemptions_swap += len(members)
        if self.tenants is not None:
            usage = self.tenants.of(tenant_of(members[0]))
            usage.gpu_blocks -= gpu_released
            usage.cpu_blocks += len(memo)
            usage.preemptions += len(members)
        return out

    def _drop_group(self, members: list[str], share: float) -> list[Preemption]:
        """Release the group's blocks and forget it; full hashed blocks stay in
        the prefix cache, so the frontend's re-prefill may hit them."""
        out = []
        for m in members:
            seq = self.seqs[m]
            self.free(m)
            out.append(Preemption(m, PreemptionMode.RECOMPUTE.value, seq.num_tokens, len(seq.block_ids), share))
            self._recently_preempted[m] = "recompute"
            if len(self._requeued) >= _MAX_REQUEUED:
                del self._requeued[next(iter(self._requeued))]
            self._requeued[m] = seq.arrival
        self.num_preemptions_recompute += len(members)
        if self.tenants is not None:
            self.tenants.of(tenant_of(members[0])).preemptions += len(members)
        return out

    def preempt(self, seq_id: str, mode: str | None = None) -> tuple[list[Preemption], CacheOps]:
        """Preempt a running sequence and its fork group now, by the cost model.

        For the frontend's own decisions (e.g. the growing sequence itself is
        the lowest-ranked one and Append said RESOURCE_EXHAUSTED). `mode`
        overrides the configured mode ("auto", "swap" or "recompute")."""
        seq = self._get(seq_id)
        mode = mode or self.config.preemption_mode
        if mode == "off":
            mode = "auto"
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES[:3]}, got {mode!r}")
        self._recently_preempted.clear()
        members = self._group_of(seq)
        cpu_free = self.cpu.num_free
        if self.tenants is not None:
            room = self.tenants.cpu_room(tenant_of(seq_id))
            if room is not None:
                cpu_free = min(cpu_free, room)
        decision, distinct, _ = self._price_group(members, {}, mode, cpu_free)
        ops = CacheOps()
        return self._apply_preemption(_PreemptionPlan([(members, decision, distinct)]), ops), ops

    def swap_in(self, seq_id: str) -> SwapInResult:
        """Bring a swapped sequence, with the rest of its swapped fork group,
        back to the GPU: new GPU blocks, swap_in ops cpu->gpu. Needs room above
        the admission watermark; never preempts and never evicts past it."""
        seq = self.swapped.get(seq_id)
        if seq is None:
            _check_seq_id(seq_id)
            if seq_id in self.seqs:
                raise FailedPrecondition(f"sequence {seq_id!r} is not swapped out (it is running)")
            raise NotFound(f"sequence {seq_id!r} does not exist")
        members = self._group_of(seq)
        distinct: dict[int, None] = {}
        for m in members:
            for c in self.swapped[m].cpu_block_ids or ():
                distinct[c] = None
        pool = self.pool
        available = pool.num_available - self._watermark
        if len(distinct) > available:
            raise self._exhausted(
                f"swapping in {seq_id!r}" + (f" and its fork group ({len(members)} sequences)" if len(members) > 1 else ""),
                len(distinct), max(available, 0), self._watermark,
            )
        if self.tenants is not None:
            self._check_gpu_quota(seq_id, len(distinct))
        ops = CacheOps()
        memo: dict[int, int] = {}
        for c in distinct:
            g = memo[c] = pool.take_one()
            ops.swap_in.append((c, g))
        first = set(memo.values())
        tables: dict[str, list[int]] = {}
        cpu = self.cpu
        cpu_released = 0
        for m in members:
            s = self.swapped.pop(m)
            blocks = []
            for c in s.cpu_block_ids or ():
                g = memo[c]
                if g in first:
                    first.discard(g)  # take_one already counted this reference
                else:
                    pool.incref(g)
                blocks.append(g)
                cpu_released += cpu.decref(c)
            s.block_ids = blocks
            s.cpu_block_ids = None
            self.seqs[m] = s
            if self._preempt_on:
                self.victims.push(m, s.priority, s.arrival)
            tables[m] = list(blocks)
        self.num_swapped_in_blocks += len(distinct)
        if self.tenants is not None:
            usage = self.tenants.of(tenant_of(seq_id))
            usage.gpu_blocks += len(distinct)
            usage.cpu_blocks -= cpu_released
        return SwapInResult(seq_id=seq_id, block_ids=list(tables[seq_id]), ops=ops, tables=tables)

    # --- tenancy -------------------------------------------------------------
    def enable_tenancy(self, ledger: TenantLedger) -> None:
        """Turn per-tenant accounting on; usage is recomputed from the state (O(pool))."""
        ledger.usage = self._tenant_usage(ledger)
        self.tenants = ledger

    def _tenant_usage(self, ledger: TenantLedger) -> dict:
        from block_manager_svc.core.tenants import Usage

        old = ledger.usage
        usage: dict[str, Usage] = {}
        gpu: dict[str, set[int]] = {}
        cpu: dict[str, set[int]] = {}
        for table, seqs in ((gpu, self.seqs), (cpu, self.swapped)):
            for sid, seq in seqs.items():
                t = tenant_of(sid)
                u = usage.get(t)
                if u is None:
                    prev = old.get(t)
                    u = usage[t] = Usage()
                    if prev is not None:  # counters are history, not state: keep them
                        u.prefix_query_tokens = prev.prefix_query_tokens
                        u.prefix_hit_tokens = prev.prefix_hit_tokens
                        u.preemptions = prev.preemptions
                u.sequences += 1
                table.setdefault(t, set()).update(seq.block_ids if table is gpu else seq.cpu_block_ids or ())
        for t, blocks in gpu.items():
            usage[t].gpu_blocks = len(blocks)
        for t, blocks in cpu.items():
            usage[t].cpu_blocks = len(blocks)
        for t, prev in old.items():
            if t not in usage and (prev.prefix_query_tokens or prev.preemptions):
                usage[t] = type(prev)(0, 0, 0, prev.prefix_query_tokens, prev.prefix_hit_tokens, prev.preemptions)
        return usage

    # --- invariants (tests and debug tooling; O(pool)) ----------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        pool = self.pool
        if self.tenants is not None:
            want = self._tenant_usage(self.tenants)
            for t in set(want) | set(self.tenants.usage):
                a, b = want.get(t), self.tenants.usage.get(t)
                got = (b.gpu_blocks, b.cpu_blocks, b.sequences) if b else (0, 0, 0)
                exp = (a.gpu_blocks, a.cpu_blocks, a.sequences) if a else (0, 0, 0)
                assert got == exp, f"tenant {t!r} usage {got} differs from the tables {exp}"
        counts = [0] * pool.num_blocks
        for seq in self.seqs.values():
            assert len(seq.block_ids) == self._blocks_for(seq.num_tokens), seq.seq_id
            assert seq.cpu_block_ids is None, f"running {seq.seq_id} has CPU blocks"
            for b in seq.block_ids:
                counts[b] += 1
        self._check_policy_invariants()
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
        bs = self.block_size
        for seq in self.seqs.values():
            # A sequence hashes (registers) only blocks inside its committed range,
            # so every index entry, and so every hit, names committed KV.
            assert seq.num_hashed_blocks * bs <= seq.num_committed <= seq.num_tokens, seq.seq_id
            if seq.pending_tokens is not None:
                assert len(seq.pending_tokens) == seq.num_tokens - seq.num_hashed_blocks * bs, seq.seq_id
        for h, b in pool.index.items():
            assert pool.block_hash[b] == h, f"index entry for block {b} disagrees"
        assert pool.num_free + pool.num_cached + sum(1 for c in counts if c) == pool.num_blocks

    def _check_policy_invariants(self) -> None:
        """The CPU pool, swapped sequences, fork groups, preemption queue and
        the prefix tree the eviction policy sees."""
        pool, cpu = self.pool, self.cpu
        assert not (self.seqs.keys() & self.swapped.keys()), "a sequence is both running and swapped"
        cpu_counts = [0] * cpu.num_blocks
        for seq in self.swapped.values():
            assert seq.block_ids == [], f"swapped {seq.seq_id} still holds GPU blocks"
            assert seq.cpu_block_ids is not None
            assert len(seq.cpu_block_ids) == self._blocks_for(seq.num_tokens), seq.seq_id
            for c in seq.cpu_block_ids:
                cpu_counts[c] += 1
        assert cpu_counts == cpu.ref_counts, "CPU ref counts differ from the swapped tables"
        cpu_free = set(cpu.free_list)
        assert len(cpu_free) == len(cpu.free_list), "a CPU block is on the free list twice"
        for c in range(cpu.num_blocks):
            assert (c in cpu_free) != (cpu_counts[c] > 0), f"CPU block {c} is both or neither free and used"
        for g, members in self.groups.items():
            assert len(members) >= 2, f"group {g} has {len(members)} members"
            states = set()
            for m in members:
                seq = self.seqs.get(m) or self.swapped.get(m)
                assert seq is not None and seq.group == g, f"group {g} lists {m}"
                states.add(m in self.swapped)
            assert len(states) == 1, f"group {g} is partly swapped"
        if self._preempt_on:
            assert len(self.victims) == len(self.seqs) and all(s in self.victims for s in self.seqs)
        children: dict[bytes, int] = {}
        for b in pool.index.values():
            parent = pool.parent_hash[b]
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
        assert children == pool.child_count, "child counts differ from the index"
        exact = getattr(pool.evictable, "exact_leaves", True)
        for b in range(pool.num_blocks):
            if b in pool.evictable:
                leaf = pool.block_hash[b] not in children
                flag = pool.evictable.is_leaf(b)
                # Exact policies track leaves eagerly; lazy ones (lru) only set
                # aside blocks found to have children when popped.
                assert flag == leaf if exact else (flag or not leaf), f"cached block {b} leaf flag"
