"""Grammars against SmolLM2's real vocabulary (frontend/serve/grammar.py, structured_output.py):
the allowed-token masks let a valid answer through token by token, refuse a wrong token, allow only
the end of turn once complete; requests name the field that is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedkv.frontend.serve.grammar import GrammarCompiler, GrammarError, Matcher, mask_bytes
from pagedkv.frontend.serve.structured_output import ResponseFormat, StructuredOutputError, requested_grammar

pytest.importorskip("xgrammar")
EOS = 2  # <|im_end|>
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "role", "age", "tags", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, 49152, (EOS,))


def allowed(m: Matcher) -> set[int]:
    mask = m.mask()
    assert len(mask) == mask_bytes(49152) == 6144
    return {i * 8 + b for i, byte in enumerate(mask) for b in range(8) if byte >> b & 1}


def walk(m: Matcher, tok: Any, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        assert t in allowed(m), (text, tok.decode([t]))
        assert m.accept(t)


def test_a_valid_document_passes_token_by_token_then_only_the_end_of_turn(
    compiler: GrammarCompiler, smollm2_tokenizer: Any
) -> None:
    m = compiler.json_schema(SCHEMA).matcher()
    walk(
        m,
        smollm2_tokenizer,
        '{"name": "Ada", "role": "admin", "age": 36, "tags": ["x"], "home": {"city": "Paris"}}',
    )
    assert allowed(m) == {EOS} and not m.terminated
    assert m.accept(EOS) and m.terminated


@pytest.mark.parametrize(
    ("prefix", "wrong"),
    [
        ('{"name": "Ada", "role": "', "guest"),  # not in the enum
        ('{"name": "Ada", "role": "user", "age": ', "-"),  # below the minimum
        ('{"name": "Ada", "role": "user", "age": 12', "1"),  # 121 is above the maximum
        ("", "Sure"),  # prose instead of JSON
        ('{"name": "Ada"', "}"),  # a required property missing
    ],
)
def test_a_token_the_schema_forbids_is_masked_out_and_refused(
    compiler: GrammarCompiler, smollm2_tokenizer: Any, prefix: str, wrong: str
) -> None:
    m = compiler.json_schema(SCHEMA).matcher()
    walk(m, smollm2_tokenizer, prefix)
    t = smollm2_tokenizer.encode(wrong, add_special_tokens=False)[0]
    assert t not in allowed(m)
    assert not m.accept(t)


def test_choice_regex_and_any_json_object(compiler: GrammarCompiler, smollm2_tokenizer: Any) -> None:
    choices = ['say "hi"', "é\nnext"]
    for c in choices:
        m = compiler.choice(choices).matcher()
        walk(m, smollm2_tokenizer, c)
        assert allowed(m) == {EOS}
    m = compiler.regex(r"[0-9]{3}-[a-z]+").matcher()
    walk(m, smollm2_tokenizer, "123-abc")
    digit = smollm2_tokenizer.encode("7", add_special_tokens=False)[0]
    assert digit not in allowed(m)  # letters only now
    m = compiler.json_object().matcher()
    walk(m, smollm2_tokenizer, '{"any": [1, {"nested": true}]}')
    assert EOS in allowed(m)


def test_requested_grammar_reads_each_field_and_names_the_bad_one(compiler: GrammarCompiler) -> None:
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    )
    assert requested_grammar(compiler, fmt, None, None, None).description == "json_schema"  # type: ignore[union-attr]
    assert requested_grammar(compiler, ResponseFormat(type="text"), None, None, None) is None
    assert requested_grammar(compiler, None, json.dumps(SCHEMA), None, None).description == "json_schema"  # type: ignore[union-attr]
    for args, param in (
        ((fmt, None, "[0-9]", None), "response_format"),  # two at once
        ((None, "{not json", None, None), "guided_json"),
        ((None, None, "([a-z", None), "guided_regex"),
        ((None, None, None, []), "guided_choice"),
        ((None, {"type": "object", "properties": {"a": {"type": "nonsense"}}}, None, None), "guided_json"),
        ((ResponseFormat(type="json_schema"), None, None, None), "response_format.json_schema"),
    ):
        with pytest.raises(StructuredOutputError) as e:
            requested_grammar(compiler, *args)
        assert e.value.param == param, (args, e.value)
    with pytest.raises(StructuredOutputError, match="needs a tokenizer"):
        requested_grammar(None, None, None, "[0-9]", None)
    with pytest.raises(GrammarError):
        compiler.regex("([a-z")
