"""The core stage of the block manager's pipeline: one RPC's request applied
to the core, and its reply built. No decisions.

`CoreStage.apply(name, request, context, tenant)` translates the request
into a core call, runs it under the state lock, drains the KV events the call
produced (`BlockManager.take_events`) into the event hub with the calling
tenant as data, and translates the result back. The core is not thread-safe
and every call is short (microseconds), so one lock serialises them; the gRPC
threads spend their time in (de)serialisation outside it. Core errors map one
to one onto status codes; anything else is a bug and becomes INTERNAL with the
state untouched (the core validates before it mutates).

The stages before this one (block_manager_svc/servicer.py: tenancy, then
reliability) decide who may call and whether the call runs at all.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import structlog

from pagedkv.block_manager_svc import commands as cmds
from pagedkv.block_manager_svc.core import (
    BlockManager,
    CoreError,
    ErrorCode,
    InvalidArgument,
    ItemError,
    StepBatch,
)
from pagedkv.block_manager_svc.core.prefix_cache import encode_tokens
from pagedkv.block_manager_svc.core.results import CacheOps, Preemption, StepResult, SwapInResult
from pagedkv.errors import rich_status as standard_rich_status
from pagedkv.log_limit import LogLimiter
from pagedkv.v1 import block_manager_pb2 as pb

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.events import EventHub

ERROR_DOMAIN = "pagedkv.block_manager"  # google.rpc.ErrorInfo.domain of every error this service sends
# The RPCs this stage applies; everything that changes state is in MUTATIONS.
MUTATIONS = ("Allocate", "Append", "Fork", "Free", "Commit", "Step", "SwapIn", "Preempt", "ResetPrefixCache")

STATUS_BY_CODE: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}

log = structlog.get_logger("pagedkv.block_manager")


def rich_status(code: grpc.StatusCode, message: str, reason: str, seq_id: str = "") -> grpc.Status:
    """The standard rich error model (pagedkv/errors.py): an ErrorInfo with `reason`, ERROR_DOMAIN
    and the sequence id. The reasons are the core's (core/errors.py REASONS)."""
    return standard_rich_status(code, message, reason, ERROR_DOMAIN, {"seq_id": seq_id} if seq_id else None)


def request_id_of(context: grpc.ServicerContext | None, request: object = None) -> str:
    """The id to tag a log line with: the request's own `request_id`, else the caller's
    `x-request-id` metadata. Only read when something is logged (never on the happy path)."""
    rid = getattr(request, "request_id", "") if request is not None else ""
    if rid or context is None:
        return rid
    try:
        metadata = context.invocation_metadata() or ()
    except Exception:  # noqa: BLE001 - a test double without metadata
        return ""
    for key, value in metadata:
        if key == "x-request-id":
            return value if isinstance(value, str) else ""
    return ""


def _copies(pairs: list[tuple[int, int]]) -> list[pb.BlockCopy]:
    return [pb.BlockCopy(src=s, dst=d) for s, d in pairs]


def ops_to_proto(ops: CacheOps) -> pb.CacheOps:
    return pb.CacheOps(
        copies=_copies(ops.copies), swap_out=_copies(ops.swap_out), swap_in=_copies(ops.swap_in)
    )


_PREEMPTION_MODE = {"swap": pb.Preemption.SWAP, "recompute": pb.Preemption.RECOMPUTE}


def preemptions_to_proto(items: list[Preemption]) -> list[pb.Preemption]:
    return [
        pb.Preemption(
            seq_id=p.seq_id,
            mode=_PREEMPTION_MODE[p.mode],
            num_tokens=p.num_tokens,
            num_blocks=p.num_blocks,
            cost_s=p.cost_s,
        )
        for p in items
    ]


def group_tables(num_blocks: int, tables: list[list[int]]) -> list[pb.GroupTable]:
    """KV groups 1..'s tables of a sequence whose group 0 holds `num_blocks` blocks: each one's
    live tail and the block index it starts at (core/kv_groups.py)."""
    return [pb.GroupTable(first_block_index=num_blocks - len(t), block_ids=t) for t in tables]


