"""The tenancy stage of the block manager's pipeline: tenant isolation at the
edge (docs/security.md).

Used only when authentication is on (``--auth-tokens-file``; otherwise the
servicer uses :data:`NO_TENANCY`, which passes requests through). Every
request is rewritten before it reaches the reliability stage and the core:

- sequence ids, lease ids and request ids get the tenant's namespace prefix
  ``tenant + "\\x1f"`` (the separator is never valid in a client id), so tenant
  A's ``seq-1`` is not tenant B's, and neither can name the other's leases or
  collide on request ids;
- the tenant goes on to the core as data (`Scoped.tenant`): the sequences it
  admits are charged to it, and it is an extra key of their prefix hashes
  (with the request's ``cache_salt``), so no tenant gets hits on, or timing
  signals from, another tenant's content.

The journal records the core calls a request made, tenant argument included
(block_manager_svc/commands.py), so replay gives every admission back its
tenant. Replies and error messages are mapped back: a client only ever sees
its own ids.
Quotas live in the core (core/tenants.py); preemption only ever picks
victims of the growing tenant. GetStats shows a tenant its own numbers
unless it is an admin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from pagedkv.auth import Tenant, TokenStore, current_tenant
from pagedkv.block_manager_svc.core.sequence import MAX_SEQ_ID_LEN
from pagedkv.block_manager_svc.core.tenants import Quota, TenantLedger
from pagedkv.block_manager_svc.leases import MAX_LEASE_ID_LEN
from pagedkv.v1 import block_manager_pb2 as pb

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.core import BlockManager

MAX_REQUEST_ID_LEN = 256


class _ScopedContext:
    """A ServicerContext that strips the tenant's namespace from error messages."""

    __slots__ = ("_ctx", "_strip")

    def __init__(self, ctx: Any, prefix: str) -> None:
        self._ctx = ctx
        self._strip = (prefix, repr(prefix)[1:-1])  # ids appear raw and inside repr()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._ctx.abort(code, self._unscope(details))

    def abort_with_status(self, status: grpc.Status) -> None:
        """The rich status with the namespace taken off its message and ErrorInfo metadata."""
        if not hasattr(self._ctx, "abort_with_status"):  # a test double
            self.abort(status.code, status.details)
            return
        unscoped = []
        for key, value in status.trailing_metadata or ():
            if key == "grpc-status-details-bin":
                s = status_pb2.Status.FromString(value)
                s.message = self._unscope(s.message)
                for detail in s.details:
                    info = error_details_pb2.ErrorInfo()
                    if detail.Unpack(info):
                        for k, v in list(info.metadata.items()):
                            info.metadata[k] = self._unscope(v)
                        detail.Pack(info)
                value = s.SerializeToString()
            unscoped.append((key, value))
        self._ctx.abort_with_status(_Status(status.code, self._unscope(status.details), tuple(unscoped)))

    def _unscope(self, text: str) -> str:
        for p in self._strip:
            text = text.replace(p, "")
        return text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


