"""CUDA graphs for decode steps: which batch sizes are captured, how a step is padded to one, when
a graph is stale, and when a step runs eagerly instead.

Why: a decode step launches a few Triton kernels and a dozen torch ops per layer through Python;
at small batch the CPU time of those launches is as long as the GPU work they start, so the GPU
waits on Python (docs/gpu.md, "CUDA graphs for decode steps"). Replaying a captured graph launches
the whole forward pass in one call.

What is captured: the model's forward pass only (embedding to the logits of every row). Batch
assembly, cache ops and sampling stay eager, so every sampling feature (top-k/p, logprobs, forks,
returned logits) works the same with graphs; nothing about sampling decides eager vs graph.

Sizes and padding: graphs exist for a fixed list of batch sizes (``capture_sizes``), captured lazily
the first time a step needs one. A step of ``n`` decode sequences replays the graph of the smallest
captured size ``b >= n`` (``bucket_for``). Every input lives in one set of static buffers sized for
the largest bucket (a graph reads the first ``b`` rows): token ids, positions, slot mapping, context
lengths and block tables of a fixed width (``max_blocks`` columns). Rows ``n..b`` are padding: token
0 at position 0, slot ``-1`` (every backend's KV write skips ``-1``: the contract in
``kernels/backend.py``), context length 1 over a block-table row of zeros (attention only READS
block 0, the row's output is dropped), so padding never writes KV anywhere. Columns past a real
row's used blocks are zero and never read.

Eager instead (``Fallback``): a step with prefill tokens, more sequences than the largest size, a
context wider than the captured block table, or after a capture failed (logged once; the runner then
stays eager).

Staleness: a graph holds the addresses of the KV cache, the model's weights and its static buffers.
``GraphKey`` names what they depend on (the cache tensor's address, shape, dtype and device, and the
model object with its weights' address); a step whose key differs from the graphs' (a new cache host
instance after a restart, new shared weights) drops every graph and captures again, lazily. The
worker also builds a new runner, with new graphs, on re-attach (``worker_svc/reattach.py``), and
``ModelRunner.close`` drops the old runner's graphs.

The capture itself is a ``CaptureBackend``: ``CudaCapture`` on CUDA; the tests inject a fake that
records capture/replay calls and replays by running the padded forward eagerly, so the bookkeeping
and padding are checked on CPU.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog
import torch

from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.worker_svc.model.batch import AttentionBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from pagedkv.worker_svc.model.registry import Model

log = structlog.get_logger("pagedkv.worker")

# Below 16 every size, then every 8: padding wastes at most 7 rows of dense work.
SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, ... up to ``max_batch`` (included even when not a multiple of 8)."""
    if max_batch < 1:
        raise ValueError(f"cuda_graph_max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in SMALL_SIZES if s <= max_batch] + list(range(16, max_batch + 1, SIZE_STEP))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    if num_seqs < 1:
        raise ValueError(f"a decode step has at least one sequence, got {num_seqs}")
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class Fallback(enum.Enum):
    """Why a step ran eagerly."""

    PREFILL = "prefill"  # the step has prefill tokens (prompt chunks, mixed steps)
    BATCH_TOO_LARGE = "batch_too_large"  # more decode sequences than the largest captured size
    CONTEXT_TOO_LONG = "context_too_long"  # a block table wider than the captured width
    CAPTURE_FAILED = "capture_failed"  # a capture raised earlier: this runner stays eager


@dataclass(frozen=True, slots=True)
class GraphKey:
    """What a captured graph's addresses depend on: any change makes every graph stale."""

    cache_ptr: int
    cache_shape: tuple[int, ...]
    cache_dtype: torch.dtype
    cache_device: torch.device
    model_id: int
    weights_ptr: int

    @classmethod
    def of(cls, model: Model, kv_cache: torch.Tensor) -> GraphKey:
        # id() alone can be reused by a new model allocated where a freed one was: the weights'
        # address tells new shared weights apart too.
        embed = getattr(model, "embed", None)
        return cls(
            cache_ptr=kv_cache.data_ptr(),
            cache_shape=tuple(kv_cache.shape),
            cache_dtype=kv_cache.dtype,
            cache_device=kv_cache.device,
            model_id=id(model),
            weights_ptr=embed.data_ptr() if isinstance(embed, torch.Tensor) else 0,
        )


class Replayable(Protocol):
    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    """Turns a forward pass over static buffers into something replayable."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """Warm ``forward`` up, capture it; return the graph and the output it writes on replay."""
        ...


class CudaCapture:
    """``torch.cuda.CUDAGraph``: one warm-up run on a side stream (Triton compiles there, never
    inside the capture), then the capture.

    All graphs share one memory pool, so their temporaries take the memory of the largest one, not
    the sum (a vocabulary of 128k makes the logits alone 0.5 MiB per row). That is safe here because
    graphs never run concurrently (steps are serialised) and no graph reads another's memory: each
    graph's output stays allocated (it is held in ``_Graph.logits``), so no later capture is handed
    it, and the runner copies the rows it needs out of it before the next replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: _POOL_HANDLE | None = None  # made at the first capture

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            forward()
        current.wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture-unsafe call (a sync, an allocation outside the pool) in THIS thread
        # fails the capture, while other threads of the process (several in-process workers of a
        # LocalStack, each with its own lock) keep running their steps instead of failing with it.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        return graph, out


@dataclass(slots=True)
class StaticInputs:
    """One decode step's inputs for the largest size; a graph of size ``b`` reads rows ``[:b]``."""

    token_ids: torch.Tensor  # int64 [max]
    positions: torch.Tensor  # int64 [max]
    slot_mapping: torch.Tensor  # int64 [max]; -1 on padding rows
    seq_lens: torch.Tensor  # int32 [max]; 1 on padding rows
    block_tables: torch.Tensor  # int32 [max, max_blocks]; zeros on padding rows and unused columns
    logits_indices: torch.Tensor  # int64 [max]: 0..max-1 (one token per sequence)

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        s = cls(
            token_ids=zeros(rows),
            positions=zeros(rows),
            slot_mapping=zeros(rows),
            seq_lens=zeros(rows, dtype=torch.int32),
            block_tables=zeros(rows, max_blocks, dtype=torch.int32),
            logits_indices=torch.arange(rows, dtype=torch.int64, device=device),
        )
        s.pad_from(0)
        return s

    def pad_from(self, n: int) -> None:
        """Make rows ``n..`` padding (they write no KV, read block 0, their logits are dropped)."""
        self.token_ids[n:] = 0
        self.positions[n:] = 0
        self.slot_mapping[n:] = -1
        self.seq_lens[n:] = 1
        self.block_tables[n:] = 0

    def fill(self, token_ids: torch.Tensor, batch: AttentionBatch) -> None:
        """Copy a decode-only step of ``n`` sequences into rows ``[:n]``; pad the rest."""
        assert batch.decode_block_tables is not None and batch.decode_seq_lens is not None
        n = token_ids.shape[0]
        width = batch.decode_block_tables.shape[1]
        self.token_ids[:n].copy_(token_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.decode_seq_lens)
        self.block_tables[:n, :width].copy_(batch.decode_block_tables)
        self.block_tables[:n, width:] = 0
        self.pad_from(n)

    def view(self, rows: int) -> tuple[torch.Tensor, AttentionBatch]:
        """The first ``rows`` rows as a decode-only forward pass's inputs."""
        return self.token_ids[:rows], AttentionBatch(
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            logits_indices=self.logits_indices[:rows],
            num_prefill_tokens=0,
            prefill_block_tables=None,
            prefill_query_start_loc=None,
            prefill_seq_lens=None,
            decode_block_tables=self.block_tables[:rows],
            decode_seq_lens=self.seq_lens[:rows],
        )


@dataclass(slots=True)
class _Graph:
    graph: Replayable
    logits: torch.Tensor  # [size, vocab]: written by every replay


@dataclass(slots=True)
class DecodeGraphs:
    """A runner's decode graphs: capture on first use of a size, replay, fall back to eager.

    Not thread-safe by itself: the model runner calls it under its step lock."""

    sizes: tuple[int, ...]
    max_blocks: int  # block-table width every graph is captured with
    backend: CaptureBackend
    key: GraphKey | None = None
    inputs: StaticInputs | None = None
    graphs: dict[int, _Graph] = field(default_factory=dict)
    failed: bool = False
    stats: Counter[str] = field(default_factory=Counter)  # "replayed", "captured", Fallback values

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"capture sizes must be increasing positive integers, got {self.sizes}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")

    def fallback(self, token_ids: torch.Tensor, batch: AttentionBatch) -> Fallback | None:
        """Why this step cannot replay a graph (None: it can)."""
        if self.failed:
            return Fallback.CAPTURE_FAILED
        if batch.num_prefill_tokens or batch.decode_block_tables is None:
            return Fallback.PREFILL
        if token_ids.shape[0] > self.sizes[-1]:
            return Fallback.BATCH_TOO_LARGE
        if batch.decode_block_tables.shape[1] > self.max_blocks:
            return Fallback.CONTEXT_TOO_LONG
        return None

    def clear(self) -> None:
        """Drop every graph and the static buffers (their memory returns to torch)."""
        self.graphs.clear()
        self.inputs = None
        self.key = None

    @torch.inference_mode()
    def forward(
        self, model: Model, token_ids: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """``model.forward``'s logits of this step, from a graph when the step allows it."""
        why = self.fallback(token_ids, batch)
        if why is not None:
            self.stats[why.value] += 1
            return model.forward(token_ids, batch, kv_cache)
        key = GraphKey.of(model, kv_cache)
        if key != self.key:
            if self.key is not None:
                log.info("cuda_graphs_invalidated", graphs=len(self.graphs), reason="new cache or weights")
            self.clear()
            self.key = key
            self.inputs = StaticInputs.allocate(self.sizes[-1], self.max_blocks, kv_cache.device)
        assert self.inputs is not None
        n = token_ids.shape[0]
        size = bucket_for(n, self.sizes)
        assert size is not None  # fallback() checked n <= the largest size
        graph = self.graphs.get(size)
        if graph is None:
            graph = self._capture(size, model, kv_cache)
            if graph is None:
                self.stats[Fallback.CAPTURE_FAILED.value] += 1
                return model.forward(token_ids, batch, kv_cache)
        self.inputs.fill(token_ids, batch)
        graph.graph.replay()
        self.stats["replayed"] += 1
        # The graph's logits are the rows' in token order; a verification step's indices reorder them.
        logits = graph.logits[:n]
        return logits if batch.logits_in_order else logits.index_select(0, batch.logits_indices)

    def _capture(self, size: int, model: Model, kv_cache: torch.Tensor) -> _Graph | None:
        inputs = self.inputs
        assert inputs is not None
        inputs.pad_from(0)  # the warm-up runs for real: all padding, so it writes no KV
        tokens, batch = inputs.view(size)
        t0 = time.perf_counter()
        try:
            graph, logits = self.backend.capture(lambda: model.forward(tokens, batch, kv_cache))
        except Exception as e:  # noqa: BLE001 - any failure: eager from now on, said once
            self.failed = True
            self.clear()
            log.warning(
                "cuda_graph_capture_failed",
                size=size,
                error=f"{type(e).__name__}: {e}",
                fallback="eager for every later step of this runner",
            )
            return None
        self.graphs[size] = _Graph(graph, logits)
        self.stats["captured"] += 1
        log.info(
            "cuda_graph_captured",
            size=size,
            max_blocks=self.max_blocks,
            seconds=round(time.perf_counter() - t0, 3),  # warm-up (Triton compiles) + capture
        )
        return self.graphs[size]


def max_blocks_for(max_context: int, block_size: int, num_gpu_blocks: int) -> int:
    """Block-table width of the graphs: enough for ``max_context`` tokens, never more blocks than
    the cache has."""
    return max(1, min(blocks_for_tokens(max_context, block_size), num_gpu_blocks))


def for_worker(
    enabled: bool,
    max_batch: int,
    max_context: int,
    device: torch.device,
    block_size: int,
    num_gpu_blocks: int,
) -> DecodeGraphs | None:
    """A worker's decode graphs (its ``--cuda-graphs``, ``--cuda-graph-max-batch`` and
    ``--cuda-graph-max-context``): None when off or when the device is not CUDA."""
    if not enabled or device.type != "cuda":
        return None
    return DecodeGraphs(
        sizes=capture_sizes(max_batch),
        max_blocks=max_blocks_for(max_context, block_size, num_gpu_blocks),
        backend=CudaCapture(device),
    )
