"""The block manager's state as plain, versioned data (what a snapshot holds).

Format version 2, a msgpack document::

    {"version": 2,
     "config": {CoreConfig field: value},        # checked against the settings first
     "core":   <the core, as nodes below>,        # blocks, ref counts, hashes, prefix index,
                                                  # eviction order, sequences, CPU pool,
                                                  # preemption queue, tenant usage, counters
     "leases": <LeaseTable.export(), as nodes>,   # ttl and members per lease, expiry counters
     "dedupe": <DedupeTable.export(), as nodes>}  # (request id, method, digest, reply, wall time)

Nodes: str, int, float, bool, None and bytes are themselves; everything else
is a msgpack array that starts with a tag:

    ["list", id, [items]]          ["tuple", [items]]         ["set", id, [items]]
    ["dict", id, [keys], [values]] ["odict", id, [keys], [values]]
    ["array", typecode, bytes]     ["bytearray", id, bytes]
    ["obj", id, "module:Class", [field names], [values]]
    ["ref", id]                    the container or object first written with that id

Objects are the core's own (a class defined under ``block_manager_svc.core``;
loading refuses any other, so a state file can never name code to run, unlike
a pickle) exported field by field from their slots / ``__dict__``, so the
export follows the core's classes without a hand-kept field list. References
keep the core's sharing (the eviction policy is bound to the pool's hash list
and child counts: one list, two owners).

Not state: ``BlockPool.events`` when it holds the KV-event hub (wiring to watchers, attached again
after recovery) is written as None.

Version 1 was a pickle of ``{"version": 1, "core": BlockManager, "leases", "dedupe"}``;
snapshot.py refuses it (a pickle can name code to run).

Migrations live here and only here (the core carries no compatibility code):
``_FIELD_DEFAULTS`` gives, per core class, the value of a field that a version-2
document written before the field existed lacks.
"""

from __future__ import annotations

import importlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from block_manager_svc.core import BlockManager, CoreConfig
from block_manager_svc.core.tenants import NULL_LEDGER

VERSION = 2
_CORE_PACKAGE = "block_manager_svc.core"
_SCALARS = (str, int, float, bool, bytes, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)
# (class name, field): wiring that is not state, written as None unless it is plain data.
_NOT_STATE = frozenset({("BlockPool", "events")})


def _all_scalar(items: Any) -> bool:
    """Whether every item is a scalar (one C-level pass: the pool's per-block lists are long)."""
    return set(map(type, items)) <= _SCALAR_TYPES


class StateError(ValueError):
    """The exported state cannot be loaded by this version."""


@dataclass(slots=True)
class State:
    """A loaded state: the core object and the lease and dedupe exports."""

    core: BlockManager
    leases: dict
    dedupe: list


def export(core: BlockManager, leases: dict, dedupe: list) -> dict[str, Any]:
    """The whole state as a version-2 document of plain data (call under the state lock)."""
    enc = _Encoder()
    return {
        "version": VERSION,
        "config": asdict(core.config),
        "core": enc.node(core),
        "leases": enc.node(leases),
        "dedupe": enc.node(dedupe),
    }


def config_of(doc: dict[str, Any]) -> CoreConfig:
    """The pool geometry a version-2 document was written with (checked before the core is built)."""
    return CoreConfig(**doc["config"])


def restore(doc: Any) -> State:
    """A state from a document of version 2, or from a version-1 (pickled) snapshot."""
    version = doc.get("version") if isinstance(doc, dict) else None
    if version != VERSION:
        raise StateError(f"unknown state format version {version!r} (this version reads {VERSION})")
    dec = _Decoder()
    core = dec.node(doc["core"])
    if not isinstance(core, BlockManager):
        raise StateError(f"the state's core is a {type(core).__name__}, not a BlockManager")
    return State(core, dec.node(doc["leases"]), dec.node(doc["dedupe"]))


_SLOT_FIELDS: dict[type, list[str]] = {}


def _fields(obj: Any) -> list[str]:
    """The names of `obj`'s set attributes: its slots (cached per class), then its ``__dict__``."""
    t = type(obj)
    cached = _SLOT_FIELDS.get(t)
    if cached is not None:
        return cached if all(hasattr(obj, n) for n in cached) else [n for n in cached if hasattr(obj, n)]
    names: list[str] = []
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for n in (slots,) if isinstance(slots, str) else slots:
            if n not in names and n not in ("__weakref__", "__dict__"):
                names.append(n)
    if not hasattr(obj, "__dict__"):
        _SLOT_FIELDS[t] = names
        return [n for n in names if hasattr(obj, n)]
    return [n for n in names if hasattr(obj, n)] + [n for n in obj.__dict__ if n not in names]


