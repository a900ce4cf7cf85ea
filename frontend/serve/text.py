"""Text for `pagedkv serve`: the model's tokenizer, its chat template and EOS ids.

Everything comes from the LOCAL path the workers load (``--model``), never from a hub. The tokenizer
is Hugging Face's ``tokenizers`` (frontend/serve/tokenizer.py), built from a directory's
``tokenizer.json`` or from a GGUF file's vocabulary metadata (frontend/serve/gguf_vocab.py), so the
server imports neither transformers nor torch; only a directory with no ``tokenizer.json`` (a slow
tokenizer's files alone) is read by transformers, offline. Without a tokenizer the server still
serves token-id prompts (text fields are empty); text prompts, stop strings and chat completions
then answer 400.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from pagedkv.frontend.serve.tokenizer import load_dir_tokenizer


class ContinuationError(ValueError):
    """continue_final_message: the rendered chat does not contain the final message's text."""


@dataclass(slots=True)
class ModelText:
    """What the server knows about a model directory beyond the workers' numbers."""

    tokenizer: Any | None = None  # tokenizer.TextTokenizer (or a transformers tokenizer)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0  # max_position_embeddings; 0 = unknown

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """The text of ``token_ids``; special tokens' text left out, or (``skip_special_tokens``
        false) kept, set apart from the text around them as the tokenizer's decoder does, or
        (``spaces_between_special_tokens`` false) joined to it with nothing between (vLLM's switch)."""
        tok = self.tokenizer
        if tok is None:
            return ""
        if skip_special_tokens or spaces_between_special_tokens:
            return str(tok.decode(token_ids, skip_special_tokens=skip_special_tokens))
        special = self.special_ids()
        out: list[str] = []
        run: list[int] = []
        for t in token_ids:
            if t in special:
                if run:
                    out.append(str(tok.decode(run, skip_special_tokens=False)))
                    run = []
                out.append(str(tok.decode([t], skip_special_tokens=False)))
            else:
                run.append(t)
        if run:
            out.append(str(tok.decode(run, skip_special_tokens=False)))
        return "".join(out)

    def special_ids(self) -> frozenset[int]:
        """The ids of the tokenizer's special tokens (added tokens marked special too)."""
        tok = self.tokenizer
        if tok is None:
            return frozenset()
        ids = {int(i) for i in tok.all_special_ids}
        ids |= {int(i) for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}
        return frozenset(ids)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """The messages (and ``tools``, for a template that renders them) through the chat template,
        tokenized (the template writes the special tokens; ``add_special_tokens`` adds the
        tokenizer's BOS/EOS around it too). ``continue_final_message``: the text ends with the final
        message's content (the template's end of that turn cut off), as transformers does it.
        ``template_kwargs``: more variables for the template."""
        assert self.tokenizer is not None
        extra: dict[str, Any] = dict(template_kwargs)
        if documents is not None:
            extra["documents"] = documents
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools, **extra
        )
        if continue_final_message:
            text = _continued(str(text), str(messages[-1].get("content") or ""))
        return [int(t) for t in self.tokenizer.encode(str(text), add_special_tokens=add_special_tokens)]


def _continued(rendered: str, final: str) -> str:
    """``rendered`` cut right after the final message's content (its last occurrence)."""
    if not final.strip() or final.strip() not in rendered:
        raise ContinuationError("the chat template's rendering does not contain the final message's text")
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final.lstrip():
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def _eos_from(path: pathlib.Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        eos = json.loads(f.read_text()).get("eos_token_id")
        if eos is None:
            continue
        return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def load_model_text(model_dir: str | None) -> ModelText:
    """Tokenizer (if the directory has one), EOS ids and context length of ``model_dir``."""
    if not model_dir:
        return ModelText()
    path = pathlib.Path(model_dir)
    if path.is_file():
        return _gguf_model_text(model_dir)
    if not path.is_dir():
        raise ValueError(f"--model {model_dir!r}: no such directory or GGUF file")
    max_len = 0
    cfg = path / "config.json"
    if cfg.is_file():
        max_len = int(json.loads(cfg.read_text()).get("max_position_embeddings") or 0)
    eos = _eos_from(path)
    tokenizer = load_dir_tokenizer(path)
    if tokenizer is not None:
        eos = stop_ids_of(tokenizer, eos)
    return ModelText(tokenizer=tokenizer, eos_token_ids=eos, max_model_len=max_len)


def _gguf_model_text(model_file: str) -> ModelText:
    """A GGUF file's tokenizer, EOS id and context length, from its metadata (ValueError for a file
    that is not GGUF)."""
    from pagedkv.frontend.serve.gguf_vocab import load_gguf_text

    gguf = load_gguf_text(model_file)
    eos: tuple[int, ...] = (gguf.eos_token_id,) if gguf.eos_token_id is not None else ()
    if gguf.tokenizer is not None:
        eos = stop_ids_of(gguf.tokenizer, eos)
    return ModelText(tokenizer=gguf.tokenizer, eos_token_ids=eos, max_model_len=gguf.context_length)


_TURN_MARK = "pagedkv-end-of-turn-probe"


def stop_ids_of(tokenizer: Any, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a sample: the config's EOS, the tokenizer's, and the special token the chat
    template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>), which a base
    model's config often does not name. Config order first, no duplicates."""
    ids = list(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids.extend(_template_turn_end(tokenizer))
    return tuple(dict.fromkeys(ids))


def _template_turn_end(tokenizer: Any) -> tuple[int, ...]:
    """The first special token after an assistant message in the chat template's rendering, if any."""
    if not getattr(tokenizer, "chat_template", None):
        return ()
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN_MARK}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that needs other roles or fields: nothing learned
        return ()
    at = rendered.rfind(_TURN_MARK)
    if at < 0:
        return ()
    special = {int(i) for i in tokenizer.all_special_ids}
    special |= {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    after = tokenizer.encode(rendered[at + len(_TURN_MARK) :], add_special_tokens=False)
    for t in after[:4]:  # the turn's end comes right after the content (maybe after a space)
        if int(t) in special:
            return (int(t),)
    return ()
