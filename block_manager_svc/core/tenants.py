"""Per-tenant accounting and quotas (docs/security.md).

With authentication on, the servicer names every sequence internally as
``f"{tenant}{SEP}{seq_id}"`` (so tenant A's ``seq-1`` is not tenant B's) and
salts prefix hashes per tenant, so no block is ever shared across tenants.
That makes per-tenant charging exact and cheap: a block is charged to the
tenant whose call took it (0 -> 1 reference) and uncharged when its last
reference goes; forks and prefix hits inside one tenant cost nothing extra.

The ledger is only present when tenancy is on (``BlockManager.tenants``);
the core checks ``is not None`` before touching it, so the default path pays
one attribute test per block-taking operation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEP = "\x1f"  # ASCII unit separator: never valid in a client id (not printable)


def tenant_of(internal_id: str) -> str:
    i = internal_id.find(SEP)
    return internal_id[:i] if i >= 0 else ""


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


@dataclass(slots=True)
class TenantLedger:
    quotas: dict[str, Quota] = field(default_factory=dict)
    default_quota: Quota = field(default_factory=Quota)
    usage: dict[str, Usage] = field(default_factory=dict)

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


def quota_message(tenant: str, what: str, used: int, needed: int, limit: int) -> str:
    return (
        f"tenant {tenant!r} quota {what}={limit} exceeded: {used} in use, this call needs {needed} more"
    )