class _Encoder:
    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}

    def _new(self, obj: Any) -> int | None:
        """The id for `obj`'s first appearance, or None when it was written before."""
        key = id(obj)
        if key in self.ids:
            return None
        n = self.ids[key] = len(self.ids)
        return n

    def node(self, x: Any) -> Any:
        if isinstance(x, _SCALARS):
            return x
        t = type(x)
        if t is tuple:
            return ["tuple", [self.node(v) for v in x]]
        if t is array:
            return ["array", x.typecode, x.tobytes()]
        n = self._new(x)
        if n is None:
            return ["ref", self.ids[id(x)]]
        if t is list:
            return ["list", n, x if _all_scalar(x) else [self.node(v) for v in x]]
        if t is dict or t is OrderedDict:
            tag = "dict" if t is dict else "odict"
            if _all_scalar(x) and _all_scalar(x.values()):
                return [tag, n, list(x), list(x.values())]
            return [tag, n, [self.node(k) for k in x], [self.node(v) for v in x.values()]]
        if t is set:
            return ["set", n, [self.node(v) for v in x]]
        if t is bytearray:
            return ["bytearray", n, bytes(x)]
        if t.__module__.startswith(_CORE_PACKAGE):
            names = _fields(x)
            cls = t.__qualname__
            values = [self.field(cls, k, getattr(x, k)) for k in names]
            return ["obj", n, f"{t.__module__}:{cls}", names, values]
        raise StateError(f"cannot export a {t.__module__}.{t.__qualname__} (not a core class or plain data)")

    def field(self, cls: str, name: str, value: Any) -> Any:
        if (cls, name) in _NOT_STATE and not isinstance(value, (list, type(None))):
            return None
        return self.node(value)


class _Decoder:
    __slots__ = ("objs",)

    def __init__(self) -> None:
        self.objs: list[Any] = []

    def _keep(self, obj: Any) -> Any:
        self.objs.append(obj)
        return obj

    def node(self, x: Any) -> Any:
        if not isinstance(x, list):
            return x
        tag = x[0]
        if tag == "list":
            items = x[2]
            if list not in set(map(type, items)):
                return self._keep(items)
            out = self._keep([])
            out.extend(self.node(v) for v in items)
            return out
        if tag == "tuple":
            return tuple(self.node(v) for v in x[1])
        if tag == "ref":
            return self.objs[x[1]]
        if tag == "dict" or tag == "odict":
            d = self._keep({} if tag == "dict" else OrderedDict())
            keys, values = x[2], x[3]
            if list in set(map(type, keys)) or list in set(map(type, values)):
                keys, values = [self.node(k) for k in keys], [self.node(v) for v in values]
            d.update(zip(keys, values, strict=True))
            return d
        if tag == "set":
            s = self._keep(set())
            s.update(self.node(v) for v in x[2])
            return s
        if tag == "array":
            return array(x[1], x[2])
        if tag == "bytearray":
            return self._keep(bytearray(x[2]))
        if tag == "obj":
            obj = self._keep(_new_object(x[2]))
            for name, v in zip(x[3], x[4], strict=True):
                object.__setattr__(obj, name, self.node(v))
            _migrate(obj, set(x[3]))
            return obj
        raise StateError(f"unknown node tag {tag!r}")


def _null_ledger(obj: Any) -> Any:
    return NULL_LEDGER


# The migrations: class name -> (field, its value from the object as loaded) for fields that
# documents written before the field existed lack. Before Commit existed, the manager registered
# everything a sequence held, so all of it counts as committed.
_FIELD_DEFAULTS: dict[str, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    "SeqState": (
        ("num_committed", lambda s: s.num_tokens),
        ("pending_hashes", lambda s: []),
        ("tenant", lambda s: ""),
    ),
    "BlockManager": (
        ("ledger", _null_ledger),
        ("num_prefix_cache_resets", lambda m: 0),
        ("num_committed_blocks", lambda m: 0),
    ),
    "BlockPool": (("events", lambda p: None),),
}


def _migrate(obj: Any, present: set[str]) -> None:
    for name, default in _FIELD_DEFAULTS.get(type(obj).__qualname__, ()):
        if name not in present:
            object.__setattr__(obj, name, default(obj))


def _new_object(qualified: str) -> Any:
    module, _, name = qualified.partition(":")
    if not (module == _CORE_PACKAGE or module.startswith(_CORE_PACKAGE + ".")) or not name.isidentifier():
        raise StateError(f"the state names {qualified!r}, which is not a core class")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise StateError(f"the state names {qualified!r}, which this version does not have") from e
    if not isinstance(cls, type):
        raise StateError(f"the state names {qualified!r}, which is not a class")
    core_cls: Any = cls  # known only at run time: its own __new__, whatever its signature
    return core_cls.__new__(core_cls)
