"""An engine's lease on its sequences, through the engine's public API and the block manager's stats.

An engine holding sequences longer than its lease TTL (here: idle between steps for three TTLs)
keeps them, because its renewal runs on its own clock, and its requests then finish with
transformers' greedy tokens. An engine whose renewal stops (its process frozen with SIGSTOP, the
connection still open) loses every sequence and block within the TTL (plus one sweep).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel, build_hf_model

ROOT = pathlib.Path(__file__).resolve().parents[3]
TTL_S = 1.0
SWEEP_S = 0.1
PROMPTS = [[3, 9, 27, 81, 11, 5, 7], [4, 16, 64, 2, 8]]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("lease-llama"), seed=2)


@pytest.fixture(scope="module")
def stack(hf: HFModel) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=str(hf.path),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_gpu_blocks=128,
        kernel_backend="reference",
        block_manager_overrides={"lease_sweep_interval_s": SWEEP_S},
    )
    with LocalStack(cfg) as st:
        yield st


def held(stack: LocalStack) -> tuple[int, int]:
    with BlockManagerClient(stack.block_manager_target) as bm:
        s = bm.get_stats()
    return s.num_sequences, s.num_used_blocks


def test_an_engine_idle_past_its_ttl_keeps_its_sequences_and_finishes_exactly(
    stack: LocalStack, hf: HFModel
) -> None:
    assert held(stack) == (0, 0)
    with BlockManagerClient(stack.block_manager_target) as bm, WorkerClient(stack.worker_targets[0]) as w:
        engine = Engine(bm, [w], EngineConfig(lease_ttl_s=TTL_S))
        outs = [
            engine.add_request(GenerationRequest(f"r{i}", p, max_tokens=8)) for i, p in enumerate(PROMPTS)
        ]
        for _ in range(3):
            engine.step()
        assert all(o.completions[0].token_ids for o in outs)  # prefilled, mid-generation
        seqs, blocks = held(stack)
        assert seqs == len(PROMPTS) and blocks > 0
        renewals = engine.stats.lease_renewals
        time.sleep(3 * TTL_S)  # no step: only the renewal keeps the lease alive
        assert held(stack) == (seqs, blocks), "the sequences were freed while their engine was alive"
        assert engine.stats.lease_renewals >= renewals + 3
        for _ in engine.stream():
            pass
        for o, p in zip(outs, PROMPTS, strict=True):
            assert o.completions[0].token_ids == hf.greedy(p, 8), o.request_id
        engine.close()
    assert held(stack) == (0, 0)


def test_an_engine_whose_renewal_stops_loses_its_sequences_within_the_ttl(stack: LocalStack) -> None:
    job = {
        "block_manager": stack.block_manager_target,
        "workers": stack.worker_targets,
        "lease_ttl_s": TTL_S,
        "requests": [{"id": "k0", "prompt": PROMPTS[0], "max_tokens": 300}],
    }
    env = {**os.environ, "PAGEDKV_KERNEL_BACKEND": "reference"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.frontend.engine_proc", json.dumps(job)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None

        def line() -> dict:
            text = proc.stdout.readline()  # type: ignore[union-attr]
            assert text, proc.stderr.read()  # type: ignore[union-attr]
            return json.loads(text)

        line()  # {"instance": ...}
        while line().get("tokens", 0) < 2:
            pass
        assert held(stack)[0] == 1
        proc.send_signal(signal.SIGSTOP)  # alive, connected, but no longer renewing
        stopped = time.monotonic()
        while held(stack) != (0, 0):
            assert time.monotonic() - stopped < TTL_S + 2 * SWEEP_S + 0.5, (
                f"a stopped engine's sequences outlived its lease: {held(stack)}"
            )
            time.sleep(0.02)
        # Not before the TTL: the lease was renewed until the stop (at most TTL/3 before it).
        assert time.monotonic() - stopped >= TTL_S * 2 / 3 - 0.05
    finally:
        proc.kill()
        proc.wait(10)
    # The pool still serves: a new engine's request finishes.
    with BlockManagerClient(stack.block_manager_target) as bm, WorkerClient(stack.worker_targets[0]) as w:
        engine = Engine(bm, [w], EngineConfig(lease_ttl_s=TTL_S))
        out = engine.add_request(GenerationRequest("after", PROMPTS[1], max_tokens=4))
        for _ in engine.stream():
            pass
        assert len(out.completions[0].token_ids) == 4
        engine.close()
    assert held(stack) == (0, 0)
