"""Decode steps replayed from CUDA graphs (worker_svc/model/cuda_graphs.py).

On CPU the capture is a fake that records capture/replay calls and "replays" by running the padded
forward pass eagerly on the static buffers: the bookkeeping (which batch size maps to which graph),
the padding (rows that write no KV, outputs dropped), invalidation and the eager fallbacks are all
real code paths, and padded eager must give the unpadded eager run's tokens. The one CUDA test
captures real graphs, over model-dtype and 8-bit caches (bench/gpu_check.sh's pytest section runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import structlog
import torch

from pagedkv.kernels import quant
from pagedkv.worker_svc.model import cuda_graphs
from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG
from pagedkv.worker_svc.model.cuda_graphs import DecodeGraphs, Fallback, bucket_for, capture_sizes
from pagedkv.worker_svc.model.registry import Model
from pagedkv.worker_svc.model.sampling import SamplingParams
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest
from tests.worker_svc.generation import Scheduler, runner_step

BLOCK = 4
NUM_BLOCKS = 64
SIZES = (1, 2, 4, 8)
MAX_BLOCKS = 16  # 64 tokens


@dataclass
class FakeGraph:
    forward: Callable[[], torch.Tensor]
    out: torch.Tensor
    replays: int = 0

    @property
    def size(self) -> int:
        return int(self.out.shape[0])

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.forward())


class FakeCapture:
    """Records what was captured; replay runs the captured closure again (eagerly)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.graphs: list[FakeGraph] = []
        self.attempts = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[FakeGraph, torch.Tensor]:
        self.attempts += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = forward()
        graph = FakeGraph(forward, out)
        self.graphs.append(graph)
        return graph, out

    def sizes(self) -> list[int]:
        return [g.size for g in self.graphs]


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model(None, DEFAULT_MODEL_CONFIG, torch.float32, torch.device("cpu"))


def _cache(
    model: Model, seed: int = 0, device: str = "cpu", blocks: int = NUM_BLOCKS, kv: str = "auto"
) -> torch.Tensor:
    """A random cache (never zeros: a stray write shows) in the model's dtype, or 8-bit rows with
    their scales for ``kv`` int8 / fp8_e4m3 (kernels/quant.py)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.num_layers, 2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    x = torch.randn(shape, generator=gen)
    if kv != "auto":
        return quant.pack(*quant.quantize(x, quant.QUANT_DTYPES[kv])).to(device)
    return x.to(device=device, dtype=model.dtype)


def _runner(
    model: Model, graphs: DecodeGraphs | None = None, cache: torch.Tensor | None = None
) -> ModelRunner:
    gpu = _cache(model) if cache is None else cache
    cpu = torch.zeros((*gpu.shape[:2], 0, *gpu.shape[3:]), dtype=gpu.dtype)
    return ModelRunner(model, gpu, cpu, decode_graphs=graphs)


def _graphs(
    backend: FakeCapture, sizes: tuple[int, ...] = SIZES, max_blocks: int = MAX_BLOCKS
) -> DecodeGraphs:
    return DecodeGraphs(sizes=sizes, max_blocks=max_blocks, backend=backend)


def _decode(n: int, cached: int = 2) -> list[SequenceRequest]:
    """n decode sequences, one block each (block i), ``cached`` tokens already in the cache."""
    return [SequenceRequest(f"s{i}", [i + 1], [i], cached) for i in range(n)]


def _generate(runner: ModelRunner, n_seqs: int, steps: int) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy generation of n_seqs sequences together: tokens and logprobs of each."""
    logprobs: dict[str, list[float]] = {}
    step = runner_step(runner)

    def recording(seqs: list[SequenceRequest], ops):  # type: ignore[no-untyped-def]
        out = step(seqs, ops)
        for s, (_, lp) in zip(seqs, out, strict=True):
            logprobs.setdefault(s.seq_id, []).append(lp)
        return out

    sched = Scheduler(recording, num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK)
    ids = [f"q{i}" for i in range(n_seqs)]
    for i, sid in enumerate(ids):
        sched.add(sid, [(7 * i + j) % DEFAULT_MODEL_CONFIG.vocab_size for j in range(5 + i)])
    sched.generate(ids, steps)
    return {sid: (sched.seqs[sid].generated, logprobs[sid]) for sid in ids}


