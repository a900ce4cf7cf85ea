"""Tenant isolation at the block manager's edge (docs/security.md).

Used only when authentication is on (``--auth-tokens-file``). Every request
is rewritten before it reaches the reliable servicer and the core:

- sequence ids, lease ids and request ids get the tenant's namespace prefix
  ``tenant + "\\x1f"`` (the separator is never valid in a client id), so tenant
  A's ``seq-1`` is not tenant B's, and neither can name the other's leases or
  collide on request ids;
- ``cache_salt`` becomes ``tenant + "\\x1f" + cache_salt``: prefix hashes are
  salted per tenant (and per request salt), so no tenant gets hits on, or
  timing signals from, another tenant's content.

Because the journal records the core commands the rewritten request made (with
the namespaced ids), tenant identity is journaled with every mutation and
replay needs no extra context. Replies and
error messages are mapped back: a client only ever sees its own ids.
Quotas live in the core (core/tenants.py); preemption only ever picks
victims of the growing tenant. GetStats shows a tenant its own numbers
unless it is an admin.
"""

from __future__ import annotations

from typing import Any

import grpc

from block_manager_svc.core.manager import MAX_SEQ_ID_LEN
from block_manager_svc.core.tenants import Quota, TenantLedger
from block_manager_svc.leases import MAX_LEASE_ID_LEN
from block_manager_svc.reliability import ReliableServicer
from pagedkv.auth import Tenant, TokenStore, current_tenant
from pagedkv.v1 import block_manager_pb2 as pb

MAX_REQUEST_ID_LEN = 256


class _ScopedContext:
    """A ServicerContext that strips the tenant's namespace from error messages."""

    __slots__ = ("_ctx", "_strip")

    def __init__(self, ctx: Any, prefix: str) -> None:
        self._ctx = ctx
        self._strip = (prefix, repr(prefix)[1:-1])  # ids appear raw and inside repr()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        for p in self._strip:
            details = details.replace(p, "")
        self._ctx.abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def ledger_from_store(store: TokenStore) -> TenantLedger:
    return TenantLedger(quotas={
        name: Quota(t.max_gpu_blocks, t.max_cpu_blocks, t.max_sequences) for name, t in store.tenants.items()
    })


