"""bench/pd_bench.py's pieces on an in-process stack: the model it writes loads, the workload has
long prompts arriving after the decoders, and ``drive`` times every token of every request."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest

from bench import pd_bench
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.worker_svc.model.config import load_model_config


def test_pd_bench_model_workload_and_drive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    model = pd_bench.make_model(tmp_path / "m", hidden=64, layers=2, vocab=128)
    cfg = load_model_config(str(model))
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads) == (64, 2, 128, 1)
    args = argparse.Namespace(
        seed=0,
        decoders=3,
        decode_prompt=5,
        decode_tokens=4,
        long=2,
        long_prompt=20,
        long_tokens=2,
        long_start_s=0.05,
        long_every_s=0.05,
    )
    arrivals = pd_bench.workload(args, cfg.vocab_size)
    assert [a.at_s for a in arrivals] == [0.0, 0.0, 0.0, 0.05, 0.1]
    assert [len(a.request.prompt) for a in arrivals] == [5, 5, 5, 20, 20]
    with LocalStack(
        StackConfig(
            model=str(model),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_gpu_blocks=64,
            num_workers=2,
            roles=("prefill", "decode"),
        )
    ) as st:
        addresses = [st.block_manager_target, "cache-host-unused", *st.worker_targets]
        stack = types.SimpleNamespace(services=[types.SimpleNamespace(address=a) for a in addresses])
        res = pd_bench.drive(stack, arrivals, pd_bench.Layout("p+d", 2, ("prefill", "decode")), 16)  # type: ignore[arg-type]
    assert res.generated == 3 * 4 + 2 * 2
    assert len(res.ttft_s) == 5 and len(res.tpot_s) == 5 and len(res.itl_s) == 3 * 3 + 2 * 1
    assert all(t > 0 for t in res.ttft_s + res.tpot_s) and res.tok_s > 0
    assert pd_bench.pct([3.0, 1.0, 2.0], 50) == 2.0 and pd_bench.pct([3.0, 1.0, 2.0], 99) == 3.0
