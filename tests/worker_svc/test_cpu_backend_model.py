"""The model on the CPU fast path (kernels/cpu/attention.py plans, oneDNN-packed linears) vs transformers.

The rest of tests/worker_svc runs the reference kernels; here the same greedy-equality oracle runs
with ``pagedkv.kernels.use_backend("cpu")``, the backend ``auto`` picks on CPU, on both of its decode paths
(the native kernel, and the gathers without it): a ragged batch of many
sequences (so the decode length buckets split), prefill and decode in one forward, and a prefix-cache
hit whose chunk attends to the cached prefix.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels.cpu import linear as cpu_linear
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.worker_svc.model import linear
from pagedkv.worker_svc.model_runner import ModelRunner
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.generation import Scheduler, runner_step
from tests.worker_svc.test_model_runner import BLOCK, PROMPT, make_runner


@pytest.fixture(autouse=True, params=["native", "buckets"])
def _cpu_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Every test on both decode paths: the native kernel (kernels/cpu/native.py) and the gathers."""
    if request.param == "buckets":
        monkeypatch.setenv("PAGEDKV_CPU_NATIVE", "0")
    elif not cpu_native.available():
        pytest.skip("no C compiler: the native kernels cannot be built here")
    with kernels.use_backend("cpu"):
        yield


@pytest.fixture(scope="module")
def runner(hf_llama: HFModel) -> ModelRunner:
    return make_runner(hf_llama.path, num_gpu_blocks=160)


def test_linears_take_the_native_packed_path_where_preferred_else_onednn(hf_llama: HFModel) -> None:
    runner = make_runner(hf_llama.path, num_gpu_blocks=16)  # loaded under this parameter's setting
    layer = runner.model.layers[0]
    w = layer.qkv.weight
    # native where its build beats oneDNN (cpu_linear.preferred: the AVX-512 variant)
    expected = "native" if cpu_linear.preferred() else "onednn" if linear.packing_enabled(w) else "torch"
    assert {lin.path for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, runner.model.lm_head)} == {
        expected
    }
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(layer.qkv(x), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_ragged_batch_with_mixed_prefill_and_decode_matches_generate(
    runner: ModelRunner, hf_llama: HFModel
) -> None:
    rnd = random.Random(3)
    prompts = {f"s{i}": [rnd.randrange(1, 128) for _ in range(rnd.randint(1, 40))] for i in range(10)}
    sched = Scheduler(runner_step(runner), num_gpu_blocks=160, block_size=BLOCK)
    first = list(prompts)[:6]
    for sid in first:
        sched.add(sid, prompts[sid])
    sched.run(first)
    sched.generate(first, 3)
    for sid in list(prompts)[6:]:  # these prefill while the first six decode
        sched.add(sid, prompts[sid])
    for sid in first:
        sched.push(sid, sched.seqs[sid].generated[-1])
    sched.run(list(prompts))
    sched.generate(list(prompts), 8)
    for sid, prompt in prompts.items():
        n = len(sched.seqs[sid].generated)
        assert sched.seqs[sid].generated == hf_llama.greedy(prompt, n), sid


def test_prefix_hit_chunk_attends_to_the_cached_prefix(runner: ModelRunner, hf_llama: HFModel) -> None:
    sched = Scheduler(runner_step(runner), num_gpu_blocks=160, block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.run(["a"])
    other = PROMPT[:8] + [30, 31, 32]
    assert sched.add("b", other) == 8  # two full blocks from the cache
    sched.run(["b"])
    sched.generate(["b"], 6)
    assert sched.seqs["b"].generated == hf_llama.greedy(other, 7)


def test_decode_over_shared_prefix_blocks_matches_generate(
    runner: ModelRunner, hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences whose block tables start with the same physical blocks (prefix hits on one system
    prompt) attend to them together (kernels/cpu/attention.py cascade) and still decode exactly."""
    from pagedkv.kernels.cpu import attention as cpu

    merges = []
    real = cpu._merge_shared_prefix  # noqa: SLF001

    def counting(sp, *a, **kw):  # type: ignore[no-untyped-def]
        merges.append(sp.idx.numel())
        return real(sp, *a, **kw)

    monkeypatch.setattr(cpu, "_merge_shared_prefix", counting)
    monkeypatch.setattr(cpu, "CASCADE_MIN_SAVED_TOKENS", 0)  # a tiny model's short prompt: force the cascade
    monkeypatch.setenv(
        "PAGEDKV_CPU_NATIVE", "0"
    )  # the cascade is the bucket path's (decode without the native kernel)

    rnd = random.Random(11)
    system = [rnd.randrange(1, 128) for _ in range(6 * BLOCK + 1)]  # 6 full blocks, past MIN_SHARED_BLOCKS
    assert 6 >= cpu.MIN_SHARED_BLOCKS
    sched = Scheduler(runner_step(runner), num_gpu_blocks=160, block_size=BLOCK)
    sched.add("first", system + [5])
    sched.run(["first"])
    prompts = {f"u{i}": system + [rnd.randrange(1, 128) for _ in range(rnd.randint(1, 9))] for i in range(5)}
    for sid, p in prompts.items():
        assert sched.add(sid, p) == 6 * BLOCK  # the system prompt's blocks are hits: shared physically
    sched.run(list(prompts))
    tables = [sched.bm.block_table(s).block_ids for s in prompts]
    assert all(t[:6] == tables[0][:6] for t in tables)
    sched.generate(list(prompts), 6)
    assert merges and max(merges) == 5  # every decode step attended to the shared blocks once for all five
    for sid, p in prompts.items():
        assert sched.seqs[sid].generated == hf_llama.greedy(p, 7), sid


def test_prefill_runs_on_the_native_prefill_kernel(
    runner: ModelRunner, hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 prefill rows go through kernels/cpu/csrc/paged_prefill.c (a spy sees every layer's call) and
    the greedy tokens stay transformers'."""
    if not cpu_native.available():
        pytest.skip("the native kernels are off in this parameter")
    calls: list[int] = []
    real = cpu_native.prefill

    def spy(query: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(query.shape[0])
        return real(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_native, "prefill", spy)
    rnd = random.Random(11)
    prompts = {f"p{i}": [rnd.randrange(1, 128) for _ in range(n)] for i, n in enumerate((45, 17, 3))}
    sched = Scheduler(runner_step(runner), num_gpu_blocks=160, block_size=BLOCK)
    for sid, prompt in prompts.items():
        sched.add(sid, prompt)
    sched.run(list(prompts))
    assert calls and calls[0] == sum(len(p) for p in prompts.values())
    assert len(calls) % runner.model.cfg.num_layers == 0
    sched.generate(list(prompts), 4)
    for sid, prompt in prompts.items():
        assert sched.seqs[sid].generated == hf_llama.greedy(prompt, len(sched.seqs[sid].generated)), sid