@dataclass(frozen=True, slots=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def ledger_from_store(store: TokenStore) -> TenantLedger:
    return TenantLedger(
        quotas={
            name: Quota(t.max_gpu_blocks, t.max_cpu_blocks, t.max_sequences)
            for name, t in store.tenants.items()
        }
    )


@dataclass(slots=True)
class Scoped:
    """One call as the next stages see it: the request in the caller's
    namespace, the context whose error messages map back, and who called."""

    request: Any
    context: Any
    tenant: str | None  # None: authentication off
    prefix: str = ""  # stripped from the seq ids of the reply


class NoTenancy:
    """Authentication off: requests pass through unchanged."""

    __slots__ = ()

    def enter(self, name: str, request: Any, context: Any) -> Scoped:
        return Scoped(request, context, None)

    def leave(self, name: str, scoped: Scoped, response: Any) -> Any:
        return response

    def own_stats(
        self, request: pb.GetStatsRequest, context: Any, core: BlockManager, lock: Any
    ) -> pb.Stats | None:
        return None


NO_TENANCY = NoTenancy()


class TenantScope:
    """Per-tenant namespaces, salts and stats scoping (authentication on; the
    auth interceptor has put the caller in `current_tenant`)."""

    __slots__ = ()

    # --- the stage ------------------------------------------------------------------
    def enter(self, name: str, request: Any, context: Any) -> Scoped:
        """The request rewritten into the caller's namespace (a copy; the original is untouched)."""
        t = _tenant(context)
        p = t.prefix
        if name == "ResetPrefixCache" and not t.admin:
            # Admins only: the cache host (and so every tenant's KV) is shared, and so is its loss.
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {t.name!r} is not an admin: ResetPrefixCache clears every tenant's "
                "prefix cache and is for admins",
            )
        rewrite = _REWRITE.get(name)
        if rewrite is None:  # nothing to namespace (GetConfig, GetStats)
            return Scoped(request, context, t.name, p)
        req = rewrite(request, context, p)
        return Scoped(req, _ScopedContext(context, p), t.name, p)

    def leave(self, name: str, scoped: Scoped, response: Any) -> Any:
        """The reply with the caller's namespace taken off every seq id it names."""
        n = len(scoped.prefix)
        if name in ("Append", "Preempt"):
            _unprefix(response.preempted, n)
        elif name == "SwapIn":
            _unprefix(response.sequences, n)
        elif name == "Step":
            _step_reply(response, scoped.prefix)
        return response

    def own_stats(
        self, request: pb.GetStatsRequest, context: Any, core: BlockManager, lock: Any
    ) -> pb.Stats | None:
        """A non-admin tenant's own numbers (None for an admin: the whole pool's)."""
        t = _tenant(context)
        if t.admin:
            return None
        if request.all_tenants:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {t.name!r} is not an admin: all_tenants is for admins",
            )
        with lock:
            ledger = core.tenants
            u = ledger.of(t.name) if ledger is not None else None
            swapped = sum(1 for s in core.swapped.values() if s.tenant == t.name) if core.swapped else 0
            q = ledger.quota(t.name) if ledger is not None else Quota()
        s = pb.Stats(
            block_size=core.block_size,
            num_gpu_blocks=q.max_gpu_blocks or core.pool.num_blocks,
            num_cpu_blocks=q.max_cpu_blocks or core.cpu.num_blocks,
        )
        if u is not None:
            s.num_used_blocks = u.gpu_blocks
            s.num_sequences = u.sequences
            s.prefix_query_tokens = u.prefix_query_tokens
            s.prefix_hit_tokens = u.prefix_hit_tokens
            s.num_swapped_sequences = swapped
            s.num_free_blocks = max(s.num_gpu_blocks - u.gpu_blocks, 0) if q.max_gpu_blocks else 0
            s.num_free_cpu_blocks = max(q.max_cpu_blocks - u.cpu_blocks, 0) if q.max_cpu_blocks else 0
        return s


Tenancy = TenantScope | NoTenancy


# --- checks and namespacing -----------------------------------------------------------
def _tenant(context: Any) -> Tenant:
    t = current_tenant.get()
    if t is None:  # the auth interceptor always sets it; this is a wiring bug guard
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "no authenticated tenant")
    return t  # type: ignore[return-value]


def _check(context: Any, value: str, what: str, limit: int, empty_ok: bool = False) -> None:
    if not value:
        if not empty_ok:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must not be empty")
        return
    if len(value) > limit:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{what} is {len(value)} characters long; the limit is {limit}"
        )
    if not value.isprintable():
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{what} must be printable text (no control characters)"
        )


def _common(request: Any, context: Any, p: str) -> None:
    """Namespace request_id and lease_id in place (the request is our copy)."""
    rid = request.request_id
    if rid:
        _check(context, rid, "request_id", MAX_REQUEST_ID_LEN)
        request.request_id = p + rid
    if hasattr(request, "lease_id") and request.lease_id:
        _check(context, request.lease_id, "lease_id", MAX_LEASE_ID_LEN - len(p))
        request.lease_id = p + request.lease_id


def _ids(context: Any, ids: Any, p: str, what: str) -> list[str]:
    for s in ids:
        if len(s) > MAX_SEQ_ID_LEN or not s.isprintable():
            _check(context, s, what, MAX_SEQ_ID_LEN)
    return [p + s for s in ids]


def _one(context: Any, s: str, p: str, what: str = "seq_id") -> str:
    if len(s) > MAX_SEQ_ID_LEN or not s.isprintable():
        _check(context, s, what, MAX_SEQ_ID_LEN)
    return p + s


def _unprefix(items: Any, n: int) -> None:
    for it in items:
        it.seq_id = it.seq_id[n:]


