"""The front door's tokenizer: Hugging Face's Rust ``tokenizers`` plus what transformers' tokenizer
object adds around it (special tokens, BOS/EOS placement, the chat template), without transformers.

Why: transformers imports torch, which makes `pagedkv serve` (a process that runs no model) several
times larger and slower to start. ``TextTokenizer`` offers the part of transformers' tokenizer
interface the frontend uses (``encode``, ``decode``, ``apply_chat_template``, ``chat_template``,
``eos_token_id``, ``all_special_ids``, ``added_tokens_decoder``, ``convert_ids_to_tokens``,
``get_vocab``, ``backend_tokenizer``), so the rest of the frontend takes either.

Where one comes from:
- a GGUF file: its vocabulary metadata (frontend/serve/gguf_vocab.py);
- a Hugging Face directory with ``tokenizer.json``: that file (which also places BOS/EOS), with
  ``tokenizer_config.json`` (special tokens, the chat template, which may also be in
  ``chat_template.jinja`` or ``chat_template.json``) and ``special_tokens_map.json``;
- a directory with only a slow tokenizer's files (``tokenizer.model``, ``vocab.json``): transformers,
  imported there and only there (``load_dir_tokenizer``).

``tokenizers`` and jinja2 are imported when a tokenizer is built or a template rendered, so the
frontend's modules import without them.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pagedkv.frontend.serve.chat_template import render_chat

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer

# How the vocabulary spells bytes (xgrammar's TokenizerInfo needs it to match text against tokens):
# GPT-2's 256-character byte alphabet, SentencePiece's <0xNN> byte fallback, or plain text.
VocabType = Literal["byte_level", "byte_fallback", "raw"]

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(eq=False)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` and the special tokens and chat template of its model.

    BOS/EOS placement lives in the backend's post-processor (``encode(add_special_tokens=True)``);
    ``chat_template`` may be replaced (tests, a server that overrides it)."""

    backend_tokenizer: Tokenizer
    chat_template: str | dict[str, str] | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    extra_special_tokens: tuple[str, ...] = ()
    vocab_type: VocabType = "raw"
    add_prefix_space: bool = False  # SentencePiece's "▁" before the text: xgrammar needs to know
    clean_up_tokenization_spaces: bool = False  # transformers' " ." -> "." clean-up (not for BPE)
    name_or_path: str = ""

    @classmethod
    def build(
        cls, backend: Tokenizer, *, add_bos_token: bool, add_eos_token: bool, **fields: Any
    ) -> TextTokenizer:
        """A tokenizer whose ``encode(add_special_tokens=True)`` puts BOS before and EOS after the
        text as ``add_bos_token``/``add_eos_token`` say (for a backend that has no placement of its
        own, like one built from a GGUF file)."""
        tok = cls(backend, **fields)
        tok._place_bos_eos(add_bos_token, add_eos_token)
        return tok

    def _place_bos_eos(self, add_bos: bool, add_eos: bool) -> None:
        from tokenizers import processors

        bos = self.bos_token if add_bos and self.bos_token_id is not None else None
        eos = self.eos_token if add_eos and self.eos_token_id is not None else None
        single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
        pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
        special = [(t, self.token_id(t)) for t in (bos, eos) if t]
        self.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(special))
        )

    # --- encoding and decoding ----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS/EOS where it takes them."""
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (special tokens' text included unless ``skip_special_tokens``)."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        if self.clean_up_tokenization_spaces and not self._is_bpe():
            text = _clean_up_spaces(text)
        return text

    def _is_bpe(self) -> bool:
        return type(self.backend_tokenizer.model).__name__ == "BPE"

    def convert_ids_to_tokens(self, ids: int | list[int]) -> Any:
        """The vocabulary entry of each id (its byte-alphabet or ``▁`` spelling), one or a list."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        """The id of each vocabulary entry (the unknown token's id for an entry not in it)."""
        if isinstance(tokens, str):
            return self._id_or_unk(tokens)
        return [self._id_or_unk(t) for t in tokens]

    def _id_or_unk(self, token: str) -> int | None:
        i = self.token_id(token)
        return i if i is not None else self.unk_token_id

    def token_id(self, token: str | None) -> int | None:
        """The id of ``token`` (None for None or a token not in the vocabulary)."""
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    # --- vocabulary and special tokens --------------------------------------------------------
    def get_vocab(self) -> dict[str, int]:
        """Every vocabulary entry (added tokens included) and its id."""
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary (added tokens not counted, as in transformers)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """Added tokens by id, each with ``.content`` and ``.special``."""
        return dict(self.backend_tokenizer.get_added_tokens_decoder())

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens (BOS, EOS, UNK, PAD) and the extra ones, each once."""
        named = (getattr(self, n) for n in SPECIAL_NAMES)
        return list(dict.fromkeys(t for t in (*named, *self.extra_special_tokens) if t is not None))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in map(self.token_id, self.all_special_tokens) if i is not None]

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens' text, by name: what chat templates read (``bos_token``...)."""
        return {n: t for n in SPECIAL_NAMES if (t := getattr(self, n)) is not None}

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self.token_id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.pad_token)

    # --- chat ---------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The conversation through the chat template: its text, or with ``tokenize`` its token ids
        (the template writes the special tokens itself, so none are added). Other keyword
        arguments reach the template as variables, as do the special tokens' text."""
        template = chat_template or self._template(tools)
        if not template:
            raise ValueError("this tokenizer has no chat template")
        rendered = render_chat(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def _template(self, tools: list[dict[str, Any]] | None) -> str | None:
        """The template to render: a model with named templates uses ``tool_use`` when given tools
        (if it has one) and ``default`` otherwise."""
        if isinstance(self.chat_template, dict):
            if tools and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            return self.chat_template.get("default")
        return self.chat_template


def _clean_up_spaces(text: str) -> str:
    """Spaces a word-piece tokenizer's decoding leaves before punctuation and contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


# --- a Hugging Face directory -------------------------------------------------------------------
def load_dir_tokenizer(path: pathlib.Path) -> Any | None:
    """The tokenizer of model directory ``path``: a ``TextTokenizer`` when it has ``tokenizer.json``;
    transformers' (offline) when it has only a slow tokenizer's files; None when it has none."""
    if (path / "tokenizer.json").is_file():
        return from_tokenizer_json(path)
    if not any((path / n).is_file() for n in TOKENIZER_FILES):
        return None
    from pagedkv import envs

    envs.set_default("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(
            f"{path} has a tokenizer but no tokenizer.json, and reading it needs transformers, which "
            "is not installed (pip install 'pagedkv[text]')"
        ) from e
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def from_tokenizer_json(path: pathlib.Path) -> TextTokenizer:
    """``path``'s ``tokenizer.json`` with the special tokens, BOS/EOS placement and chat template of
    its ``tokenizer_config.json`` (and ``special_tokens_map.json``, ``chat_template.jinja``)."""
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = _json(path / "tokenizer_config.json")
    for key, value in _json(path / "special_tokens_map.json").items():
        cfg.setdefault(key, value)
    # Added tokens the config knows and tokenizer.json does not (older saves).
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for entry in (cfg.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and entry.get("content") and entry["content"] not in present:
            backend.add_tokens([_added_token(AddedToken, entry)])
    named = {n: _token_text(cfg.get(n)) for n in SPECIAL_NAMES}
    extra_raw = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    extra_list = list(extra_raw.values()) if isinstance(extra_raw, dict) else list(extra_raw)
    extra = tuple(t for t in (_token_text(e) for e in extra_list) if t)
    # Named and extra special tokens the backend does not have as added tokens are added as special
    # (a token already in the vocabulary keeps its id).
    missing = [t for t in (*named.values(), *extra) if t and t not in present]
    if missing:
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)]
        )
    vocab_type, add_prefix_space = _vocab_kind(backend)
    # BOS/EOS placement is tokenizer.json's post-processor alone: transformers 5 drops the config's
    # add_bos_token / add_eos_token when there is a tokenizer.json.
    return TextTokenizer(
        backend,
        chat_template=_chat_template(path, cfg),
        bos_token=named["bos_token"],
        eos_token=named["eos_token"],
        unk_token=named["unk_token"],
        pad_token=named["pad_token"],
        extra_special_tokens=extra,
        vocab_type=vocab_type,
        add_prefix_space=add_prefix_space,
        clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
        name_or_path=str(path),
    )


def _json(path: pathlib.Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: a string, or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_token(cls: type[AddedToken], entry: dict[str, Any]) -> AddedToken:
    return cls(
        entry["content"],
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", not entry.get("special", False))),
        special=bool(entry.get("special", False)),
    )


def _chat_template(path: pathlib.Path, cfg: dict[str, Any]) -> str | dict[str, str] | None:
    """``chat_template.jinja`` if present, else ``chat_template.json``'s, else the config's (a string,
    or a list of named templates)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _json(path / "chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(template, list):
        return {str(t["name"]): str(t["template"]) for t in template if isinstance(t, dict)}
    return template if isinstance(template, str) else None


def _vocab_kind(backend: Tokenizer) -> tuple[VocabType, bool]:
    """How ``backend``'s vocabulary spells bytes, and whether it puts a space before the text, from
    its decoder, model, normalizer and pre-tokenizer settings."""
    spec = json.loads(backend.to_str())
    decoder = list(_parts(spec.get("decoder")))
    before = [*_parts(spec.get("normalizer")), *_parts(spec.get("pre_tokenizer"))]
    if any(d.get("type") == "ByteLevel" for d in decoder):
        prefix = any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in before)
        return "byte_level", prefix
    prefix = any(
        (
            p.get("type") == "Metaspace"
            and p.get("prepend_scheme", "always" if p.get("add_prefix_space") else "never")
            in ("first", "always")
        )
        or (p.get("type") == "Prepend" and p.get("prepend") == "\u2581")
        for p in before
    )
    if (spec.get("model") or {}).get("byte_fallback") or any(
        d.get("type") == "ByteFallback" for d in decoder
    ):
        return "byte_fallback", prefix
    return "raw", prefix


def _parts(node: Any) -> Iterator[dict[str, Any]]:
    """Every component of a tokenizer.json section (a Sequence's steps included)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _parts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _parts(value)


@functools.cache
def byte_level_chars() -> dict[int, str]:
    """Byte value -> the character a GPT-2-style byte-level BPE writes it as in its vocabulary:
    printable Latin-1 bytes stand for themselves, the others move, in order, to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    moved = (b for b in range(256) if b not in out)
    out.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return out
