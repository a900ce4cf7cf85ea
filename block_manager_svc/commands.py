"""State changes as data: the core and lease commands the journal records and replays.

The core is deterministic, so its state is a function of the calls made to
its mutating methods (allocate, append, commit, fork, free, step, swap_in,
preempt, reset_prefix_cache), and the lease table's likewise (touch, attach,
detach, detach_all, drop, note_expired). A :class:`Command` is one such call
with its arguments as plain data (str, int, float, bool, None, bytes, lists,
dicts), so it encodes to msgpack and replays by calling the same method
again: no gRPC request, no servicer, no fake context.

:class:`Tap` is how commands are captured on the live path: a view of the
core (or lease table) that passes every attribute through and, for the
mutating methods, records the call once it returned. A call that raised
changed nothing (every core method validates before it mutates) and is not
recorded. Nested calls the target makes on itself (``step`` calling into its
own helpers, ``attach`` calling ``touch``) are not seen by the tap, so each
command replays exactly once.

A journal record holds the commands of one applied request and, for a
request with a ``request_id``, its dedupe entry (the reply as sent), so
replay rebuilds the dedupe window without rebuilding replies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

from block_manager_svc.core import CoreError, StepBatch
from block_manager_svc.core.prefix_cache import encode_tokens

CORE = "core"
LEASES = "leases"
# The only methods a command may name: a journal can never call anything else.
OPS: dict[str, frozenset[str]] = {
    CORE: frozenset({
        "allocate", "append", "commit", "fork", "free", "step", "swap_in", "preempt", "reset_prefix_cache",
    }),
    LEASES: frozenset({"touch", "attach", "detach", "detach_all", "drop", "note_expired"}),
}
RECORD_NAME = "Commands"  # the journal record name of a batch (format 2; older records named an RPC)

_SCALARS = (str, int, float, bool, bytes, type(None))


class ReplayError(RuntimeError):
    """A journaled command was refused on replay: the journal and the code disagree."""


@dataclass(slots=True, frozen=True)
class Command:
    """One call of a mutating method: ``target.op(*args, **kwargs)``."""

    target: str
    op: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class DedupeEntry:
    """What the dedupe window remembers of a request with a ``request_id``."""

    request_id: str
    method: str
    digest: bytes
    reply: bytes
    wall_time: float


@dataclass(slots=True)
class Batch:
    """The commands one request applied, and its dedupe entry if it had an id."""

    commands: list[Command] = field(default_factory=list)
    dedupe: DedupeEntry | None = None


def plain(value: Any) -> Any:
    """`value` as plain data: protobuf repeated fields, arrays, tuples and generators become lists;
    a StepBatch becomes a dict of its fields (see `step_batch_of`)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, StepBatch):
        return {f: plain(getattr(value, f)) for f in _BATCH_FIELDS}
    return [plain(v) for v in value]


_BATCH_FIELDS = tuple(f.name for f in fields(StepBatch))
_BATCH_TOKENS = ("append_token_ids", "alloc_token_ids")
# The positional parameters of the Step the core took before it took a StepBatch (journal format 2,
# first form); the rest came as keywords with the batch's field names (alloc_salts included).
_OLD_STEP_POSITIONAL = (
    "append_seq_ids",
    "append_num_tokens",
    "append_token_ids",
    "free_seq_ids",
    "swap_in_seq_ids",
)


def step_batch_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepBatch:
    """The batch a journaled ``core.step`` command applied: ``(batch_fields,)`` as recorded
    now, or the parallel-array parameters that older records hold (migrated here, the one
    place that knows that form; those records were written after the step succeeded, so
    their shapes are valid, and empty arrays meant "none", as they did then)."""
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        values = dict(args[0])
    else:
        values = dict(zip(_OLD_STEP_POSITIONAL, args, strict=False))
        values.update(kwargs)
        for k in ("append_num_tokens", "alloc_priorities", "alloc_salts"):
            if not values.get(k):
                values[k] = None
        known = values.get("append_tokens_known")
        if not values.get("append_token_ids") and known is None:
            values["append_token_ids"] = None
    unknown = set(values) - set(_BATCH_FIELDS)
    if unknown:
        raise ReplayError(f"core.step names unknown fields {sorted(unknown)}")
    for k in _BATCH_TOKENS:
        if values.get(k) is not None:
            values[k] = encode_tokens(values[k])
    return StepBatch(**values)


class Tap:
    """A view of `target` that records each returned call of its mutating methods into `sink`."""

    __slots__ = ("_target", "_name", "_ops", "sink")

    def __init__(self, target: Any, name: str, sink: list[Command]) -> None:
        self._target = target
        self._name = name
        self._ops = OPS[name]
        self.sink = sink

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._target, attr)
        if attr not in self._ops:
            return value
        return self._recorder(attr, value)

    def _recorder(self, op: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and isinstance(args[0], StepBatch):  # the core reads it as it is
                out = method(*args)
                self.sink.append(Command(self._name, op, (plain(args[0]),)))
                return out
            args = tuple(plain(a) for a in args)  # generators are consumed once, here
            kwargs = {k: plain(v) for k, v in kwargs.items()}
            out = method(*args, **kwargs)
            self.sink.append(Command(self._name, op, args, kwargs))
            return out

        return call

    def __bool__(self) -> bool:
        return bool(self._target)


def apply(cmd: Command, targets: dict[str, Any]) -> Any:
    """Run one command against its target (``{"core": core, "leases": leases}``)."""
    ops = OPS.get(cmd.target)
    if ops is None or cmd.op not in ops:
        raise ReplayError(f"command {cmd.target}.{cmd.op} is not a known state change")
    try:
        if cmd.target == CORE and cmd.op == "step":
            return targets[CORE].step(step_batch_of(cmd.args, cmd.kwargs))
        return getattr(targets[cmd.target], cmd.op)(*cmd.args, **cmd.kwargs)
    except CoreError as e:
        raise ReplayError(f"{cmd.target}.{cmd.op} was refused: {e.code.name}: {e.message}") from None


# --- encoding (msgpack, positional: a journal record is written for every mutation) ------
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: Batch) -> bytes:
    d = batch.dedupe
    return _encoder.encode((
        [(c.target, c.op, c.args, c.kwargs) for c in batch.commands],
        None if d is None else (d.request_id, d.method, d.digest, d.reply, d.wall_time),
    ))


def decode_batch(body: bytes) -> Batch:
    try:
        cmds, d = _decoder.decode(body)
        batch = Batch([Command(t, op, tuple(args), kwargs) for t, op, args, kwargs in cmds])
        if d is not None:
            batch.dedupe = DedupeEntry(*d)
    except (msgspec.DecodeError, TypeError, ValueError) as e:
        raise ReplayError(f"a journal record does not hold a command batch: {e}") from None
    return batch
