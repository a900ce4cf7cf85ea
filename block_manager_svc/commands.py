"""State changes as data: the explicit, versioned commands the journal records and replays.

The core is deterministic, so its state is a function of the calls made to
its mutating methods, and the lease table's likewise. Each such call has a
command type here, a msgspec struct with named fields (:data:`Command` is
their union): ``Allocate``, ``Append``, ``Commit``, ``Fork``, ``Free``,
``Step``, ``SwapIn``, ``Preempt``, ``ResetPrefixCache`` for the core and
``LeaseTouch``, ``LeaseAttach``, ``LeaseDetach``, ``LeaseDetachAll``,
``LeaseDrop``, ``LeaseNoteExpired`` for the lease table. :func:`apply` is the
one place that turns a command into a call: a journal can name nothing else,
and decoding a record builds only these types.

Who records: the stages that make the calls build the command themselves
(block_manager_svc/handlers.py for the core calls of an RPC,
block_manager_svc/reliability.py for lease bookkeeping and lease expiry)
and append it to the request's list once the call returned. A call that
raised changed nothing (every core method validates before it mutates) and is
not recorded.

A journal record (:data:`RECORD_NAME`) holds a :class:`Batch`: the commands
of one applied request and, for a request with a ``request_id``, its dedupe
entry (the reply as sent), so replay rebuilds the dedupe window without
rebuilding replies. Records of the previous format (``Commands``: generic
``(target, method, args, kwargs)`` tuples) are migrated by
:func:`decode_batch`, here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedkv.block_manager_svc.core import BlockManager, CoreError, StepBatch
from pagedkv.block_manager_svc.core.prefix_cache import encode_tokens
from pagedkv.block_manager_svc.leases import LeaseTable

RECORD_NAME = "Commands3"  # the journal record name of a batch of explicit commands (format 3)
RECORD_NAME_V2 = "Commands"  # format 2: generic method calls, read and migrated by decode_batch


class ReplayError(RuntimeError):
    """A journaled command was refused on replay: the journal and the code disagree."""


class _Cmd(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Every command repeats ``frozen=True``: msgspec inherits it, type checkers do not."""


# --- the core's commands -------------------------------------------------------------
class Allocate(_Cmd, frozen=True):
    seq_id: str
    num_tokens: int
    token_ids: list[int] | None = None
    priority: int = 0
    salt: str = ""
    tenant: str = ""


class Append(_Cmd, frozen=True):
    seq_id: str
    num_tokens: int
    token_ids: list[int] | None = None


class Commit(_Cmd, frozen=True):
    seq_id: str
    num_computed_tokens: int


class Fork(_Cmd, frozen=True):
    parent_seq_id: str
    child_seq_id: str


class Free(_Cmd, frozen=True):
    seq_id: str


class SwapIn(_Cmd, frozen=True):
    seq_id: str


class Preempt(_Cmd, frozen=True):
    seq_id: str
    mode: str | None = None


class ResetPrefixCache(_Cmd, frozen=True):
    pass