# ------------------------------------------------------------------ sizes and buckets
def test_capture_sizes_are_small_powers_then_multiples_of_8_up_to_the_max() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        capture_sizes(0)


def test_each_batch_size_goes_to_the_smallest_size_that_holds_it() -> None:
    sizes = capture_sizes(40)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 33: 40, 40: 40, 41: None}
    assert {n: bucket_for(n, sizes) for n in expected} == expected
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


def test_steps_capture_each_size_once_and_replay_the_graph_of_their_bucket(model: Model) -> None:
    backend = FakeCapture()
    graphs = _graphs(backend)
    runner = _runner(model, graphs)
    for n in (1, 3, 3, 4, 5, 8, 1):
        runner.step(_decode(n))
    assert backend.sizes() == [1, 4, 8]  # captured lazily, once each, in order of first use
    assert {g.size: g.replays for g in backend.graphs} == {1: 2, 4: 3, 8: 2}
    assert graphs.stats["replayed"] == 7 and graphs.stats["captured"] == 3


# ------------------------------------------------------------------ padding
def test_padding_rows_write_no_kv_and_read_only_block_zero(model: Model) -> None:
    graphs = _graphs(FakeCapture())
    runner = _runner(model, graphs)
    before = runner.gpu_cache.clone()
    seqs = _decode(3, cached=1)  # block i, slot i*4 + 1: bucket 4, one padding row
    runner.step(seqs)
    inputs = graphs.inputs
    assert inputs is not None
    assert inputs.slot_mapping[3:].tolist() == [-1] * 5
    assert inputs.seq_lens[3:].tolist() == [1] * 5
    assert not inputs.block_tables[3:].any() and not inputs.block_tables[:3, 1:].any()
    assert inputs.block_tables[:3, 0].tolist() == [0, 1, 2]
    # Exactly the real rows' slots changed, in every layer, K and V: padding wrote nowhere.
    flat = (runner.gpu_cache != before).any(dim=(4, 5)).flatten(2)  # [layers, 2, blocks * block size]
    changed = {int(s) for s in flat.any(dim=(0, 1)).nonzero().flatten()}
    assert changed == {i * BLOCK + 1 for i in range(3)}
    assert bool(flat[:, :, [i * BLOCK + 1 for i in range(3)]].all())


@pytest.mark.parametrize("n_seqs", [1, 3, 5])  # 3 and 5 are padded (to 4 and 8)
def test_padded_graph_path_gives_the_eager_tokens(model: Model, n_seqs: int) -> None:
    backend = FakeCapture()
    eager = _generate(_runner(model), n_seqs, steps=14)  # 14 decode steps: crosses block boundaries
    graphs = _graphs(backend)
    replayed = _generate(_runner(model, graphs), n_seqs, steps=14)
    assert graphs.stats["replayed"] == 13  # the first step carries the prompts (prefill: eager)
    assert graphs.stats[Fallback.PREFILL.value] == 1
    assert backend.sizes() == [bucket_for(n_seqs, SIZES)]
    for sid, (tokens, lps) in eager.items():
        assert replayed[sid][0] == tokens
        assert replayed[sid][1] == pytest.approx(lps, abs=1e-4)


def test_sampling_options_forks_and_returned_logits_are_the_same_with_graphs(model: Model) -> None:
    """Only the forward pass is captured: everything after the logits runs as in an eager step."""
    graphs = _graphs(FakeCapture())
    eager, replayed = _runner(model), _runner(model, graphs)  # equal caches (same seed)

    def seqs() -> list[SequenceRequest]:
        out = _decode(3, cached=2)
        out[0].sampling = SamplingParams(temperature=0.8, top_k=20, seed=7, num_top_logprobs=3)
        out[1].sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
        out[1].fork_sampling = [SamplingParams(temperature=1.0, seed=11), SamplingParams(num_top_logprobs=2)]
        out[2].return_logits = True
        return out

    want, got = eager.step(seqs()).outputs, replayed.step(seqs()).outputs
    assert graphs.stats["replayed"] == 1
    for w, g in zip(want, got, strict=True):
        assert (g.seq_id, g.token_id) == (w.seq_id, w.token_id)
        assert [t for t, _ in g.top] == [t for t, _ in w.top] and len(w.top) == (3 if w.seq_id == "s0" else 0)
        assert [f.token_id for f in g.fork_samples] == [f.token_id for f in w.fork_samples]
        assert [t for f in g.fork_samples for t, _ in f.top] == [t for f in w.fork_samples for t, _ in f.top]
        got_lps = [g.logprob, *(lp for _, lp in g.top), *(f.logprob for f in g.fork_samples)]
        want_lps = [w.logprob, *(lp for _, lp in w.top), *(f.logprob for f in w.fork_samples)]
        assert got_lps == pytest.approx(want_lps, abs=1e-5)
    assert len(got[1].fork_samples) == 2 and len(got[1].fork_samples[1].top) == 2
    assert got[2].logits is not None and want[2].logits is not None
    torch.testing.assert_close(got[2].logits, want[2].logits, atol=1e-5, rtol=1e-5)
    assert got[2].logits.shape == (DEFAULT_MODEL_CONFIG.vocab_size,)


