"""Tenant charging: per-tenant usage and quotas behind one ledger (docs/security.md).

With authentication on, the tenant is data: the servicer passes it to
Allocate (and Step's allocations), the sequence keeps it (`SeqState.tenant`,
inherited by forks) and it is an extra key of the prefix hash
(`prefix_cache.root_hash`), so no block is ever shared across tenants. That
makes per-tenant charging exact and cheap: a block is charged to the tenant
whose call took it (0 -> 1 reference) and uncharged when its last reference
goes; forks and prefix hits inside one tenant cost nothing extra.

The manager always holds a ledger and calls it unconditionally: a
:class:`TenantLedger` when tenancy is on, the :data:`NULL_LEDGER` (every
check passes, every charge is a no-op) when it is off. Every
`check_*`/`admit`/`add_sequence` runs before the caller mutates anything, so
a refused call leaves usage as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.block_manager_svc.core.errors import ResourceExhausted

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.core.sequence import SeqState


@dataclass(slots=True, frozen=True)
class Quota:
    """Limits of one tenant; 0 = unlimited."""

    max_gpu_blocks: int = 0
    max_cpu_blocks: int = 0
    max_sequences: int = 0


@dataclass(slots=True)
class Usage:
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    sequences: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0


def quota_message(tenant: str, what: str, used: int, needed: int, limit: int) -> str:
    return f"tenant {tenant!r} quota {what}={limit} exceeded: {used} in use, this call needs {needed} more"


def _over_quota(tenant: str, what: str, used: int, needed: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(quota_message(tenant, what, used, needed, limit), reason="TENANT_QUOTA_EXCEEDED")


def _accept_all(seq_id: str) -> bool:
    return True


@dataclass(slots=True)
class TenantLedger:
    quotas: dict[str, Quota] = field(default_factory=dict)
    default_quota: Quota = field(default_factory=Quota)
    usage: dict[str, Usage] = field(default_factory=dict)

    enabled = True  # class constant (not a field): the null ledger says False

    # --- reading ---------------------------------------------------------------
    def quota(self, tenant: str) -> Quota:
        return self.quotas.get(tenant, self.default_quota)

    def of(self, tenant: str) -> Usage:
        u = self.usage.get(tenant)
        if u is None:
            u = self.usage[tenant] = Usage()
        return u

    def cpu_room(self, tenant: str) -> int | None:
        """CPU blocks the tenant may still take (None = unlimited)."""
        q = self.quota(tenant).max_cpu_blocks
        if not q:
            return None
        return max(q - self.of(tenant).cpu_blocks, 0)

    def victim_filter(self, seqs: dict[str, SeqState], tenant: str) -> Callable[[str], bool]:
        """A tenant only ever preempts its own sequences (its quota was checked
        before planning), so no tenant loses blocks to another."""
        return lambda sid: seqs[sid].tenant == tenant

    # --- checks (before any mutation) -------------------------------------------
    def check_gpu(self, tenant: str, needed: int) -> None:
        limit = self.quota(tenant).max_gpu_blocks
        used = self.of(tenant).gpu_blocks
        if limit and used + needed > limit:
            raise _over_quota(tenant, "max_gpu_blocks", used, needed, limit)

    # --- check and charge ----------------------------------------------------------
    def admit(self, tenant: str, blocks: int, query_tokens: int, hit_tokens: int) -> None:
        """A new sequence taking `blocks` blocks (its new ones and the cached hits it revives)."""
        usage, quota = self.of(tenant), self.quota(tenant)
        if quota.max_sequences and usage.sequences >= quota.max_sequences:
            raise _over_quota(tenant, "max_sequences", usage.sequences, 1, quota.max_sequences)
        if quota.max_gpu_blocks and usage.gpu_blocks + blocks > quota.max_gpu_blocks:
            raise _over_quota(tenant, "max_gpu_blocks", usage.gpu_blocks, blocks, quota.max_gpu_blocks)
        usage.sequences += 1
        usage.gpu_blocks += blocks
        usage.prefix_query_tokens += query_tokens
        usage.prefix_hit_tokens += hit_tokens

    def add_sequence(self, tenant: str) -> None:
        """A fork: one more sequence, no new block."""
        usage, limit = self.of(tenant), self.quota(tenant).max_sequences
        if limit and usage.sequences >= limit:
            raise _over_quota(tenant, "max_sequences", usage.sequences, 1, limit)
        usage.sequences += 1

    # --- charges (cannot fail) -------------------------------------------------------
    def charge_gpu(self, tenant: str, blocks: int) -> None:
        self.of(tenant).gpu_blocks += blocks

    def released(self, tenant: str, gpu_blocks: int, cpu_blocks: int) -> None:
        """A sequence freed: the blocks that became unreferenced and the sequence itself."""
        usage = self.of(tenant)
        usage.gpu_blocks -= gpu_blocks
        usage.cpu_blocks -= cpu_blocks
        usage.sequences -= 1

    def swapped_out(self, tenant: str, gpu_released: int, cpu_taken: int, sequences: int) -> None:
        usage = self.of(tenant)
        usage.gpu_blocks -= gpu_released
        usage.cpu_blocks += cpu_taken
        usage.preemptions += sequences

    def swapped_in(self, tenant: str, gpu_taken: int, cpu_released: int) -> None:
        usage = self.of(tenant)
        usage.gpu_blocks += gpu_taken
        usage.cpu_blocks -= cpu_released

    def preempted(self, tenant: str, sequences: int) -> None:
        self.of(tenant).preemptions += sequences

    # --- recount (enabling tenancy on a loaded core; the invariant checker) --------------
    def recount(self, running: dict[str, SeqState], swapped: dict[str, SeqState]) -> dict[str, Usage]:
        """Usage recomputed from the tables (O(pool)) by each sequence's tenant;
        history counters are kept. Pure."""
        old = self.usage
        usage: dict[str, Usage] = {}
        gpu: dict[str, set[int]] = {}
        cpu: dict[str, set[int]] = {}
        for table, seqs in ((gpu, running), (cpu, swapped)):
            for seq in seqs.values():
                t = seq.tenant
                u = usage.get(t)
                if u is None:
                    prev = old.get(t)
                    u = usage[t] = Usage()
                    if prev is not None:  # counters are history, not state: keep them
                        u.prefix_query_tokens = prev.prefix_query_tokens
                        u.prefix_hit_tokens = prev.prefix_hit_tokens
                        u.preemptions = prev.preemptions
                u.sequences += 1
                blocks: Iterable[int] = seq.block_ids if table is gpu else seq.cpu_block_ids or ()
                held = table.setdefault(t, set())
                held.update(blocks)
                for more in seq.kv_tables if table is gpu else seq.cpu_kv_tables or ():
                    held.update(more)
                if seq.ahead_block >= 0:
                    held.add(seq.ahead_block)
        for t, blocks in gpu.items():
            usage[t].gpu_blocks = len(blocks)
        for t, blocks in cpu.items():
            usage[t].cpu_blocks = len(blocks)
        for t, prev in old.items():
            if t not in usage and (prev.prefix_query_tokens or prev.preemptions):
                usage[t] = Usage(0, 0, 0, prev.prefix_query_tokens, prev.prefix_hit_tokens, prev.preemptions)
        return usage


class NullLedger:
    """Tenancy off: one tenant (""), no quotas, nothing counted."""

    __slots__ = ()
    enabled = False

    def cpu_room(self, tenant: str) -> int | None:
        return None

    def victim_filter(self, seqs: dict[str, SeqState], tenant: str) -> Callable[[str], bool]:
        return _accept_all

    def check_gpu(self, tenant: str, needed: int) -> None:
        pass

    def admit(self, tenant: str, blocks: int, query_tokens: int, hit_tokens: int) -> None:
        pass

    def add_sequence(self, tenant: str) -> None:
        pass

    def charge_gpu(self, tenant: str, blocks: int) -> None:
        pass

    def released(self, tenant: str, gpu_blocks: int, cpu_blocks: int) -> None:
        pass

    def swapped_out(self, tenant: str, gpu_released: int, cpu_taken: int, sequences: int) -> None:
        pass

    def swapped_in(self, tenant: str, gpu_taken: int, cpu_released: int) -> None:
        pass

    def preempted(self, tenant: str, sequences: int) -> None:
        pass


NULL_LEDGER = NullLedger()

Ledger = TenantLedger | NullLedger
