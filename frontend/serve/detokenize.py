"""Incremental detokenization for `pagedkv serve`: the text of one sample as its tokens arrive.

A byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) splits a multi-byte character (an emoji, CJK, an
accented letter) across tokens, so the text of the tokens so far can end in half a character, which
a tokenizer decodes as U+FFFD. Stop strings can straddle tokens too. Both are handled here, once,
for the streamed and the non-streamed answer alike, so that the concatenated stream deltas are the
non-streamed text by construction:

- Tokens are decoded through a small moving window (the last committed chunk as context plus the
  tokens not yet turned into text), not the whole output each time: text is committed only when the
  window's decoding grows and does not end in U+FFFD. The context token makes a tokenizer's
  word-start handling (SentencePiece's leading space) come out as in a full decode. Decoding work per
  token stays constant however long the output grows.
- Stop strings are searched in the committed text only where a new match can be (the new text and
  the longest stop string's length before it), once ``min_tokens`` tokens exist. A match cuts the
  text before the stop string (after it with ``include_stop_str_in_output``).
- A stream releases committed text except its longest ending that could still begin a stop string:
  nothing is ever sent and then taken back. At the end (length, EOS, abort), everything is released,
  including bytes a model left unfinished (as U+FFFD, which is what a full decode gives as well).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from pagedkv.frontend.serve.text import ModelText
from pagedkv.frontend.serve.tokenizer import byte_level_chars

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Text of one sample. ``add`` each token, ``finish`` once at its end, ``delta`` to stream."""

    def __init__(
        self,
        text: ModelText,
        stop: tuple[str, ...],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._text = text
        self._stop = stop
        self._skip_special = skip_special_tokens
        self._spaces_between = spaces_between_special_tokens
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are text already, kept out of decoding
        self._read = 0  # tokens before it are committed text (those from _prefix are the context)
        self.full = ""  # committed text (cut before a stop string once one matched)
        self.sent = 0  # characters of ``full`` already released by ``delta``
        self.stopped = False  # a stop string matched
        self.finished = False

    def add(self, token: int) -> None:
        """One more generated token; commits the text it completes."""
        if self.stopped or self.finished:
            return
        self.tokens.append(token)
        if self._text.tokenizer is not None:
            self._commit(final=False)

    def finish(self) -> None:
        """The sample ended: commit what is left, even an unfinished character (as U+FFFD)."""
        if not self.finished and not self.stopped and self._text.tokenizer is not None:
            self._commit(final=True)
        self.finished = True

    def delta(self, final: bool = False) -> str:
        """New text that can be sent now: everything committed once the sample ended (``final``, or
        a stop string matched), else all but an ending that may still become a stop string."""
        if final:
            self.finish()
        end = len(self.full)
        if not (self.finished or self.stopped):
            end -= self._stop_prefix_len()
        if end <= self.sent:
            return ""
        out = self.full[self.sent : end]
        self.sent = end
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._text.decode(ids, self._skip_special, self._spaces_between)

    def _commit(self, final: bool) -> None:
        decode = self._decode
        before = decode(self.tokens[self._prefix : self._read])
        window = decode(self.tokens[self._prefix :])
        if not final and (len(window) <= len(before) or window.endswith(REPLACEMENT)):
            return  # no new text yet, or it ends in half a character: wait for the next token
        new = window[len(before) :]
        self._prefix, self._read = self._read, len(self.tokens)
        if not new:
            return
        old_len = len(self.full)
        self.full += new
        if self._stop and len(self.tokens) >= self._min_tokens:
            self._cut_at_stop(max(0, old_len - self._longest_stop + 1))

    def _cut_at_stop(self, start: int) -> None:
        hits = [(i, len(s)) for i, s in ((self.full.find(s, start), s) for s in self._stop) if i >= 0]
        if hits:
            at, length = min(hits)
            self.full = self.full[: at + length] if self._include_stop else self.full[:at]
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Length of the longest ending of ``full`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.full)), best, -1):
                if self.full.endswith(s[:k]):
                    best = k
                    break
        return best


# --- the bytes of one token (OpenAI's logprobs `bytes`) ---------------------------------------------
@functools.cache
def _char_bytes() -> dict[str, int]:
    return {c: b for b, c in byte_level_chars().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The UTF-8 bytes ``token_id`` stands for. A token that holds part of a character decodes alone
    to U+FFFD; its real bytes come from the vocabulary entry (byte-level BPE, or SentencePiece's
    ``<0xNN>`` byte fallback), so that a client can join the bytes of consecutive tokens."""
    text = str(tokenizer.decode([token_id]))
    if REPLACEMENT not in text:
        return list(text.encode())
    piece = str(tokenizer.convert_ids_to_tokens(token_id))
    fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    if fallback:
        return [int(fallback.group(1), 16)]
    chars = _char_bytes()
    if _is_byte_level(tokenizer) and all(c in chars for c in piece):
        return [chars[c] for c in piece]
    return list(text.encode())