# ------------------------------------------------------------------ eager fallbacks
def test_prefill_oversized_and_long_context_steps_run_eagerly(model: Model) -> None:
    backend = FakeCapture()
    graphs = _graphs(backend, sizes=(1, 2, 4), max_blocks=2)
    runner = _runner(model, graphs)
    runner.step([SequenceRequest("p", [3, 4, 5], [0], 0)])  # prefill
    runner.step([*_decode(2)[1:], SequenceRequest("p", [3, 4], [0], 0)])  # mixed
    runner.step(_decode(5))  # more than the largest size
    runner.step([SequenceRequest("long", [1], [0, 1, 2], 8)])  # 9 tokens: 3 blocks > 2 captured
    assert graphs.stats == {"prefill": 2, "batch_too_large": 1, "context_too_long": 1}
    assert backend.attempts == 0 and graphs.inputs is None
    runner.step([SequenceRequest("ok", [1], [0, 1], 7)])  # 8 tokens: 2 blocks fit
    assert graphs.stats["replayed"] == 1 and backend.sizes() == [1]


def test_a_failed_capture_is_logged_once_and_the_runner_stays_eager(model: Model) -> None:
    backend = FakeCapture(fail=True)
    graphs = _graphs(backend)
    eager = _runner(model)
    runner = _runner(model, graphs)
    with structlog.testing.capture_logs() as logs:
        for n in (1, 3, 5):
            got = runner.step(_decode(n))
            want = eager.step(_decode(n))
            assert [o.token_id for o in got.outputs] == [o.token_id for o in want.outputs]
    assert [e["event"] for e in logs if e["event"].startswith("cuda_graph")] == ["cuda_graph_capture_failed"]
    assert backend.attempts == 1
    assert graphs.stats["capture_failed"] == 3 and graphs.stats["replayed"] == 0


# ------------------------------------------------------------------ invalidation
def test_a_new_cache_or_model_drops_the_graphs_and_captures_again(model: Model) -> None:
    backend = FakeCapture()
    graphs = _graphs(backend)
    first = _runner(model, graphs)
    first.step(_decode(3))
    first.step(_decode(3))
    assert backend.sizes() == [4]
    # A re-attach after a cache host restart: a new cache tensor (new addresses).
    moved = _runner(model, graphs, cache=_cache(model, seed=1))
    with structlog.testing.capture_logs() as logs:
        moved.step(_decode(3))
    assert backend.sizes() == [4, 4]
    assert [e["event"] for e in logs] == ["cuda_graphs_invalidated", "cuda_graph_captured"]
    moved.step(_decode(3))
    assert backend.sizes() == [4, 4]  # same cache: replayed, not captured again
    # New weights (e.g. the new host's shared weights) on the same cache.
    other = load_model(None, DEFAULT_MODEL_CONFIG, torch.float32, torch.device("cpu"), seed=1)
    _runner(other, graphs, cache=moved.gpu_cache).step(_decode(3))
    assert backend.sizes() == [4, 4, 4]
    # The same model object holding weights at new addresses (what an id() reused by a new model
    # would look like).
    other.embed = other.embed.clone()  # type: ignore[attr-defined]
    _runner(other, graphs, cache=moved.gpu_cache).step(_decode(3))
    assert backend.sizes() == [4, 4, 4, 4]
    assert [g.replays for g in backend.graphs] == [2, 2, 1, 1]


def test_closing_a_runner_drops_its_graphs(model: Model) -> None:
    graphs = _graphs(FakeCapture())
    runner = _runner(model, graphs)
    runner.step(_decode(2))
    assert graphs.graphs and graphs.inputs is not None
    runner.close()
    assert not graphs.graphs and graphs.inputs is None and graphs.key is None


