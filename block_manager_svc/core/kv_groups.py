"""KV-cache groups: a model's layers split by attention type, one block table per group.

Every physical block of the pool holds the KV of the same number of layers; a model
declares its layers as groups of that size, each with its attention type
(:class:`KVGroup`): full attention, or a sliding window of W tokens (Gemma 3: 18
layers, 3 global and 15 with W=512, are 6 groups of 3 layers, group 0 full and
groups 1..5 windows). Each sequence holds one table per group, all indexed alike
(entry i covers tokens [i*B, (i+1)*B)).

A window group's table keeps only its live tail: the entries wholly before the
window of the next position to compute are released (to the evictable prefix
cache when committed, else to the free list). The next position to compute is the
sequence's committed count c (Commit: the KV of tokens [0, c) is written; every
later position is still to be computed, in this step or a later one), whose window
is [c - W + 1, c]. So block i is released once (i+1)*B <= c - W + 1, and a window
table is the entries [first_live(c), n) of the n the sequence's tokens fill: its
first live index is n - len(table), so the live tail alone is the table (what the
wire carries). It holds at most ceil(W/B) + 1 blocks beyond the tokens not yet
committed.

Group 0 is always a full-attention group: it carries the sequence's length in
blocks, and with one group (the default) everything is as it was before groups
existed. A model whose every layer is windowed is served as one full group.

Prefix caching: a block's chain hash names its tokens, the same for every group;
but a cached block holds one group's layers, so the index key is (group, hash):
:func:`group_key`. A hit of L blocks needs, in a full group, every block up to L;
in a window group only the blocks of the window before the hit point,
[first_live(L*B), L). The hit is the longest L that every group can serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MAX_KV_GROUPS = 256  # a group's index fits the one byte its prefix keys carry

KVGroupKind = Literal["full", "window"]


@dataclass(slots=True, frozen=True)
class KVGroup:
    """One group of layers: `kind` "full" (attends to every earlier token) or "window"
    (attends to the last `window_tokens` tokens, itself included)."""

    kind: KVGroupKind = "full"
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind == "full":
            if self.window_tokens:
                raise ValueError(f"a full-attention group has no window, got {self.window_tokens}")
        elif self.kind == "window":
            if self.window_tokens < 1:
                raise ValueError(f"a window group needs window_tokens >= 1, got {self.window_tokens}")
        else:
            raise ValueError(f"a KV group's kind is 'full' or 'window', got {self.kind!r}")

    @classmethod
    def full(cls) -> KVGroup:
        return cls("full", 0)

    @classmethod
    def window(cls, window_tokens: int) -> KVGroup:
        return cls("window", window_tokens)

    def first_live(self, next_pos: int, block_size: int) -> int:
        """The first block index position `next_pos` (and every later one) still reads."""
        w = self.window_tokens
        if not w:
            return 0
        return max(0, (next_pos - w + 1) // block_size)

    def max_live_blocks(self, block_size: int) -> int | None:
        """The most blocks a fully committed sequence keeps in this group (None: unbounded)."""
        w = self.window_tokens
        return None if not w else -(-w // block_size) + 1

    def spec(self) -> str:
        return "full" if self.kind == "full" else f"window:{self.window_tokens}"


FULL = KVGroup.full()
ONE_GROUP: tuple[KVGroup, ...] = (FULL,)


def check_kv_groups(groups: tuple[KVGroup, ...]) -> None:
    if not groups:
        raise ValueError("kv_groups must name at least one group")
    if len(groups) > MAX_KV_GROUPS:
        raise ValueError(f"at most {MAX_KV_GROUPS} KV groups, got {len(groups)}")
    if groups[0].kind != "full":
        raise ValueError("KV group 0 must be a full-attention group (it carries the sequence's length)")


def parse_kv_groups(spec: str) -> tuple[KVGroup, ...]:
    """Groups from their text form: comma-separated ``full`` or ``window:W``, each optionally
    repeated with ``xN``; e.g. Gemma 3 270M is ``full,window:512x5``. Empty: one full group."""
    spec = spec.strip()
    if not spec:
        return ONE_GROUP
    out: list[KVGroup] = []
    for item in spec.split(","):
        item = item.strip()
        body, times = item, 1
        if "x" in item:
            body, _, n = item.rpartition("x")
            try:
                times = int(n)
            except ValueError:
                raise ValueError(f"KV group {item!r}: the repeat after 'x' must be an integer") from None
            if times < 1:
                raise ValueError(f"KV group {item!r}: the repeat must be >= 1")
        if body == "full":
            group = FULL
        elif body.startswith("window:"):
            try:
                group = KVGroup.window(int(body.removeprefix("window:")))
            except ValueError as e:
                raise ValueError(f"KV group {item!r}: {e}") from None
        else:
            raise ValueError(f"KV group {item!r} is neither 'full' nor 'window:W'")
        out.extend([group] * times)
    groups = tuple(out)
    check_kv_groups(groups)
    return groups


def format_kv_groups(groups: tuple[KVGroup, ...]) -> str:
    """The text form :func:`parse_kv_groups` reads (runs of equal groups as ``xN``)."""
    parts: list[str] = []
    i = 0
    while i < len(groups):
        j = i
        while j < len(groups) and groups[j] == groups[i]:
            j += 1
        parts.append(groups[i].spec() + (f"x{j - i}" if j - i > 1 else ""))
        i = j
    return ",".join(parts)


def group_key(content_hash: bytes, group: int) -> bytes:
    """The prefix-index key of group `group`'s block holding `content_hash`'s tokens. Group 0's
    key is the hash itself (one group: the index, the events and the journal are as before)."""
    return content_hash if not group else content_hash + bytes((group,))


def split_key(key: bytes) -> tuple[bytes, int]:
    """(content hash, group) of a prefix-index key."""
    if len(key) > 16:
        return key[:16], key[16]
    return key, 0
