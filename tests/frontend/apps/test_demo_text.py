"""`pagedkv demo --model` on a model with a tokenizer and chat template: chat prompts, the figures,
and real question/answer pairs. The model is the scripted tiny Llama with SmolLM2's tokenizer
(tests/frontend/real_tokenizer.py), whose answer to any chat prompt is CHAT_ANSWER."""

from __future__ import annotations

import re

import pytest

from pagedkv.frontend.apps import demo
from pagedkv.frontend.apps.demo_text import SHOWN_QUESTIONS, make_text_workload
from pagedkv.frontend.serve.text import load_model_text
from tests.frontend.real_tokenizer import CHAT_ANSWER, Script


def test_text_workload_is_chat_prompts_sharing_system_prompts(scripted_smollm2: Script) -> None:
    text = load_model_text(str(scripted_smollm2.path))
    reqs = make_text_workload(24, text, seed=0)
    tok = scripted_smollm2.tokenizer
    im_start = tok.convert_tokens_to_ids("<|im_start|>")  # type: ignore[attr-defined]
    systems = set()
    for r in reqs:
        rendered = tok.decode(r.prompt)  # type: ignore[attr-defined]
        assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
        assert r.prompt.count(im_start) == 3
        systems.add(rendered.split("<|im_start|>user")[0])
    # A few shared system prompts (what the prefix cache reuses), of very different lengths.
    assert 1 < len(systems) <= 4
    assert max(map(len, systems)) > 5 * min(map(len, systems))


def test_demo_with_a_real_tokenizer_prints_figures_and_answers(
    scripted_smollm2: Script, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    try:
        rc = demo.main(
            [
                "--model",
                str(scripted_smollm2.path),
                "--local",
                "--num-workers",
                "1",
                "--requests",
                "6",
                "--concurrency",
                "3",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
    finally:
        from pagedkv.logging_setup import configure_logging

        configure_logging("info", "console", cache=False)  # demo.main configured it for itself
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"requests\s+6\b", out) and "prefix-cache hit rate" in out
    for q in SHOWN_QUESTIONS:
        assert f"  Q: {q}\n  A: {CHAT_ANSWER}\n" in out, out