class Step(_Cmd, frozen=True):
    """A StepBatch as data (token ids as lists); see core/step_batch.py for the fields."""

    commit_seq_ids: list[str] = []
    commit_num_computed_tokens: list[int] = []
    free_seq_ids: list[str] = []
    append_seq_ids: list[str] = []
    append_num_tokens: list[int] | None = None
    append_token_ids: list[int] | None = None
    append_tokens_known: list[bool] | None = None
    alloc_seq_ids: list[str] = []
    alloc_num_tokens: list[int] = []
    alloc_token_ids: list[int] | None = None
    alloc_priorities: list[int] | None = None
    alloc_salts: list[str] | None = None
    fork_parent_seq_ids: list[str] = []
    fork_child_seq_ids: list[str] = []
    swap_in_seq_ids: list[str] = []
    tenant: str = ""
    grant_seq_ids: list[str] = []  # after the older fields: records written before grants lack it
    rollback_seq_ids: list[str] = []  # likewise for rollbacks
    rollback_num_tokens: list[int] = []
    alloc_skip_prefix_hits: list[bool] | None = None  # likewise for prompt-logprob allocations
    fork_before_appends: list[bool] | None = None  # likewise for beam-search forks

    @classmethod
    def of(cls, b: StepBatch) -> Step:
        def opt(x: Any) -> Any:
            return None if x is None else list(x)

        return cls(
            list(b.commit_seq_ids),
            list(b.commit_num_computed_tokens),
            list(b.free_seq_ids),
            list(b.append_seq_ids),
            opt(b.append_num_tokens),
            opt(b.append_token_ids),
            opt(b.append_tokens_known),
            list(b.alloc_seq_ids),
            list(b.alloc_num_tokens),
            opt(b.alloc_token_ids),
            opt(b.alloc_priorities),
            opt(b.alloc_salts),
            list(b.fork_parent_seq_ids),
            list(b.fork_child_seq_ids),
            list(b.swap_in_seq_ids),
            b.tenant,
            list(b.grant_seq_ids),
            list(b.rollback_seq_ids),
            list(b.rollback_num_tokens),
            opt(b.alloc_skip_prefix_hits),
            opt(b.fork_before_appends),
        )

    def batch(self) -> StepBatch:
        return StepBatch(
            commit_seq_ids=self.commit_seq_ids,
            commit_num_computed_tokens=self.commit_num_computed_tokens,
            free_seq_ids=self.free_seq_ids,
            append_seq_ids=self.append_seq_ids,
            append_num_tokens=self.append_num_tokens,
            append_token_ids=None if self.append_token_ids is None else encode_tokens(self.append_token_ids),
            append_tokens_known=self.append_tokens_known,
            alloc_seq_ids=self.alloc_seq_ids,
            alloc_num_tokens=self.alloc_num_tokens,
            alloc_token_ids=None if self.alloc_token_ids is None else encode_tokens(self.alloc_token_ids),
            alloc_priorities=self.alloc_priorities,
            alloc_salts=self.alloc_salts,
            fork_parent_seq_ids=self.fork_parent_seq_ids,
            fork_child_seq_ids=self.fork_child_seq_ids,
            swap_in_seq_ids=self.swap_in_seq_ids,
            tenant=self.tenant,
            grant_seq_ids=self.grant_seq_ids,
            rollback_seq_ids=self.rollback_seq_ids,
            rollback_num_tokens=self.rollback_num_tokens,
            alloc_skip_prefix_hits=self.alloc_skip_prefix_hits,
            fork_before_appends=self.fork_before_appends,
        )


# --- the lease table's commands ----------------------------------------------------------
class LeaseTouch(_Cmd, frozen=True):
    lease_id: str
    ttl_s: float | None = None


class LeaseAttach(_Cmd, frozen=True):
    seq_id: str
    lease_id: str


class LeaseDetach(_Cmd, frozen=True):
    seq_id: str


class LeaseDetachAll(_Cmd, frozen=True):
    seq_ids: list[str]


class LeaseDrop(_Cmd, frozen=True):
    lease_id: str


class LeaseNoteExpired(_Cmd, frozen=True):
    num_sequences: int


Command = (
    Allocate
    | Append
    | Commit
    | Fork
    | Free
    | SwapIn
    | Preempt
    | ResetPrefixCache
    | Step
    | LeaseTouch
    | LeaseAttach
    | LeaseDetach
    | LeaseDetachAll
    | LeaseDrop
    | LeaseNoteExpired
)


class DedupeEntry(msgspec.Struct, array_like=True, frozen=True):
    """What the dedupe window remembers of a request with a ``request_id``."""

    request_id: str
    method: str
    digest: bytes
    reply: bytes
    wall_time: float


class Batch(msgspec.Struct, array_like=True):
    """The commands one request applied, and its dedupe entry if it had an id."""

    commands: list[Command] = []
    dedupe: DedupeEntry | None = None


