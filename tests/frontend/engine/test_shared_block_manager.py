"""Many frontends on one block manager: two engines in separate processes share one
block manager and one set of workers, with prompts sharing a 400-token prefix.

Every greedy output equals transformers' generate(); later requests hit the shared prefix, and
only on committed blocks (a hit on KV nobody wrote would change the tokens); killing one
frontend mid-generation returns its blocks within its lease TTL while the other finishes.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel, build_hf_model

ROOT = pathlib.Path(__file__).resolve().parents[3]
BS = 16
LEASE_TTL_S = 2.0


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("shared-llama"), seed=5)


def spawn(stack: LocalStack, requests: list[dict]) -> subprocess.Popen[str]:
    job = {
        "block_manager": stack.block_manager_target,
        "workers": stack.worker_targets,
        "lease_ttl_s": LEASE_TTL_S,
        "requests": requests,
    }
    env = {**os.environ, "PAGEDKV_KERNEL_BACKEND": "reference"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.frontend.engine_proc", json.dumps(job)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(proc: subprocess.Popen[str]) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, proc.stderr.read()  # type: ignore[union-attr]
    return json.loads(line)


def finish(proc: subprocess.Popen[str]) -> dict:
    # Read through the same buffered pipe read_line used (communicate() would skip what it buffered).
    out = proc.stdout.read()  # type: ignore[union-attr]
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert proc.wait(timeout=180) == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_two_engine_processes_share_one_block_manager(hf: HFModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    rng = random.Random(11)
    prefix = [rng.randrange(1, 128) for _ in range(400)]
    prompts = {
        f"{who}{i}": prefix + [rng.randrange(1, 128) for _ in range(rng.randint(3, 9))]
        for who in "abk"
        for i in range(2)
    }
    cfg = StackConfig(model=str(hf.path), device="cpu", dtype="float32", block_size=BS, num_gpu_blocks=256)
    with LocalStack(cfg) as stack:

        def core():  # type: ignore[no-untyped-def]
            return stack.block_manager.servicer._core  # noqa: SLF001 - white-box checks

        a = spawn(stack, [{"id": k, "prompt": prompts[k], "max_tokens": 6} for k in ("a0", "a1")])
        k = spawn(stack, [{"id": "k0", "prompt": prompts["k0"], "max_tokens": 200}])
        b = spawn(stack, [{"id": x, "prompt": prompts[x], "max_tokens": 6} for x in ("b0", "b1")])
        instances = {name: read_line(p)["instance"] for name, p in (("a", a), ("k", k), ("b", b))}
        assert len(set(instances.values())) == 3  # sequence ids never collide
        # Kill k mid-generation: its sequences (and blocks) go back within the lease TTL.
        while read_line(k)["tokens"] < 3:
            pass
        assert any(s.startswith(instances["k"]) for s in core().seqs)
        k.send_signal(signal.SIGKILL)
        k.wait(10)
        killed_at = time.monotonic()
        results = {"a": finish(a), "b": finish(b)}
        while any(s.startswith(instances["k"]) for s in core().seqs):
            assert time.monotonic() - killed_at < LEASE_TTL_S + 3, "a dead frontend kept its sequences"
            time.sleep(0.1)
        with BlockManagerClient(stack.block_manager_target) as client:
            stats = client.get_stats()  # the lease sweeper freed them
        core().check_invariants()
        assert stats.num_sequences == 0 and stats.num_used_blocks == 0
        assert stats.num_lease_expired_sequences >= 1
    for res in results.values():
        assert res["stats"]["bm_round_trips"] <= res["stats"]["steps"]
        for out in res["outputs"]:
            assert out["tokens"] == hf.greedy(prompts[out["id"]], 6), out["id"]
        # The second request was admitted after the first one's prompt was committed: it hits the
        # whole shared prefix (25 full blocks), committed by this engine or the other one.
        assert res["outputs"][1]["cached"] >= 400 // BS * BS, res
    assert stats.prefix_hit_tokens >= 2 * (400 // BS * BS)
