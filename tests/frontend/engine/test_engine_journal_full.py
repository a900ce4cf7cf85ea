"""An engine rides out a block manager whose journal disk is full for a while (in-process stack):
its Steps are refused with UNAVAILABLE, it retries them with the same request ids within its outage
budget, and once the disk takes writes again every request finishes with transformers' greedy
tokens and nothing stays allocated."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.block_manager_svc.reliability.full_disk import FullDisk, full_disk
from tests.worker_svc.conftest import HFModel, build_hf_model

PROMPTS = [[3, 9, 27, 81, 11, 5, 7], [4, 16, 64, 2, 8], [7, 7, 1, 2, 3, 4, 5, 6, 9]]
MAX_TOKENS = 16
FULL_S = 1.5


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("journal-full-llama"), seed=5)


@pytest.fixture(params=["tmpfs", "injected"])
def disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FullDisk]:
    yield from full_disk(request, tmp_path, monkeypatch)


def test_engine_rides_out_a_full_journal_disk(hf: HFModel, disk: FullDisk) -> None:
    cfg = StackConfig(
        model=str(hf.path),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_gpu_blocks=128,
        kernel_backend="reference",
        block_manager_overrides={"state_dir": str(disk.state_dir), "snapshot_interval_s": 0},
    )
    with LocalStack(cfg) as stack:
        eng = stack.engine(EngineConfig(max_batch_tokens=64, block_manager_outage_s=20))
        reqs = [GenerationRequest(f"r{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(PROMPTS)]
        outs = [eng.add_request(r) for r in reqs]
        for _ in range(4):
            eng.step()
        assert not all(o.finished for o in outs)
        # A new, empty journal segment: on a filled tmpfs its first record needs a page there is none of.
        stack.block_manager.servicer.reliable.snapshot_now(rewrite=True)
        disk.fill()
        freer = threading.Timer(FULL_S, disk.free)
        freer.start()
        t0 = time.monotonic()
        for _ in eng.stream(max_steps=10_000):
            pass
        freer.join()
        assert time.monotonic() - t0 >= FULL_S * 0.9  # it waited for the disk
        for o, p in zip(outs, PROMPTS, strict=True):
            assert o.completions[0].token_ids == hf.greedy(p, MAX_TOKENS), o.request_id
        assert eng.stats.bm_resyncs == 0  # the manager kept its state: nothing to re-establish
        assert stack.block_manager.servicer.reliable.num_journal_failures >= 1
        stats = eng.bm.get_stats()
        assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
