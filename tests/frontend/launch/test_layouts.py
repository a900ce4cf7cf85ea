"""Every worker layout computes exact outputs on the one shared cache (frontend/engine/dispatch.py).

Layouts: one mixed worker; two mixed workers (each iteration's sequences split by tokens, the
calls in flight at once); one prefill + one decode worker (two independent pipelines: prefill
chunks run on the prefill worker while the decode worker decodes). Each must give transformers'
greedy tokens with shared prefixes, n=2 samples and preemption, use every worker, and survive a
worker going away mid-generation (its share moves to the others; a lone worker is replaced). With
``overlap_block_manager`` the next decode slots are reserved while the workers compute.
"""

from __future__ import annotations

import pytest

from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.worker_svc.server import start_worker
from pagedkv.worker_svc.settings import WorkerSettings
from tests.frontend.engine.test_engine import prompts
from tests.worker_svc.conftest import HFModel, build_hf_model

LAYOUTS = {"mixed": ("mixed",), "mixed-x2": ("mixed", "mixed"), "prefill+decode": ("prefill", "decode")}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("layout-llama"), seed=7)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


def stack(hf: HFModel, roles: tuple[str, ...], **kw: object) -> LocalStack:
    return LocalStack(
        StackConfig(
            model=str(hf.path),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_workers=len(roles),
            roles=roles,
            **kw,
        )
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layout", "overlap"), [(name, False) for name in LAYOUTS] + [("mixed", True), ("prefill+decode", True)]
)
def test_layout_matches_transformers_with_prefixes_samples_and_preemption(
    hf: HFModel, layout: str, overlap: bool
) -> None:
    roles = LAYOUTS[layout]
    ps = prompts(11, 6)
    reqs = [GenerationRequest(f"r{i}", p, max_tokens=12, n=2 if i in (1, 4) else 1) for i, p in enumerate(ps)]
    # 22 blocks of 4 tokens cannot hold 8 sequences of ~30 tokens: preemption happens.
    with stack(hf, roles, num_gpu_blocks=22) as st:
        engine = st.engine(EngineConfig(max_batch_tokens=8, overlap_block_manager=overlap))
        outs = engine.generate(reqs)
        core = st.block_manager.servicer._core  # noqa: SLF001 - white-box check
        core.check_invariants()
        assert core.stats().num_sequences == 0 and core.stats().num_used_blocks == 0
    for p, out in zip(ps, outs, strict=True):
        expected = hf.greedy(p, 12)
        assert [c.token_ids for c in out.completions] == [expected] * len(out.completions), out.request_id
    assert engine.stats.prefix_hit_tokens > 0
    assert engine.stats.preempted_recompute + engine.stats.preempted_swap > 0
    steps = [s.steps for s in engine.pool.slots]
    assert all(n > 0 for n in steps), f"every worker computes: {steps}"
    assert (engine.stats.slots_reserved_ahead > 0) is overlap
    if layout == "mixed-x2":
        assert engine.pool.stats.parallel_steps > 0, "iterations are split over both workers"
    if layout == "prefill+decode":
        assert engine.pool.disaggregated() and engine.stats.prefill_launches > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_worker_gone_mid_generation_leaves_outputs_exact(hf: HFModel, layout: str) -> None:
    roles = LAYOUTS[layout]
    ps = prompts(12, 4)
    reqs = [GenerationRequest(f"k{i}", p, max_tokens=12, n=2 if i == 2 else 1) for i, p in enumerate(ps)]
    with stack(hf, roles, num_gpu_blocks=96) as st:
        engine = st.engine(EngineConfig(max_batch_tokens=8, timeout_s=10))
        outs = [engine.add_request(r) for r in reqs]
        for _ in range(6):
            engine.step()
        victim = st.workers[-1]  # the decode worker in prefill+decode
        port = victim.running.port
        victim.close()
        if len(roles) == 1:  # a lone worker: its replacement attaches to the same cache, no KV lost
            st.workers[-1] = start_worker(
                WorkerSettings(
                    port=port,
                    cache_host=f"127.0.0.1:{st.cache_host.port}",
                    model=str(hf.path),
                    device="cpu",
                    dtype="float32",
                    block_size=4,
                    num_gpu_blocks=96,
                ),
                local_cache=st.cache,
            )
            st._closers.append(st.workers[-1].close)  # noqa: SLF001
        for _ in engine.stream():
            pass
    for p, out in zip(ps, outs, strict=True):
        expected = hf.greedy(p, 12)
        assert [c.token_ids for c in out.completions] == [expected] * len(out.completions), out.request_id
    if len(roles) > 1:
        assert engine.stats.worker_retries >= 1, "the dead worker's share moved to the other one"
