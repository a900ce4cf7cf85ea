"""A GGUF file's tokenizer, built with Hugging Face's ``tokenizers`` from the file's own metadata.

Why here and not through the worker's reader (worker_svc/model/gguf_file.py): that module imports
torch, and transformers' GGUF tokenizer conversion imports torch too; `pagedkv serve` only needs the
vocabulary, a few ids and the context length, and stays a small process without either.

Why not ``gguf.GGUFReader``: it maps the whole file and builds a numpy view for every part of every
metadata array, which is slow on a 49k-token vocabulary; this reads the metadata block alone with
``struct`` (tensor data is never touched).

What the file says (llama.cpp's key names):
- ``tokenizer.ggml.model``: ``gpt2`` is a byte-level BPE (tokens spelled in GPT-2's byte alphabet,
  ``tokenizer.ggml.merges``, text split by the regular expression ``tokenizer.ggml.pre`` names);
  ``llama`` is SentencePiece (tokens with ``▁`` for a space, ``tokenizer.ggml.scores`` ranking the
  merges, ``<0xNN>`` byte-fallback tokens, a space put before the text unless
  ``tokenizer.ggml.add_space_prefix`` is false).
- ``tokenizer.ggml.token_type``: control tokens (``<|im_end|>``, ``<s>``) become special added
  tokens, user-defined ones plain added tokens: both are matched whole in text.
- ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``, ``tokenizer.ggml.add_{bos,eos}_token``,
  ``tokenizer.chat_template``.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from pagedkv.frontend.serve.tokenizer import TextTokenizer, byte_level_chars

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_log = structlog.get_logger("pagedkv.serve")

GGUF_MAGIC = b"GGUF"

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GGUF metadata value types: the struct format of each scalar; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# Pre-tokenizer regular expressions (how text is cut before BPE runs, as the vocabulary was
# trained), by ``tokenizer.ggml.pre``. GPT-2's own is the ByteLevel pre-tokenizer's built-in one.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
}
# Pre-tokenizers that cut every digit alone and then apply GPT-2's expression (SmolLM's own
# tokenizer.json does; so does llama.cpp for these names).
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")


def read_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file (versions 2 and 3, little-endian), arrays included as lists;
    the tensor directory and data are not read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF file {path} has version {version}; supported: 2, 3 (little-endian)")
        _, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        unpack = struct.unpack_from

        def string() -> str:
            nonlocal pos
            (n,) = unpack("<Q", buf, pos)
            pos += 8 + n
            return buf[pos - n : pos].decode("utf-8", errors="replace")

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == _STRING:
                return string()
            if vtype in _SCALARS:
                fmt = "<" + _SCALARS[vtype]
                (v,) = unpack(fmt, buf, pos)
                pos += struct.calcsize(fmt)
                return v
            if vtype == _ARRAY:
                itype, count = unpack("<IQ", buf, pos)
                pos += 12
                if itype in _SCALARS:  # one unpack for the whole array
                    fmt = f"<{count}{_SCALARS[itype]}"
                    out = list(unpack(fmt, buf, pos))
                    pos += struct.calcsize(fmt)
                    return out
                return [value(itype) for _ in range(count)]
            raise ValueError(f"GGUF file {path}: unknown metadata value type {vtype} at byte {pos}")

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = unpack("<I", buf, pos)
            pos += 4
            meta[key] = value(vtype)
    return meta


@dataclass(frozen=True, slots=True)
class GgufText:
    """What the front door takes from a GGUF file: its tokenizer (None when the file names none),
    the EOS id and the context length (``{arch}.context_length``; the worker's default when absent)."""

    tokenizer: TextTokenizer | None
    eos_token_id: int | None
    context_length: int


def load_gguf_text(path: str | pathlib.Path) -> GgufText:
    """Read ``path``'s metadata and build its tokenizer (ValueError for a file that is not GGUF or a
    tokenizer kind this module does not build)."""
    meta = read_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokenizer = build_tokenizer(meta, name_or_path=str(path)) if "tokenizer.ggml.tokens" in meta else None
    return GgufText(
        tokenizer=tokenizer,
        eos_token_id=int(eos) if eos is not None else None,
        context_length=int(meta.get(f"{arch}.context_length", 4096)),
    )


def build_tokenizer(meta: dict[str, Any], name_or_path: str = "") -> TextTokenizer:
    """The tokenizer that GGUF metadata ``meta`` describes."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, types)
        vocab_type, add_prefix_space, add_bos_default = "byte_level", False, False
    elif kind == "llama":
        add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        if str(meta.get("general.architecture", "")).startswith("gemma"):
            tokens, types = gemma_spelling(tokens, types)
        backend = _sentencepiece_bpe(meta, tokens, types, add_prefix_space)
        # llama.cpp puts BOS before a SentencePiece vocabulary's text unless the file says not to.
        vocab_type, add_bos_default = "byte_fallback", True
    else:
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r}: pagedkv serve builds 'gpt2' (byte-level BPE) and "
            "'llama' (SentencePiece) tokenizers"
        )

    def named(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    keys = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    _add_special_tokens(backend, tokens, types, {t for k in keys if (t := named(k)) is not None})
    return TextTokenizer.build(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        vocab_type=vocab_type,
        add_prefix_space=add_prefix_space,
        name_or_path=name_or_path,
    )


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    """GPT-2-style BPE: every byte is one of 256 printable characters; merges as the file lists them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_level_chars()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == NORMAL and not set(tok) <= spelled:
            # A normal token in its plain text: the BPE model matches byte-alphabet spellings.
            tok = "".join(alphabet[b] for b in tok.encode())
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    backend = Tokenizer(
        models.BPE(
            vocab,
            merges,
            # Llama 3's vocabulary takes a whole word that is a token as is (llama.cpp does too).
            ignore_merges=SPLIT_REGEX.get(pre) is _LLAMA3,
        )
    )
    if pre in SPLIT_REGEX:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:  # GPT-2's expression: "default", "gpt2", and what this module has no expression for
        if pre not in ("default", "gpt2"):
            _log.warning("gguf_pre_tokenizer_unknown", pre=pre, using="gpt2")
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    meta: dict[str, Any], tokens: list[str], types: list[int], add_prefix_space: bool
) -> Tokenizer:
    """SentencePiece's BPE as a merge list: the pair that makes the better-scored piece merges first;
    characters outside the vocabulary fall back to ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if str(meta.get("general.architecture", "")).startswith("gemma"):
        merges = gemma_merges(tokens, vocab)
    else:
        merges = _merges_by_score(tokens, types, scores, vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def gemma_spelling(tokens: list[str], types: list[int]) -> tuple[list[str], list[int]]:
    """Gemma's vocabulary as its tokenizer spells it: a GGUF file stores the runs of spaces (2 to 31)
    as user-defined tokens of real spaces, which Gemma's tokenizer holds as ``"▁▁"``... pieces built
    by merges, so a long run splits as merges build it rather than greedily into the longest stored
    run. transformers reads the file the same way: the front door's ids are the oracle's."""
    tokens, types = list(tokens), list(types)
    for i, tok in enumerate(tokens):
        if " " in tok and not tok.strip():
            tokens[i], types[i] = "▁" * len(tok), NORMAL
    return tokens, types


def gemma_merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Gemma's merges: every split of every piece into two pieces of the vocabulary, in the file's
    token order (Gemma's scores do not follow its merge order; its token order does), a piece's
    splits longest left part first (transformers builds the same list for a GGUF file)."""
    merges = []
    for tok in tokens:
        for cut in range(len(tok) - 1, 0, -1):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _merges_by_score(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    # Merges: each normal piece from each split into two pieces of the vocabulary, best piece first
    # (ties: the earlier piece); control, byte and unknown tokens are never built by merging.
    mergeable = {t for t, k in zip(tokens, types, strict=True) if k == NORMAL}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != NORMAL or len(tok) < 2 or vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[i]), i, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int], named: set[str]) -> None:
    """Control tokens and the named ones (BOS, EOS, UNK, PAD) as special added tokens, user-defined
    tokens as plain added tokens: each is then matched whole in text instead of being cut into
    pieces, and keeps its id (its text is already in the vocabulary)."""
    from tokenizers import AddedToken

    added = []
    for tok, kind in zip(tokens, types, strict=True):
        if kind in (CONTROL, USER_DEFINED) or tok in named:
            added.append(AddedToken(tok, special=kind != USER_DEFINED, normalized=False))
    if added:
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])