# ------------------------------------------------------------------ the worker's settings
def test_graphs_are_on_for_cuda_workers_only_and_sized_by_the_settings() -> None:
    cuda = torch.device("cuda")
    assert cuda_graphs.for_worker(True, 8, 1024, torch.device("cpu"), 16, 4096) is None
    assert cuda_graphs.for_worker(False, 8, 1024, cuda, 16, 4096) is None
    g = cuda_graphs.for_worker(True, 20, 1000, cuda, 16, 4096)
    assert g is not None and g.sizes == (1, 2, 4, 8, 16, 20) and g.max_blocks == 63
    assert isinstance(g.backend, cuda_graphs.CudaCapture) and not g.graphs  # nothing captured yet
    small_cache = cuda_graphs.for_worker(True, 8, 100_000, cuda, 16, 32)
    assert small_cache is not None and small_cache.max_blocks == 32


def test_worker_flags_turn_graphs_off_and_size_them() -> None:
    from pagedkv.settings_cli import load_settings
    from pagedkv.worker_svc.settings import WorkerSettings

    s = load_settings(WorkerSettings, ["--no-cuda-graphs", "--cuda-graph-max-batch", "32"], "worker", "")
    assert s.cuda_graphs is False and s.cuda_graph_max_batch == 32
    assert WorkerSettings().cuda_graphs is True


# ------------------------------------------------------------------ CUDA: real graphs
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bench/gpu_check.sh runs it")
@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3"])
def test_graphs_give_the_eager_greedy_tokens_on_cuda(kv: str) -> None:
    """Also over 8-bit caches, with the backend left to ``auto``: it must be Triton there (the
    reference reads lengths back to the host, and a capture with it fails), and the first step's
    log-probabilities must be the reference's."""
    dev = torch.device("cuda")
    m = load_model(None, DEFAULT_MODEL_CONFIG, torch.float32, dev)

    def runner(graphs: DecodeGraphs | None, seed: int = 0, backend: str | None = None) -> ModelRunner:
        gpu = _cache(m, seed=seed, device="cuda", kv=kv)
        cpu = torch.zeros((*gpu.shape[:2], 0, *gpu.shape[3:]), dtype=gpu.dtype)
        if backend is None:
            backend = "triton" if kv == "auto" else None  # None: auto, the GPU worker's default
        return ModelRunner(m, gpu, cpu, kernel_backend=backend, decode_graphs=graphs)

    if kv != "auto":
        # Within 2e-2: layer 0's tiny differences (tf32x3 dots) move some of layer 1's K/V values
        # across a rounding boundary of the 8-bit grid (e4m3's steps are 1/16 of a value); in the
        # interpreter, with exact dots, the step-1 log-probabilities differed by 1e-6 (int8) and
        # 9e-4 (fp8_e4m3). A wrong scale is far outside it.
        ref = _generate(runner(None, backend="reference"), 3, steps=1)
        ours = _generate(runner(None), 3, steps=1)
        assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in ref.items()}
        for k, (_, lp) in ours.items():
            assert abs(lp[0] - ref[k][1][0]) < 2e-2, (k, lp, ref[k][1])

    graphs = cuda_graphs.for_worker(True, 8, 256, dev, BLOCK, NUM_BLOCKS)
    assert graphs is not None
    for n_seqs in (1, 3, 8):  # 3 replays the graph of 4 with a padding row
        eager = _generate(runner(None), n_seqs, steps=12)
        replayed = _generate(runner(graphs), n_seqs, steps=12)
        assert {k: v[0] for k, v in replayed.items()} == {k: v[0] for k, v in eager.items()}
    assert graphs.stats["replayed"] == 3 * 11 and graphs.stats["capture_failed"] == 0
    # The runners above each had a new cache: every one recaptured. A simulated re-attach (a new
    # cache tensor at new addresses, as after a cache host restart) recaptures and still agrees.
    captured = graphs.stats["captured"]
    eager = _generate(runner(None, seed=5), 3, steps=12)
    assert {k: v[0] for k, v in _generate(runner(graphs, seed=5), 3, steps=12).items()} == {
        k: v[0] for k, v in eager.items()
    }
    assert graphs.stats["captured"] == captured + 1