def swap_in_to_proto(r: SwapInResult) -> pb.SwapInResponse:
    if r.kv_tables:
        return pb.SwapInResponse(
            block_ids=r.block_ids,
            ops=ops_to_proto(r.ops),
            sequences=[
                pb.SwappedInSequence(
                    seq_id=k, block_ids=v, group_tables=group_tables(len(v), r.kv_tables.get(k, []))
                )
                for k, v in r.tables.items()
            ],
            group_tables=group_tables(len(r.block_ids), r.kv_tables.get(r.seq_id, [])),
        )
    return pb.SwapInResponse(
        block_ids=r.block_ids,
        ops=ops_to_proto(r.ops),
        sequences=[pb.SwappedInSequence(seq_id=k, block_ids=v) for k, v in r.tables.items()],
    )


def _item_error(
    kind: pb.StepItemError.Kind.ValueType, err: ItemError, index: int | None = None
) -> pb.StepItemError:
    return pb.StepItemError(
        kind=kind,
        index=err.index if index is None else index,
        seq_id=err.seq_id,
        code=err.code.value,
        message=err.message,
    )


def _token_array(ids: Any, what: str) -> array[int]:
    try:
        return encode_tokens(ids)
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(f"{what} must be integers in [0, 2**32): {e}") from None


class _SubAppends:
    """Sub-message appends converted to the core's one (packed) form, and the
    results mapped back: the sub-message items go first in the packed arrays.

    An item whose token_ids length does not match its num_tokens is rejected
    here (it cannot be concatenated) as a per-item error."""

    __slots__ = ("ids", "counts", "tokens", "known", "map", "bad", "n_sub", "n_packed")

    def __init__(self, request: pb.StepRequest) -> None:
        ids: list[str] = []
        counts: list[int] = []
        tokens: list[int] = []
        known: list[bool] = []
        self.map: list[int] = []  # packed position -> sub-message index
        self.bad: list[tuple[int, str, str]] = []
        for j, a in enumerate(request.appends):
            if a.token_ids and len(a.token_ids) != a.num_tokens:
                self.bad.append(
                    (
                        j,
                        a.seq_id,
                        f"token_ids has {len(a.token_ids)} entries but num_tokens is "
                        f"{a.num_tokens}; they must match",
                    )
                )
                continue
            self.map.append(j)
            ids.append(a.seq_id)
            counts.append(a.num_tokens)
            known.append(bool(a.token_ids))
            tokens.extend(a.token_ids)
        self.n_sub = len(ids)
        packed = request.append_seq_ids
        self.n_packed = len(packed)
        ids.extend(packed)
        counts.extend(request.append_num_tokens or [1] * len(packed))
        packed_known = bool(request.append_token_ids)
        known.extend([packed_known] * len(packed))
        tokens.extend(request.append_token_ids)
        self.ids, self.counts, self.tokens, self.known = ids, counts, tokens, known

    def split_results(self, r: StepResult, resp: pb.StepResponse) -> None:
        n_sub = self.n_sub
        per_item: list[list[int]] = [[] for _ in range(n_sub)]
        for i, b in zip(r.new_block_index, r.new_block_ids, strict=True):
            if i < n_sub:
                per_item[i].append(b)
            else:
                resp.packed_new_block_index.append(i - n_sub)
                resp.packed_new_block_ids.append(b)
        copies: dict[int, tuple[int, int]] = {}
        for k, i in enumerate(r.replaced_index):
            if i < n_sub:
                copies[i] = r.ops.copies[k]
            else:
                resp.packed_replaced_index.append(i - n_sub)
        preempted: dict[int, list[Preemption]] = {}
        for p, i in zip(r.preempted, r.preempted_by, strict=True):
            if i < n_sub:
                preempted.setdefault(i, []).append(p)
        total = len(self.map) + len(self.bad)
        items = [pb.AppendResponse() for _ in range(total)]
        for i, j in enumerate(self.map):
            if per_item[i]:
                copy = copies.get(i)
                item = items[j]
                item.new_block_ids.extend(per_item[i])
                if copy is not None:
                    item.replaced_last_block = True
                    item.ops.copies.add(src=copy[0], dst=copy[1])
                item.preempted.extend(preemptions_to_proto(preempted.get(i, [])))
        if r.kv_groups:
            self._split_groups(r, resp, items)
        resp.appends.extend(items)

    def _split_groups(self, r: StepResult, resp: pb.StepResponse, items: list[pb.AppendResponse]) -> None:
        """KV groups 1..'s deltas: sub-message items get theirs in group_blocks, packed ones go to
        group_deltas (allocations too)."""
        n_sub = self.n_sub
        for d in r.kv_groups:
            packed = resp.group_deltas.add()
            blocks = [pb.GroupBlocks() for _ in items]
            for i, b in zip(d.new_block_index, d.new_block_ids, strict=True):
                if i < n_sub:
                    blocks[self.map[i]].new_block_ids.append(b)
                else:
                    packed.packed_new_block_index.append(i - n_sub)
                    packed.packed_new_block_ids.append(b)
            for i, copy in zip(d.replaced_index, d.copies, strict=True):
                if i < n_sub:
                    blocks[self.map[i]].replaced_last_block = True
                    items[self.map[i]].ops.copies.add(src=copy[0], dst=copy[1])
                else:
                    packed.packed_replaced_index.append(i - n_sub)
            packed.packed_alloc_block_index.extend(d.alloc_block_index)
            packed.packed_alloc_block_ids.extend(d.alloc_block_ids)
            for item, g in zip(items, blocks, strict=True):
                if item.new_block_ids:
                    item.group_blocks.append(g)

    def errors(self, r: StepResult, errors: Any) -> None:
        n_sub = self.n_sub
        for j, seq_id, message in self.bad:
            errors.append(
                pb.StepItemError(
                    kind=pb.StepItemError.APPEND,
                    index=j,
                    seq_id=seq_id,
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    message=message,
                )
            )
        for err in r.append_errors:
            if err.index < n_sub:
                errors.append(_item_error(pb.StepItemError.APPEND, err, self.map[err.index]))
            else:
                errors.append(_item_error(pb.StepItemError.PACKED_APPEND, err, err.index - n_sub))


