"""Every supported architecture, from a Hugging Face directory and from a GGUF file, through the
whole local stack: greedy tokens equal transformers' generate() token for token.

Each family's tiny random model (tests/worker_svc/families.py) runs one workload with a shared
system prompt (prefix-cache hits), an ``n = 2`` request (fork + copy-on-write) and a pool too small
for it (forced preemption), on the cache host's shared weights and worker processes. The GGUF
files are written with the gguf package's writer the way llama.cpp writes them (names, Q/K row
permutation, rope_freqs); F32 must give exactly the Hugging Face model's tokens. F16 and Q8_0 files
run in-process (tests/worker_svc/model/test_gguf.py) against an oracle holding the dequantized weights.
"""

from __future__ import annotations

import pathlib
import random

import pytest

from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.families import FAMILIES, build, write_gguf

pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[HFModel, pathlib.Path]:
    """The family's model (a Hugging Face directory and its oracle) and its F32 GGUF file."""
    arch = str(request.param)
    hf = build(arch, tmp_path_factory.mktemp(arch), seed=5)
    gguf_path = tmp_path_factory.mktemp(arch + "-gguf") / f"{arch}.F32.gguf"
    write_gguf(hf, gguf_path, "F32")
    return hf, gguf_path


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 120) for _ in range(11)]  # shared prefix, not block aligned
    return [system + [rng.randrange(1, 120) for _ in range(rng.randint(1, 9))] for _ in range(count)]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_shared_prefixes_two_samples_and_preemption_match_transformers(
    family: tuple[HFModel, pathlib.Path], fmt: str
) -> None:
    hf, gguf_path = family
    model = str(hf.path) if fmt == "hf" else str(gguf_path)
    ps = _prompts(1, 5)
    reqs = [GenerationRequest(f"q{i}", p, max_tokens=12, n=2 if i == 2 else 1) for i, p in enumerate(ps)]
    # 20 blocks of 4 tokens cannot hold 6 sequences of ~30 tokens: someone must be preempted.
    cfg = StackConfig(model=model, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=20)
    with LocalStack(cfg) as st:
        engine = st.engine(EngineConfig(max_batch_tokens=8))
        outs = engine.generate(reqs)
        bm = st.block_manager.servicer._core  # noqa: SLF001 - white-box check
        bm.check_invariants()
        stats = bm.stats()
    assert engine.stats.preempted_recompute + engine.stats.preempted_swap > 0
    assert engine.stats.prefix_hit_tokens > 0, "the shared system prompt should be reused"
    assert stats.num_sequences == 0 and stats.num_used_blocks == 0
    for p, out in zip(ps, outs, strict=True):
        expected = hf.greedy(p, 12)
        assert [c.token_ids for c in out.completions] == [expected] * len(out.completions), out.request_id


def test_generate_local_takes_a_gguf_file(tmp_path: pathlib.Path) -> None:
    """`pagedkv generate --local --model FILE.gguf` as a user runs it: transformers' greedy tokens."""
    import json
    import os
    import subprocess
    import sys

    hf = build("LlamaForCausalLM", tmp_path / "hf", seed=9)
    path = tmp_path / "tiny.F16.gguf"
    held = write_gguf(hf, path, "F16")
    from tests.worker_svc.families import oracle_on

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "generate",
            "--local",
            "--model",
            str(path),
            "--token-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            "6",
        ],
        cwd=pathlib.Path(__file__).resolve().parents[3],
        env={**os.environ, "PAGEDKV_KERNEL_BACKEND": "reference"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["completions"][0]["token_ids"]
    assert got == oracle_on(hf, held, hf.path).greedy(prompt, 6)
