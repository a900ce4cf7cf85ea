"""vLLM's token-level sampling constraints, as one allowed-token mask per step: ``allowed_token_ids``
(only these ids), ``bad_words`` (a word's last token is masked out where the tokens before it were
just generated) and ``min_tokens`` (the stop ids are masked out until that many tokens exist).

They ride on the engine's grammar hook (``SamplingOptions.grammar``: ``matcher()`` per sample, whose
``mask()`` the worker applies before it chooses and whose ``accept(token)`` follows the choice), and
combine with a structured-output grammar when the request has one: the mask is the intersection.
A step never gets an empty mask (the worker refuses one): where the token constraints would leave
no token the grammar allows, the grammar's mask alone goes (the grammar decides what is valid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.frontend.serve.grammar import mask_bytes


def _words(vocab_size: int) -> int:
    return mask_bytes(vocab_size) // 4


def _mask_of(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A little-endian uint32 bitmask with ``ids`` set."""
    bits = np.zeros(_words(vocab_size) * 32, dtype=np.uint8)
    bits[np.asarray(list(ids), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view("<u4").copy()


@dataclass(frozen=True, slots=True, eq=False)
class TokenConstraints:
    """What a request's samples follow: a grammar (or None) and the token-level constraints."""

    vocab_size: int
    grammar: Any = None  # frontend/serve/grammar.py Grammar
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences; the last token is the banned one
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # masked out while fewer than min_tokens were generated

    @property
    def description(self) -> str:
        return self.grammar.description if self.grammar is not None else "token constraints"

    def matcher(self) -> ConstrainedMatcher:
        return ConstrainedMatcher(self)


class ConstrainedMatcher:
    """One sample's state: the grammar's matcher and the tokens generated so far."""

    __slots__ = ("_c", "_grammar", "_base", "_no_stop", "_generated")

    def __init__(self, constraints: TokenConstraints) -> None:
        c = constraints
        self._c = c
        self._grammar = c.grammar.matcher() if c.grammar is not None else None
        words = _words(c.vocab_size)
        if c.allowed_token_ids is not None:
            self._base = _mask_of(c.allowed_token_ids, c.vocab_size)
        else:
            full = np.full(words, 0xFFFFFFFF, dtype="<u4")
            tail = c.vocab_size % 32  # bits past the vocabulary stay clear
            if tail:
                full[-1] = (1 << tail) - 1
            self._base = full
        self._no_stop = ~_mask_of(c.stop_token_ids, c.vocab_size) if c.stop_token_ids else None
        self._generated: list[int] = []

    def mask(self) -> bytes:
        grammar = np.frombuffer(self._grammar.mask(), dtype="<u4") if self._grammar is not None else None
        mask = self._base if grammar is None else self._base & grammar
        if self._no_stop is not None and len(self._generated) < self._c.min_tokens:
            mask = mask & self._no_stop
        banned = self._banned()
        if banned:
            mask = mask & ~_mask_of(banned, self._c.vocab_size)
        if not mask.any():
            mask = grammar if grammar is not None else self._base
        return bytes(mask.astype("<u4").tobytes())

    def _banned(self) -> list[int]:
        """The last token of each bad word whose other tokens end what was generated."""
        out = []
        g = self._generated
        for word in self._c.bad_words:
            head = word[:-1]
            if len(head) <= len(g) and (not head or tuple(g[len(g) - len(head) :]) == head):
                out.append(word[-1])
        return out

    def accept(self, token_id: int) -> bool:
        if self._grammar is not None and not self._grammar.accept(token_id):
            return False
        self._generated.append(token_id)
        return True

    @property
    def terminated(self) -> bool:
        return self._grammar is not None and bool(self._grammar.terminated)