def step_batch(request: pb.StepRequest, tenant: str, sub: _SubAppends | None, frees: Any) -> StepBatch:
    """The core's batch for a Step request (both encodings); raises InvalidArgument, naming the
    field, for shapes that do not fit together. The one place wire shapes are checked."""
    if sub is None:
        ids: Any = request.append_seq_ids
        counts: Any = request.append_num_tokens or None
        raw_tokens: Any = request.append_token_ids
        known: list[bool] | None = None
    else:
        ids, counts, raw_tokens, known = sub.ids, sub.counts, sub.tokens, sub.known
    n = len(ids)
    if counts is not None and len(counts) != n:
        raise InvalidArgument(
            f"append_num_tokens has {len(counts)} entries for {n} sequences; they must match"
        )
    tokens = None
    if raw_tokens or known is not None:
        if known is None:
            expected = n if counts is None else sum(counts)
        else:
            expected = sum(counts[i] for i in range(n) if known[i])
        if len(raw_tokens) != expected:
            raise InvalidArgument(
                f"append_token_ids has {len(raw_tokens)} entries but the counts add up to "
                f"{expected}; they must match"
            )
        tokens = _token_array(raw_tokens, "append_token_ids")
    commits = request.commit_seq_ids
    if len(request.commit_num_computed_tokens) != len(commits):
        raise InvalidArgument(
            f"commit_num_computed_tokens has {len(request.commit_num_computed_tokens)} entries "
            f"for {len(commits)} sequences; they must match"
        )
    allocs = request.alloc_seq_ids
    na = len(allocs)
    alloc_tokens = None
    priorities = salts = skips = None
    if len(request.alloc_num_tokens) != na:
        raise InvalidArgument(
            f"alloc_num_tokens has {len(request.alloc_num_tokens)} entries for {na} "
            "allocations; they must match"
        )
    for what, arr in (
        ("alloc_lease_ids", request.alloc_lease_ids),
        ("alloc_priorities", request.alloc_priorities),
        ("alloc_cache_salts", request.alloc_cache_salts),
        ("alloc_skip_prefix_hits", request.alloc_skip_prefix_hits),
    ):
        if len(arr) and len(arr) != na:
            raise InvalidArgument(f"{what} has {len(arr)} entries for {na} allocations; one each, or none")
    if na:
        priorities = request.alloc_priorities or None
        salts = request.alloc_cache_salts or None
        skips = list(request.alloc_skip_prefix_hits) if any(request.alloc_skip_prefix_hits) else None
        if request.alloc_token_ids:
            expected = sum(request.alloc_num_tokens)
            if len(request.alloc_token_ids) != expected:
                raise InvalidArgument(
                    f"alloc_token_ids has {len(request.alloc_token_ids)} entries but "
                    f"alloc_num_tokens adds up to {expected}; they must match"
                )
            alloc_tokens = _token_array(request.alloc_token_ids, "alloc_token_ids")
    if len(request.rollback_num_tokens) != len(request.rollback_seq_ids):
        raise InvalidArgument(
            f"rollback_num_tokens has {len(request.rollback_num_tokens)} entries for "
            f"{len(request.rollback_seq_ids)} sequences; they must match"
        )
    if len(request.fork_child_seq_ids) != len(request.fork_parent_seq_ids):
        raise InvalidArgument(
            f"fork_child_seq_ids has {len(request.fork_child_seq_ids)} entries for "
            f"{len(request.fork_parent_seq_ids)} parents; they must match"
        )
    early = request.fork_before_appends
    if len(early) and len(early) != len(request.fork_parent_seq_ids):
        raise InvalidArgument(
            f"fork_before_appends has {len(early)} entries for {len(request.fork_parent_seq_ids)} "
            "forks; one each, or none"
        )
    return StepBatch(
        commit_seq_ids=commits,
        commit_num_computed_tokens=request.commit_num_computed_tokens,
        free_seq_ids=frees,
        append_seq_ids=ids,
        append_num_tokens=counts,
        append_token_ids=tokens,
        append_tokens_known=known,
        alloc_seq_ids=allocs,
        alloc_num_tokens=request.alloc_num_tokens,
        alloc_token_ids=alloc_tokens,
        alloc_priorities=priorities,
        alloc_salts=salts,
        fork_parent_seq_ids=request.fork_parent_seq_ids,
        fork_child_seq_ids=request.fork_child_seq_ids,
        swap_in_seq_ids=request.swap_in_seq_ids,
        tenant=tenant,
        grant_seq_ids=request.grant_seq_ids,
        rollback_seq_ids=request.rollback_seq_ids,
        rollback_num_tokens=request.rollback_num_tokens,
        alloc_skip_prefix_hits=skips,
        fork_before_appends=list(early) if any(early) else None,
    )