def apply(cmd: Command, core: BlockManager, leases: LeaseTable) -> Any:
    """Run one command: the only way a command becomes a call. A refusal raises the core's
    CoreError, as the call would (the state is unchanged)."""
    match cmd:
        case Allocate():
            return core.allocate(
                cmd.seq_id, cmd.num_tokens, cmd.token_ids, cmd.priority, cmd.salt, cmd.tenant
            )
        case Append():
            return core.append(cmd.seq_id, cmd.num_tokens, cmd.token_ids)
        case Commit():
            return core.commit(cmd.seq_id, cmd.num_computed_tokens)
        case Fork():
            return core.fork(cmd.parent_seq_id, cmd.child_seq_id)
        case Free():
            return core.free(cmd.seq_id)
        case SwapIn():
            return core.swap_in(cmd.seq_id)
        case Preempt():
            return core.preempt(cmd.seq_id, cmd.mode)
        case ResetPrefixCache():
            return core.reset_prefix_cache()
        case Step():
            return core.step(cmd.batch())
        case LeaseTouch():
            return leases.touch(cmd.lease_id, cmd.ttl_s)
        case LeaseAttach():
            return leases.attach(cmd.seq_id, cmd.lease_id)
        case LeaseDetach():
            return leases.detach(cmd.seq_id)
        case LeaseDetachAll():
            return leases.detach_all(cmd.seq_ids)
        case LeaseDrop():
            return leases.drop(cmd.lease_id)
        case LeaseNoteExpired():
            return leases.note_expired(cmd.num_sequences)
    raise ReplayError(f"{cmd!r} is not a known state change")


def replay(cmd: Command, core: BlockManager, leases: LeaseTable) -> None:
    """Apply a journaled command; a refusal means the journal and the code disagree."""
    try:
        apply(cmd, core, leases)
    except CoreError as e:
        raise ReplayError(f"{type(cmd).__name__} was refused: {e.code.name}: {e.message}") from None


# --- encoding (msgpack; a record is written for every journaled mutation) -------------------
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)
_plain_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(body: bytes, name: str = RECORD_NAME) -> Batch:
    """The batch in a journal record named `name` (this format, or format 2, migrated)."""
    try:
        if name == RECORD_NAME_V2:
            return _migrate_v2(_plain_decoder.decode(body))
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as e:
        raise ReplayError(f"a journal record does not hold a command batch: {e}") from None


# --- the one migration: format 2 (generic calls) to these commands --------------------------
_V2_CORE: dict[str, type[Command]] = {
    "allocate": Allocate,
    "append": Append,
    "commit": Commit,
    "fork": Fork,
    "free": Free,
    "swap_in": SwapIn,
    "preempt": Preempt,
    "reset_prefix_cache": ResetPrefixCache,
}
_V2_LEASES: dict[str, type[Command]] = {
    "touch": LeaseTouch,
    "attach": LeaseAttach,
    "detach": LeaseDetach,
    "detach_all": LeaseDetachAll,
    "drop": LeaseDrop,
    "note_expired": LeaseNoteExpired,
}
_V2_STEP_POSITIONAL = (
    "append_seq_ids",
    "append_num_tokens",
    "append_token_ids",
    "free_seq_ids",
    "swap_in_seq_ids",
)


def _migrate_v2(doc: Any) -> Batch:
    """Format-2 records: ``([(target, method, args, kwargs)...], dedupe tuple or None)``. Their Step
    was first the parallel-array parameters, later ``(batch fields,)``."""
    calls, d = doc
    out: list[Command] = []
    for target, op, args, kwargs in calls:
        if target == "core" and op == "step":
            out.append(_v2_step(tuple(args), kwargs))
            continue
        kind = (_V2_CORE if target == "core" else _V2_LEASES if target == "leases" else {}).get(op)
        if kind is None:
            raise ReplayError(f"command {target}.{op} is not a known state change")
        try:
            out.append(kind(*args, **kwargs))
        except TypeError as e:
            raise ReplayError(
                f"command {target}.{op} has arguments this version does not take: {e}"
            ) from None
    return Batch(out, None if d is None else DedupeEntry(*d))


def _v2_step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        values = dict(args[0])
    else:  # the parallel-array parameters: empty arrays meant "none", as they did then
        values = dict(zip(_V2_STEP_POSITIONAL, args, strict=False))
        values.update(kwargs)
        for k in ("append_num_tokens", "alloc_priorities", "alloc_salts"):
            if not values.get(k):
                values[k] = None
        if not values.get("append_token_ids") and values.get("append_tokens_known") is None:
            values["append_token_ids"] = None
        if not values.get("alloc_token_ids"):
            values["alloc_token_ids"] = None
    unknown = set(values) - set(Step.__struct_fields__)
    if unknown:
        raise ReplayError(f"core.step names unknown fields {sorted(unknown)}")
    return Step(**values)