def _copy(request: Any) -> Any:
    req = type(request)()
    req.CopyFrom(request)
    return req


# --- per-RPC request rewrites -------------------------------------------------------------
def _allocate(request: pb.AllocateRequest, context: Any, p: str) -> pb.AllocateRequest:
    req = _copy(request)
    req.seq_id = _one(context, request.seq_id, p)
    if request.cache_salt:
        _check(context, request.cache_salt, "cache_salt", 256)
    _common(req, context, p)
    return req


def _seq_id(request: Any, context: Any, p: str) -> Any:
    """Append, Free, Commit, SwapIn, Preempt: one seq_id."""
    req = _copy(request)
    req.seq_id = _one(context, request.seq_id, p)
    _common(req, context, p)
    return req


def _fork(request: pb.ForkRequest, context: Any, p: str) -> pb.ForkRequest:
    req = _copy(request)
    req.parent_seq_id = _one(context, request.parent_seq_id, p, "parent_seq_id")
    req.child_seq_id = _one(context, request.child_seq_id, p, "child_seq_id")
    _common(req, context, p)
    return req


def _block_table(request: pb.GetBlockTableRequest, context: Any, p: str) -> pb.GetBlockTableRequest:
    return pb.GetBlockTableRequest(seq_id=_one(context, request.seq_id, p))


def _keepalive(request: pb.KeepAliveRequest, context: Any, p: str) -> pb.KeepAliveRequest:
    req = _copy(request)
    _check(context, request.lease_id, "lease_id", MAX_LEASE_ID_LEN - len(p))
    req.lease_id = p + request.lease_id
    if request.request_id:
        _check(context, request.request_id, "request_id", MAX_REQUEST_ID_LEN)
        req.request_id = p + request.request_id
    del req.attach_seq_ids[:]
    req.attach_seq_ids.extend(_ids(context, request.attach_seq_ids, p, "attach_seq_ids"))
    return req


def _step(request: pb.StepRequest, context: Any, p: str) -> pb.StepRequest:
    req = _copy(request)
    for field in (
        "append_seq_ids",
        "free_seq_ids",
        "swap_in_seq_ids",
        "commit_seq_ids",
        "alloc_seq_ids",
        "fork_parent_seq_ids",
        "fork_child_seq_ids",
        "grant_seq_ids",
        "rollback_seq_ids",
    ):
        src = getattr(request, field)
        if src:
            dst = getattr(req, field)
            del dst[:]
            dst.extend(_ids(context, src, p, field))
    if request.alloc_seq_ids:
        for salt in request.alloc_cache_salts:
            if salt:
                _check(context, salt, "alloc_cache_salts", 256)
        if request.alloc_lease_ids:
            for lid in request.alloc_lease_ids:
                if lid:
                    _check(context, lid, "alloc_lease_ids", MAX_LEASE_ID_LEN - len(p))
            del req.alloc_lease_ids[:]
            req.alloc_lease_ids.extend(p + lid if lid else "" for lid in request.alloc_lease_ids)
    for item in req.appends:
        item.seq_id = _one(context, item.seq_id, p)
    for item in req.frees:
        item.seq_id = _one(context, item.seq_id, p)
    _common(req, context, p)
    return req


def _reset(request: pb.ResetPrefixCacheRequest, context: Any, p: str) -> pb.ResetPrefixCacheRequest:
    req = _copy(request)
    _common(req, context, p)
    return req


_REWRITE = {
    "Allocate": _allocate,
    "Append": _seq_id,
    "Fork": _fork,
    "Free": _seq_id,
    "Commit": _seq_id,
    "GetBlockTable": _block_table,
    "SwapIn": _seq_id,
    "Preempt": _seq_id,
    "KeepAlive": _keepalive,
    "Step": _step,
    "ResetPrefixCache": _reset,
}


def _step_reply(resp: pb.StepResponse, p: str) -> None:
    n = len(p)
    _unprefix(resp.preempted, n)
    for a in resp.appends:
        _unprefix(a.preempted, n)
    for s in resp.swap_ins:
        _unprefix(s.sequences, n)
    strip = (p, repr(p)[1:-1])
    for e in resp.errors:
        e.seq_id = e.seq_id[n:] if e.seq_id.startswith(p) else e.seq_id
        msg = e.message
        for text in strip:
            msg = msg.replace(text, "")
        e.message = msg