class TenantServicer(ReliableServicer):
    """ReliableServicer with per-tenant namespaces, salts and stats scoping."""

    store: TokenStore | None = None

    # --- helpers ------------------------------------------------------------------
    @staticmethod
    def _tenant(context: Any) -> Tenant:
        t = current_tenant.get()
        if t is None:  # the auth interceptor always sets it; this is a wiring bug guard
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no authenticated tenant")
        return t  # type: ignore[return-value]

    @staticmethod
    def _check(context: Any, value: str, what: str, limit: int, empty_ok: bool = False) -> None:
        if not value:
            if not empty_ok:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must not be empty")
            return
        if len(value) > limit:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is {len(value)} characters long; the limit is {limit}")
        if not value.isprintable():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must be printable text (no control characters)")

    def _common(self, request: Any, context: Any, p: str) -> None:
        """Namespace request_id and lease_id in place (the request is our copy)."""
        rid = request.request_id
        if rid:
            self._check(context, rid, "request_id", MAX_REQUEST_ID_LEN)
            request.request_id = p + rid
        if hasattr(request, "lease_id") and request.lease_id:
            self._check(context, request.lease_id, "lease_id", MAX_LEASE_ID_LEN - len(p))
            request.lease_id = p + request.lease_id

    def _ids(self, context: Any, ids: Any, p: str, what: str) -> list[str]:
        for s in ids:
            if len(s) > MAX_SEQ_ID_LEN or not s.isprintable():
                self._check(context, s, what, MAX_SEQ_ID_LEN)
        return [p + s for s in ids]

    def _one(self, context: Any, s: str, p: str, what: str = "seq_id") -> str:
        if len(s) > MAX_SEQ_ID_LEN or not s.isprintable():
            self._check(context, s, what, MAX_SEQ_ID_LEN)
        return p + s

    @staticmethod
    def _unprefix(items: Any, n: int) -> None:
        for it in items:
            it.seq_id = it.seq_id[n:]

    def _copy(self, request: Any) -> Any:
        req = type(request)()
        req.CopyFrom(request)
        return req

    # --- handlers -------------------------------------------------------------------
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        t = self._tenant(context)
        p = t.prefix
        req = self._copy(request)
        req.seq_id = self._one(context, request.seq_id, p)
        if request.cache_salt:
            self._check(context, request.cache_salt, "cache_salt", 256)
        req.cache_salt = p + request.cache_salt
        self._common(req, context, p)
        return super().Allocate(req, _ScopedContext(context, p))

    def Append(self, request: pb.AppendRequest, context: Any) -> pb.AppendResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        req.seq_id = self._one(context, request.seq_id, p)
        self._common(req, context, p)
        resp = super().Append(req, _ScopedContext(context, p))
        self._unprefix(resp.preempted, len(p))
        return resp

    def Fork(self, request: pb.ForkRequest, context: Any) -> pb.ForkResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        req.parent_seq_id = self._one(context, request.parent_seq_id, p, "parent_seq_id")
        req.child_seq_id = self._one(context, request.child_seq_id, p, "child_seq_id")
        self._common(req, context, p)
        return super().Fork(req, _ScopedContext(context, p))

    def Free(self, request: pb.FreeRequest, context: Any) -> pb.FreeResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        req.seq_id = self._one(context, request.seq_id, p)
        self._common(req, context, p)
        return super().Free(req, _ScopedContext(context, p))

    def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        req.seq_id = self._one(context, request.seq_id, p)
        self._common(req, context, p)
        return super().Commit(req, _ScopedContext(context, p))

    def GetBlockTable(self, request: pb.GetBlockTableRequest, context: Any) -> pb.BlockTable:
        p = self._tenant(context).prefix
        req = pb.GetBlockTableRequest(seq_id=self._one(context, request.seq_id, p))
        return super().GetBlockTable(req, _ScopedContext(context, p))

    def SwapIn(self, request: pb.SwapInRequest, context: Any) -> pb.SwapInResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        req.seq_id = self._one(context, request.seq_id, p)
        self._common(req, context, p)
        resp = super().SwapIn(req, _ScopedContext(context, p))
        self._unprefix(resp.sequences, len(p))
        return resp

    def Preempt(self, request: pb.PreemptRequest, context: Any) -> pb.PreemptResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        req.seq_id = self._one(context, request.seq_id, p)
        self._common(req, context, p)
        resp = super().Preempt(req, _ScopedContext(context, p))
        self._unprefix(resp.preempted, len(p))
        return resp

    def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        p = self._tenant(context).prefix
        req = self._copy(request)
        self._check(context, request.lease_id, "lease_id", MAX_LEASE_ID_LEN - len(p))
        req.lease_id = p + request.lease_id
        if request.request_id:
            self._check(context, request.request_id, "request_id", MAX_REQUEST_ID_LEN)
            req.request_id = p + request.request_id
        del req.attach_seq_ids[:]
        req.attach_seq_ids.extend(self._ids(context, request.attach_seq_ids, p, "attach_seq_ids"))
        return super().KeepAlive(req, _ScopedContext(context, p))

    def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        p = self._tenant(context).prefix
        n = len(p)
        req = self._copy(request)
        for field in ("append_seq_ids", "free_seq_ids", "swap_in_seq_ids", "commit_seq_ids", "alloc_seq_ids",
                      "fork_parent_seq_ids", "fork_child_seq_ids"):
            src = getattr(request, field)
            if src:
                dst = getattr(req, field)
                del dst[:]
                dst.extend(self._ids(context, src, p, field))
        if request.alloc_seq_ids:
            # Prefix hashes salted per tenant, as Allocate does; empty = no salt for all.
            salts = request.alloc_cache_salts or [""] * len(request.alloc_seq_ids)
            for salt in salts:
                if salt:
                    self._check(context, salt, "alloc_cache_salts", 256)
            del req.alloc_cache_salts[:]
            req.alloc_cache_salts.extend(p + salt for salt in salts)
            if request.alloc_lease_ids:
                for lid in request.alloc_lease_ids:
                    if lid:
                        self._check(context, lid, "alloc_lease_ids", MAX_LEASE_ID_LEN - len(p))
                del req.alloc_lease_ids[:]
                req.alloc_lease_ids.extend(p + lid if lid else "" for lid in request.alloc_lease_ids)
        for item in req.appends:
            item.seq_id = self._one(context, item.seq_id, p)
        for item in req.frees:
            item.seq_id = self._one(context, item.seq_id, p)
        self._common(req, context, p)
        resp = super().Step(req, _ScopedContext(context, p))
        self._unprefix(resp.preempted, n)
        for a in resp.appends:
            self._unprefix(a.preempted, n)
        for s in resp.swap_ins:
            self._unprefix(s.sequences, n)
        strip = (p, repr(p)[1:-1])
        for e in resp.errors:
            e.seq_id = e.seq_id[n:] if e.seq_id.startswith(p) else e.seq_id
            msg = e.message
            for s in strip:
                msg = msg.replace(s, "")
            e.message = msg
        return resp

    def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context: Any) -> pb.ResetPrefixCacheResponse:
        """Admins only: the cache host (and so every tenant's KV) is shared, and so is its loss."""
        t = self._tenant(context)
        if not t.admin:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"tenant {t.name!r} is not an admin: ResetPrefixCache clears every tenant's "
                          "prefix cache and is for admins")
        req = self._copy(request)
        self._common(req, context, t.prefix)
        return super().ResetPrefixCache(req, _ScopedContext(context, t.prefix))

    def GetStats(self, request: pb.GetStatsRequest, context: Any) -> pb.Stats:
        t = self._tenant(context)
        if t.admin:
            return super().GetStats(request, context)
        if request.all_tenants:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"tenant {t.name!r} is not an admin: all_tenants is for admins")
        with self._lock:
            core = self._core
            ledger = core.tenants
            u = ledger.of(t.name) if ledger is not None else None
            prefix = t.prefix
            swapped = sum(1 for s in core.swapped if s.startswith(prefix)) if core.swapped else 0
            q = ledger.quota(t.name) if ledger is not None else Quota()
        s = pb.Stats(block_size=core.block_size, num_gpu_blocks=q.max_gpu_blocks or core.pool.num_blocks,
                     num_cpu_blocks=q.max_cpu_blocks or core.cpu.num_blocks)
        if u is not None:
            s.num_used_blocks = u.gpu_blocks
            s.num_sequences = u.sequences
            s.prefix_query_tokens = u.prefix_query_tokens
            s.prefix_hit_tokens = u.prefix_hit_tokens
            s.num_swapped_sequences = swapped
            s.num_free_blocks = max(s.num_gpu_blocks - u.gpu_blocks, 0) if q.max_gpu_blocks else 0
            s.num_free_cpu_blocks = max(q.max_cpu_blocks - u.cpu_blocks, 0) if q.max_cpu_blocks else 0
        return s
