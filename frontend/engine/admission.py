"""Which waiting requests may join this iteration: hold one back while another computes its prefix.

A prefix-cache hit is a *committed* block (docs/prefix_cache.md): KV that a worker step wrote and
the engine reported. Two requests with the same new prefix admitted in the same iteration would
both miss and both compute it, so a burst of requests that share a system prompt (the usual
shape of chat traffic, and every benchmark's) would get no sharing at all. Instead, a waiting
request is held back while a sequence of this engine that is running (or admitted in this same
Step) still has to compute part of the prefix they share: it joins the iteration after that part
is committed and hits it instead of computing it again. Holding never loses work: the held
request would otherwise spend the same tokens of the same iteration budget on the same prefix.

A request is held only when waiting gains hits: if what the other sequences have already
computed covers the whole shared prefix, it is admitted now. The engine also counts the last
`max_num_seqs` finished sequences as writers of what they committed: a hint, trusted only while
the manager's `prefix_cache_drops` counter (in every Step reply) has not moved since the sequence
finished, since an eviction or a ResetPrefixCache may have dropped those blocks; an idle engine
reads the counter afresh before it trusts a hint. (Trusting a stale hint admitted a whole burst
at once, and every request computed the prefix again.) Held requests do not block the queue:
requests behind them with other prefixes are admitted in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def shared_full_blocks(a: Sequence[int], b: Sequence[int], block_size: int, limit: int) -> int:
    """Leading full blocks (at most `limit`) whose tokens `a` and `b` have in common."""
    n = 0
    while n < limit:
        lo, hi = n * block_size, (n + 1) * block_size
        if hi > len(b) or a[lo:hi] != b[lo:hi]:
            break
        n += 1
    return n


@dataclass(slots=True)
class _Writer:
    tokens: Sequence[int]
    computed_blocks: int  # full blocks whose KV is computed (committed in this Step at the latest)


@dataclass(slots=True)
class PrefixProgress:
    """This engine's sequences that hold blocks (or are being admitted), keyed by their first
    block's tokens, with how many full blocks each has computed."""

    block_size: int
    _by_first_block: dict[tuple[int, ...], list[_Writer]] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], num_computed: int) -> None:
        bs = self.block_size
        if len(tokens) < bs:
            return
        key = tuple(tokens[:bs])
        self._by_first_block.setdefault(key, []).append(_Writer(tokens, num_computed // bs))

    def should_hold(self, prompt: Sequence[int]) -> bool:
        """True when a sequence still computing part of `prompt`'s prefix would give it more
        hits than it can get now. Hits never cover the prompt's last token (it must be computed
        for its logits), so only the full blocks before it count."""
        bs = self.block_size
        limit = (len(prompt) - 1) // bs
        if limit == 0:
            return False
        writers = self._by_first_block.get(tuple(prompt[:bs]))
        if not writers:
            return False
        ready = pending = 0
        for w in writers:
            shared = shared_full_blocks(prompt, w.tokens, bs, limit)
            ready = max(ready, min(shared, w.computed_blocks))
            if w.computed_blocks < shared:
                pending = max(pending, shared)
        return pending > ready