class CoreStage:
    """Applies one RPC to the core under the state lock (the pipeline's last stage).

    Each handler translates its request, holds the lock only for the core call and the
    event drain, and builds the reply outside it. A stage before this one that must do
    more in the same critical section (the reliability stage: leases, journal) holds
    the lock around the call; the lock is reentrant."""

    def __init__(self, core: BlockManager, lock: threading.RLock) -> None:
        self.core = core
        self.lock = lock  # the state lock: every stage that touches state takes this one
        self.events_hub: EventHub | None = None  # set by server.py (block_manager_svc/events.py)
        self.log_limit = LogLimiter()  # rejections are the client's doing: rate-limited lines
        # While the reliability stage journals a request (under the lock): the commands applied.
        self.record: list[cmds.Command] | None = None
        # RPC name -> bound handler, looked up once per call (no getattr on the hot path).
        self.handlers: dict[str, Callable[[Any, Any, str | None], Any]] = {
            name: getattr(self, name) for name in (*MUTATIONS, "GetBlockTable", "GetStats", "GetConfig")
        }

    def apply(self, name: str, request: Any, context: Any, tenant: str | None = None) -> Any:
        """Run RPC `name`; `tenant` (None with authentication off) owns the KV events it produces."""
        return self.handlers[name](request, context, tenant)

    def _drain_events(self, tenant: str | None) -> None:
        """Hand the events the last core call produced to the hub (under the lock)."""
        events = self.core.take_events()
        if events:
            hub = self.events_hub
            if hub is not None:
                hub.publish(events, tenant)

    def _abort(
        self, context: grpc.ServicerContext, method: str, err: CoreError, seq_id: str, request: object = None
    ) -> NoReturn:
        self.log_limit.info(
            log,
            "request_rejected",
            method=method,
            seq_id=seq_id,
            code=err.code.name,
            reason=err.message,
            request_id=request_id_of(context, request),
        )
        code = STATUS_BY_CODE[err.code]
        abort_with_status = getattr(context, "abort_with_status", None)
        if abort_with_status is None:  # a test double
            context.abort(code, err.message)
        else:
            abort_with_status(rich_status(code, err.message, err.reason, seq_id))
        raise AssertionError("unreachable")  # aborting raises

    def Allocate(
        self, request: pb.AllocateRequest, context: Any, tenant: str | None = None
    ) -> pb.AllocateResponse:
        try:
            with self.lock:
                r = self.core.allocate(
                    request.seq_id,
                    request.num_tokens,
                    request.token_ids or None,
                    request.priority,
                    request.cache_salt,
                    tenant or "",
                )
                if self.record is not None:
                    self.record.append(
                        cmds.Allocate(
                            request.seq_id,
                            request.num_tokens,
                            list(request.token_ids) or None,
                            request.priority,
                            request.cache_salt,
                            tenant or "",
                        )
                    )
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "Allocate", e, request.seq_id, request)
        return pb.AllocateResponse(
            block_ids=r.block_ids,
            num_cached_tokens=r.num_cached_tokens,
            group_tables=group_tables(len(r.block_ids), r.kv_block_ids),
        )

    def Append(self, request: pb.AppendRequest, context: Any, tenant: str | None = None) -> pb.AppendResponse:
        try:
            with self.lock:
                r = self.core.append(request.seq_id, request.num_tokens, request.token_ids or None)
                if self.record is not None:
                    self.record.append(
                        cmds.Append(request.seq_id, request.num_tokens, list(request.token_ids) or None)
                    )
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "Append", e, request.seq_id, request)
        if not r.new_block_ids and not any(r.kv_new_block_ids):
            return pb.AppendResponse()
        if r.preempted:
            log.info(
                "preempted",
                method="Append",
                seq_id=request.seq_id,
                victims=[(p.seq_id, p.mode) for p in r.preempted],
                request_id=request_id_of(context, request),
            )
        return pb.AppendResponse(
            new_block_ids=r.new_block_ids,
            ops=ops_to_proto(r.ops),
            replaced_last_block=r.replaced_last_block,
            preempted=preemptions_to_proto(r.preempted),
            group_blocks=[
                pb.GroupBlocks(new_block_ids=new, replaced_last_block=rep)
                for new, rep in zip(r.kv_new_block_ids, r.kv_replaced_last_block, strict=True)
            ],
        )

    def Fork(self, request: pb.ForkRequest, context: Any, tenant: str | None = None) -> pb.ForkResponse:
        try:
            with self.lock:
                blocks = self.core.fork(request.parent_seq_id, request.child_seq_id)
                kv_tables = [list(t) for t in self.core.seqs[request.child_seq_id].kv_tables]
                if self.record is not None:
                    self.record.append(cmds.Fork(request.parent_seq_id, request.child_seq_id))
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "Fork", e, request.child_seq_id, request)
        return pb.ForkResponse(block_ids=blocks, group_tables=group_tables(len(blocks), kv_tables))

    def Free(self, request: pb.FreeRequest, context: Any, tenant: str | None = None) -> pb.FreeResponse:
        try:
            with self.lock:
                released = self.core.free(request.seq_id)
                if self.record is not None:
                    self.record.append(cmds.Free(request.seq_id))
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "Free", e, request.seq_id, request)
        return pb.FreeResponse(num_blocks_released=released)

    def GetBlockTable(
        self, request: pb.GetBlockTableRequest, context: Any, tenant: str | None = None
    ) -> pb.BlockTable:
        try:
            with self.lock:
                table = self.core.block_table(request.seq_id)
        except CoreError as e:
            self._abort(context, "GetBlockTable", e, request.seq_id, request)
        resp = pb.BlockTable(
            block_ids=table.block_ids,
            num_tokens=table.num_tokens,
            swapped=table.swapped,
            cpu_block_ids=table.cpu_block_ids,
        )
        if table.kv_block_ids:
            resp.group_tables.extend(group_tables(len(table.block_ids), table.kv_block_ids))
        elif table.kv_cpu_block_ids:
            n = len(table.cpu_block_ids)
            for t in table.kv_cpu_block_ids:
                resp.group_tables.add(first_block_index=n - len(t), cpu_block_ids=t)
        return resp

    def SwapIn(self, request: pb.SwapInRequest, context: Any, tenant: str | None = None) -> pb.SwapInResponse:
        try:
            with self.lock:
                r = self.core.swap_in(request.seq_id)
                if self.record is not None:
                    self.record.append(cmds.SwapIn(request.seq_id))
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "SwapIn", e, request.seq_id, request)
        return swap_in_to_proto(r)

    def Preempt(
        self, request: pb.PreemptRequest, context: Any, tenant: str | None = None
    ) -> pb.PreemptResponse:
        try:
            with self.lock:
                preempted, ops = self.core.preempt(request.seq_id, request.mode or None)
                if self.record is not None:
                    self.record.append(cmds.Preempt(request.seq_id, request.mode or None))
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "Preempt", e, request.seq_id, request)
        log.info(
            "preempted",
            method="Preempt",
            seq_id=request.seq_id,
            victims=[(p.seq_id, p.mode) for p in preempted],
            request_id=request_id_of(context, request),
        )
        return pb.PreemptResponse(preempted=preemptions_to_proto(preempted), ops=ops_to_proto(ops))

    def Commit(self, request: pb.CommitRequest, context: Any, tenant: str | None = None) -> pb.CommitResponse:
        try:
            with self.lock:
                n = self.core.commit(request.seq_id, request.num_computed_tokens)
                if self.record is not None:
                    self.record.append(cmds.Commit(request.seq_id, request.num_computed_tokens))
                self._drain_events(tenant)
        except CoreError as e:
            self._abort(context, "Commit", e, request.seq_id, request)
        return pb.CommitResponse(num_committed_blocks=n)

    def Step(self, request: pb.StepRequest, context: Any, tenant: str | None = None) -> pb.StepResponse:
        return self.step(request, context, tenant)[0]

    def step(
        self, request: pb.StepRequest, context: Any, tenant: str | None
    ) -> tuple[pb.StepResponse, StepResult]:
        """Step, and the core's result (the reliability stage reads which allocations and forks
        applied from it, for their leases)."""
        if request.frees:
            frees: Any = [f.seq_id for f in request.frees]
            frees.extend(request.free_seq_ids)
        else:
            frees = request.free_seq_ids
        sub = _SubAppends(request) if request.appends else None
        try:
            batch = step_batch(request, tenant or "", sub, frees)
            with self.lock:
                r = self.core.step(batch)
                if self.record is not None:
                    self.record.append(cmds.Step.of(batch))
                self._drain_events(tenant)
                available = self.core.pool.num_available
                drops = self.core.prefix_cache_drops
        except CoreError as e:
            self._abort(context, "Step", e, "", request)

        resp = pb.StepResponse(
            num_blocks_released=sum(r.released),
            num_available_blocks=available,
            prefix_cache_drops=drops,
        )
        if sub is None:
            if r.new_block_ids:
                resp.packed_new_block_index.extend(r.new_block_index)
                resp.packed_new_block_ids.extend(r.new_block_ids)
            if r.replaced_index:
                resp.packed_replaced_index.extend(r.replaced_index)
            for d in r.kv_groups:
                resp.group_deltas.add(
                    packed_new_block_index=d.new_block_index,
                    packed_new_block_ids=d.new_block_ids,
                    packed_replaced_index=d.replaced_index,
                    packed_alloc_block_index=d.alloc_block_index,
                    packed_alloc_block_ids=d.alloc_block_ids,
                )
        else:
            sub.split_results(r, resp)
        ops = r.ops
        for swap_in in r.swap_in_results:
            if swap_in is None:
                resp.swap_ins.add()
            else:
                ops.extend(swap_in.ops)
                resp.swap_ins.append(swap_in_to_proto(swap_in))
        if r.preempted:
            resp.preempted.extend(preemptions_to_proto(r.preempted))
            log.info(
                "preempted",
                method="Step",
                victims=[(p.seq_id, p.mode) for p in r.preempted],
                request_id=request_id_of(context, request),
            )
        if ops:
            resp.ops.CopyFrom(ops_to_proto(ops))
        if r.alloc_num_cached_tokens:
            resp.alloc_num_cached_tokens.extend(r.alloc_num_cached_tokens)
            resp.packed_alloc_block_index.extend(r.alloc_block_index)
            resp.packed_alloc_block_ids.extend(r.alloc_block_ids)
        if r.grant_block_ids:
            resp.packed_grant_index.extend(r.grant_index)
            resp.packed_grant_block_ids.extend(r.grant_block_ids)
        n_sub = len(request.frees)
        for released in r.released[:n_sub]:
            resp.frees.add(num_blocks_released=released)
        if (
            r.commit_errors
            or r.free_errors
            or r.append_errors
            or r.alloc_errors
            or r.fork_errors
            or r.swap_in_errors
            or r.grant_errors
            or r.rollback_errors
            or (sub is not None and sub.bad)
        ):
            self._step_errors(request, context, r, sub, resp.errors, n_sub)
        return resp, r

    def _step_errors(
        self,
        request: pb.StepRequest,
        context: Any,
        r: StepResult,
        sub: _SubAppends | None,
        errors: Any,
        n_sub: int,
    ) -> None:
        for err in r.rollback_errors:
            errors.append(_item_error(pb.StepItemError.ROLLBACK, err))
        for err in r.commit_errors:
            errors.append(_item_error(pb.StepItemError.COMMIT, err))
        for err in r.free_errors:
            if err.index < n_sub:
                errors.append(_item_error(pb.StepItemError.FREE, err))
            else:
                errors.append(_item_error(pb.StepItemError.PACKED_FREE, err, err.index - n_sub))
        if sub is None:
            for err in r.append_errors:
                errors.append(_item_error(pb.StepItemError.PACKED_APPEND, err))
        else:
            sub.errors(r, errors)
        for err in r.alloc_errors:
            errors.append(_item_error(pb.StepItemError.ALLOCATE, err))
        for err in r.fork_errors:
            errors.append(_item_error(pb.StepItemError.FORK, err))
        for err in r.swap_in_errors:
            errors.append(_item_error(pb.StepItemError.SWAP_IN, err))
        for err in r.grant_errors:
            errors.append(_item_error(pb.StepItemError.GRANT, err))
        self.log_limit.info(
            log,
            "step_item_errors",
            count=len(errors),
            first=errors[0].message,
            request_id=request_id_of(context, request),
        )

    def GetStats(self, request: pb.GetStatsRequest, context: Any, tenant: str | None = None) -> pb.Stats:
        with self.lock:
            s = self.core.stats()
        return pb.Stats(
            block_size=s.block_size,
            num_gpu_blocks=s.num_gpu_blocks,
            num_free_blocks=s.num_free_blocks,
            num_cached_blocks=s.num_cached_blocks,
            num_sequences=s.num_sequences,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_used_blocks=s.num_used_blocks,
            num_evicted_blocks=s.num_evicted_blocks,
            num_cow_copies=s.num_cow_copies,
            num_hashed_blocks=s.num_hashed_blocks,
            num_cpu_blocks=s.num_cpu_blocks,
            num_free_cpu_blocks=s.num_free_cpu_blocks,
            num_swapped_sequences=s.num_swapped_sequences,
            num_preemptions_swap=s.num_preemptions_swap,
            num_preemptions_recompute=s.num_preemptions_recompute,
            num_swapped_out_blocks=s.num_swapped_out_blocks,
            num_swapped_in_blocks=s.num_swapped_in_blocks,
            preemption_cost_s=s.preemption_cost_s,
            num_prefix_cache_resets=s.num_prefix_cache_resets,
            num_committed_blocks=s.num_committed_blocks,
        )

    def ResetPrefixCache(  # noqa: N802 - gRPC method name
        self, request: pb.ResetPrefixCacheRequest, context: Any, tenant: str | None = None
    ) -> pb.ResetPrefixCacheResponse:
        """Forget every prefix-cache hash (their KV is gone: a new cache host). Cannot fail."""
        with self.lock:
            cleared, freed = self.core.reset_prefix_cache()
            if self.record is not None:
                self.record.append(cmds.ResetPrefixCache())
            self._drain_events(tenant)
        log.info("prefix_cache_reset", blocks_cleared=cleared, blocks_freed=freed)
        return pb.ResetPrefixCacheResponse(num_blocks_cleared=cleared, num_blocks_freed=freed)

    def GetConfig(self, request: pb.GetConfigRequest, context: Any, tenant: str | None = None) -> pb.Config:
        cfg = self.core.config
        return pb.Config(
            block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_gpu_blocks,
            num_cpu_blocks=cfg.num_cpu_blocks,
            eviction_policy=cfg.eviction_policy,
            preemption_mode=cfg.preemption_mode,
            watermark_blocks=cfg.watermark_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching,
            kv_cache_dtype=cfg.kv_cache_dtype,
            kv_bytes_per_block=cfg.kv_bytes_per_block,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            kv_groups=[pb.KVGroup(kind=g.kind, window_tokens=g.window_tokens) for g in cfg.kv_groups]
            if len(cfg.kv_groups) > 1
            else [],
        )
