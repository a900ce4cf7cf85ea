"""One worker step: validate, run the cache ops, assemble the batch, forward, sample.

This module turns per-sequence requests (new tokens, block table, cached length) into the flat
tensors the paged kernels want: absolute positions, slot mapping (block_id * block_size + offset),
padded int32 block tables, ``query_start_loc`` and ``seq_lens``. Prefill sequences (more than one new
token) are laid out first and decode sequences (one token) after them, so the model can hand each
group to its kernel as a contiguous slice, while results come back in request order.

It has no gRPC in it: the servicer translates messages to these dataclasses and back, and maps
``InvalidStep`` to INVALID_ARGUMENT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv import kernels
from pagedkv.arith import ceil_div
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup
from pagedkv.defaults import MAX_DECODE_STEPS
from pagedkv.kernels import quant
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.worker_svc import omp_spin
from pagedkv.worker_svc.devices import device_scope
from pagedkv.worker_svc.model.batch import AttentionBatch
from pagedkv.worker_svc.model.cuda_graphs import DecodeGraphs
from pagedkv.worker_svc.model.kv_layout import KVLayout, kv_layout
from pagedkv.worker_svc.model.registry import Model
from pagedkv.worker_svc.model.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    Scored,
    TokenHistory,
    accept_proposals,
    sample,
    sampling_knob_error,
    score_tokens,
)


class InvalidStep(ValueError):
    """The step request is inconsistent (bad ids, too short a block table...); nothing was run."""


class RunnerClosed(RuntimeError):
    """The runner was closed (the worker is shutting down and its cache mapping is gone)."""


@dataclass(slots=True)
class SequenceRequest:
    seq_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_cached_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logits: bool = False
    # n > 1: the forked samples' parameters; each draws one token from this sequence's last position.
    fork_sampling: list[SamplingParams] = field(default_factory=list)
    # The token history the penalties need (sent only when the sampling sets one); forks share it.
    history: TokenHistory | None = None
    # Grammar-constrained decoding: the tokens this step may choose (bitmask; b"" = any); forks too.
    allowed_token_mask: bytes = b""
    # Multi-step decode: decode steps to run in this call, each next one on the token the last one
    # drew (1 = one); they stop early after drawing one of ``stop_token_ids``.
    decode_steps: int = 1
    stop_token_ids: frozenset[int] = frozenset()
    # Speculative decoding: the last ``num_proposed`` of ``token_ids`` are proposed tokens to verify
    # in this one pass (accept_proposals); the result is the accepted ones and the next token.
    num_proposed: int = 0
    # Speculative decoding with the runner's draft model: ``token_ids`` is the one last token; the
    # draft proposes up to ``num_draft`` tokens after it, which are then verified as proposals are.
    num_draft: int = 0
    # KV-cache groups 1..'s tables (worker_svc/model/kv_layout.py), each (first block index, live
    # block ids): entries before the first index fell out of a window group's window (-1 here).
    group_tables: list[tuple[int, list[int]]] = field(default_factory=list)
    # vLLM's prompt_logprobs: score the prompt's tokens at this step's positions, each with this many
    # most likely tokens (None: no row but the last is computed). Position j scores token_ids[j + 1];
    # the last position scores ``next_prompt_token`` (a chunk before the prompt's last), if given.
    prompt_logprobs: int | None = None
    next_prompt_token: int | None = None

    def group_table(self, g: int) -> list[int]:
        """Group ``g``'s table at full width, -1 before its first live block (group 0: block_ids)."""
        if not g:
            return self.block_ids
        first, ids = self.group_tables[g - 1]
        return [-1] * first + ids if first else ids

    @property
    def seq_len(self) -> int:
        """Tokens in the cache after this step's tokens are written."""
        return self.num_cached_tokens + len(self.token_ids)

    @property
    def end(self) -> int:
        """Tokens in the cache after every position this step may write (its further decode
        steps', its draft proposals')."""
        return self.num_cached_tokens + max(len(self.token_ids), self.decode_steps, 1 + self.num_draft)

    @property
    def prompt_targets(self) -> list[int]:
        """The prompt tokens this step scores, one per position from the first (prompt_logprobs)."""
        if self.prompt_logprobs is None:
            return []
        nxt = [] if self.next_prompt_token is None else [self.next_prompt_token]
        return self.token_ids[1:] + nxt


@dataclass(slots=True)
class CacheOpsRequest:
    """Block moves to run before the forward pass, in the order swap_out, copies, swap_in."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, gpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.copies or self.swap_in)


@dataclass(slots=True)
class Drawn:
    """A token drawn for one sample of a position, with what the request asked to know about it."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), most likely first


@dataclass(slots=True)
class SequenceResult:
    seq_id: str
    token_id: int
    logprob: float
    logits: torch.Tensor | None = None  # fp32 [vocab] on CPU, when asked for
    fork_samples: list[Drawn] = field(default_factory=list)  # one per SequenceRequest.fork_sampling
    top: list[tuple[int, float]] = field(default_factory=list)  # sampling.num_top_logprobs (token, logprob)
    next_samples: list[Drawn] = field(default_factory=list)  # decode_steps > 1: the later steps' tokens
    # num_proposed > 0: how many proposals were accepted; token_id and next_samples are then those
    # proposals followed by the target's own next token (num_accepted + 1 tokens in all).
    num_accepted: int = 0
    num_drafted: int = 0  # num_draft > 0: how many tokens the draft model proposed
    prompt_logprobs: list[Scored] = field(default_factory=list)  # one per SequenceRequest.prompt_targets


@dataclass(slots=True)
class StepResult:
    outputs: list[SequenceResult]
    num_tokens: int
    cache_ops_ms: float
    forward_ms: float


class _StepClock:
    """The step's two phases (cache ops, forward + sampling), timed without adding a sync.

    On CUDA: events recorded on the current stream, read once the step's last event completed
    (``done`` waits for it, which is also what makes a step of cache ops only visible to other
    processes before the reply). On CPU: the host clock."""

    __slots__ = ("_device", "_cuda", "_marks")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._marks: list[object] = []
        self.mark()

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def done(self) -> tuple[float, float]:
        """(cache ops ms, forward ms)."""
        self.mark()
        m = self._marks
        if self._cuda:
            m[-1].synchronize()  # type: ignore[attr-defined]
            return m[0].elapsed_time(m[1]), m[1].elapsed_time(m[2])  # type: ignore[attr-defined]
        return (m[1] - m[0]) * 1e3, (m[2] - m[1]) * 1e3  # type: ignore[operator]


def _block_major(cache: torch.Tensor) -> torch.Tensor:
    """View ``[L, 2, N, ...]`` as ``[N, L, 2, ...]`` (no copy) so one swap call moves all layers."""
    return cache.permute(2, 0, 1, 3, 4, 5)


class ModelRunner:
    """Owns the model and the views of the shared cache; runs one step at a time (thread-safe)."""

    def __init__(
        self,
        model: Model,
        gpu_cache: torch.Tensor,
        cpu_cache: torch.Tensor,
        kernel_backend: str | None = None,
        decode_graphs: DecodeGraphs | None = None,
        kv_groups: tuple[KVGroup, ...] = ONE_GROUP,
        draft: Model | None = None,
        draft_gpu_cache: torch.Tensor | None = None,
        draft_cpu_cache: torch.Tensor | None = None,
    ) -> None:
        """``kernel_backend``: the kernel backend of this runner's steps ("auto", "reference", "cpu",
        "triton"; a worker's ``--kernel-backend``), applied as a ``pagedkv.kernels.use_backend`` override
        around each step, so it never leaks to other runners in the process. None: the environment
        variable PAGEDKV_KERNEL_BACKEND, else "auto" (kernels/dispatch.py).

        ``decode_graphs``: replay decode steps' forward passes from CUDA graphs
        (``worker_svc/model/cuda_graphs.py``); None: every step runs eagerly.

        ``kv_groups``: the pool's KV-cache groups (the block manager's ``--kv-groups``): one full
        group (every layer in every block, one table) or the model's own (kv_layout.py); the
        cache's first dimension is then the layers of one group.

        ``draft``: speculative decoding's draft model (``--speculative-model``), with its own cache
        tensors indexed by the same block ids (``CacheGeometry.draft_shape``): every forward pass
        writes the draft's KV of the same positions as the model's (so a block's draft KV is
        always there, whoever computed it, prefix hits and forks included), and a sequence asking
        for ``num_draft`` tokens gets them proposed by the draft and verified in the same step."""
        cfg = model.cfg
        self.layout: KVLayout = kv_layout(cfg, kv_groups)
        slots = self.layout.layers_per_block
        if kernel_backend is not None and kernel_backend not in kernels.BACKENDS:
            raise ValueError(f"unknown kernel backend {kernel_backend!r}; expected one of {kernels.BACKENDS}")
        if gpu_cache.dim() != 6 or gpu_cache.shape[0] != slots or gpu_cache.shape[1] != 2:
            raise ValueError(f"KV cache shape {tuple(gpu_cache.shape)} is not [num_layers={slots}, 2, ...]")
        if self.layout.grouped:
            if not hasattr(model, "kv_layout"):
                raise ValueError(f"model {cfg.name} ({cfg.architecture}) does not run KV-cache groups")
            model.kv_layout = self.layout
            decode_graphs = None  # graphs capture one table per step
        if (gpu_cache.shape[4], quant.head_dim(gpu_cache)) != (cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"KV cache heads/head_dim {(gpu_cache.shape[4], quant.head_dim(gpu_cache))} != model's "
                f"({cfg.num_kv_heads}, {cfg.head_dim})"
            )
        if gpu_cache.dtype != model.dtype and not quant.is_quantized(gpu_cache):  # 8-bit KV: any model dtype
            raise ValueError(f"KV cache dtype {gpu_cache.dtype} != model dtype {model.dtype}")
        self.model = model
        self.gpu_cache = gpu_cache
        self.cpu_cache = cpu_cache
        self.draft = draft
        self.draft_gpu_cache = draft_gpu_cache
        self.draft_cpu_cache = draft_cpu_cache
        if draft is not None:
            self._check_draft_cache(draft, gpu_cache, draft_gpu_cache, draft_cpu_cache, cpu_cache)
        self.num_gpu_blocks = int(gpu_cache.shape[2])
        self.block_size = int(gpu_cache.shape[3])
        self.num_cpu_blocks = int(cpu_cache.shape[2]) if cpu_cache.dim() == 6 else 0
        self.device = gpu_cache.device
        self.kernel_backend = kernel_backend
        self.decode_graphs = decode_graphs
        self._lock = threading.Lock()
        self._closed = False
        if self.device.type == "cpu":
            cpu_native.library()  # choose and load the CPU kernels' variant now, not in the first step

    @staticmethod
    def _check_draft_cache(
        draft: Model,
        gpu: torch.Tensor,
        draft_gpu: torch.Tensor | None,
        draft_cpu: torch.Tensor | None,
        cpu: torch.Tensor,
    ) -> None:
        """The draft's caches hold its layers, KV heads and head_dim over the model cache's blocks."""
        if draft_gpu is None or draft_cpu is None:
            raise ValueError(f"draft model {draft.cfg.name} has no KV cache (the cache host has no draft)")
        c = draft.cfg
        want = (c.num_layers, 2, gpu.shape[2], gpu.shape[3], c.num_kv_heads)
        if tuple(draft_gpu.shape[:5]) != want or quant.head_dim(draft_gpu) != c.head_dim:
            raise ValueError(
                f"draft KV cache shape {tuple(draft_gpu.shape)} does not fit draft model {c.name}: "
                f"expected {want} and head_dim {c.head_dim}"
            )
        if cpu.dim() == 6 and draft_cpu.shape[2] != cpu.shape[2]:
            raise ValueError(f"draft swap pool has {draft_cpu.shape[2]} blocks, the model's {cpu.shape[2]}")
        if draft_gpu.dtype != draft.dtype and not quant.is_quantized(draft_gpu):
            raise ValueError(f"draft KV cache dtype {draft_gpu.dtype} != draft model dtype {draft.dtype}")

    def close(self, release: Callable[[], None] | None = None) -> None:
        """Wait for the step in flight, refuse later ones, drop the cache views, then ``release()``.

        Why under the lock: a step still running when the worker unmaps its (IPC or shared-memory)
        cache would touch unmapped memory. ``release`` (e.g. ``SharedCache.close``) runs while the
        lock is held, so no step can start between the views being dropped and the unmapping.
        """
        with self._lock:
            self._closed = True
            if self.decode_graphs is not None:  # they hold the cache's addresses: never replay them
                self.decode_graphs.clear()
            self.gpu_cache = self.cpu_cache = torch.empty(0)
            self.draft_gpu_cache = self.draft_cpu_cache = None
            if release is not None:
                release()

    # ---------------------------------------------------------------- validation
    def validate(self, seqs: Sequence[SequenceRequest], ops: CacheOpsRequest) -> None:
        vocab = self.model.cfg.vocab_size
        seen: set[str] = set()
        for i, s in enumerate(seqs):
            where = f"sequences[{i}] ({s.seq_id!r})"
            if s.seq_id in seen:
                raise InvalidStep(f"{where}: seq_id appears twice in one step")
            seen.add(s.seq_id)
            if not s.token_ids:
                raise InvalidStep(f"{where}: no new token ids")
            if max(s.token_ids) >= vocab:
                raise InvalidStep(f"{where}: token id {max(s.token_ids)} >= vocab_size {vocab}")
            tokens = s.end if s.num_draft else s.seq_len  # (decode steps: checked with their own)
            need = blocks_for_tokens(tokens, self.block_size)
            if len(s.block_ids) < need:
                raise InvalidStep(
                    f"{where}: {tokens} tokens need {need} blocks of {self.block_size}, "
                    f"block table has {len(s.block_ids)}"
                )
            if len(s.group_tables) != len(self.layout.groups) - 1:
                raise InvalidStep(
                    f"{where}: {len(s.group_tables)} group tables, the pool has "
                    f"{len(self.layout.groups)} KV-cache groups"
                )
            if s.group_tables:
                self._check_group_tables(where, s)
            if s.num_proposed:
                self._check_proposals(where, s)
            if s.num_draft:
                self._check_draft(where, s)
            if s.decode_steps != 1:
                self._check_decode_steps(where, s)
                need = blocks_for_tokens(s.end, self.block_size)
            bad = [b for b in s.block_ids[:need] if b >= self.num_gpu_blocks]
            if bad:
                raise InvalidStep(f"{where}: block id {bad[0]} >= num_gpu_blocks {self.num_gpu_blocks}")
            for j, p in enumerate([s.sampling, *s.fork_sampling]):
                what = "sampling" if j == 0 else f"fork_sampling[{j - 1}]"
                if p.temperature < 0 or not 0.0 <= p.top_p <= 1.0 or p.top_k < 0:
                    raise InvalidStep(f"{where}: bad {what} params {p}")
                if not 0 <= p.num_top_logprobs <= MAX_TOP_LOGPROBS:
                    raise InvalidStep(
                        f"{where}: {what}.num_top_logprobs {p.num_top_logprobs} is over {MAX_TOP_LOGPROBS}"
                    )
                bad_knob = sampling_knob_error(p, vocab)
                if bad_knob:
                    raise InvalidStep(f"{where}: {what}.{bad_knob}")
            if s.allowed_token_mask:
                want = 4 * ceil_div(vocab, 32)  # one bit per token, in 32-bit words
                if len(s.allowed_token_mask) != want:
                    raise InvalidStep(
                        f"{where}: allowed_token_mask has {len(s.allowed_token_mask)} bytes, "
                        f"the vocabulary of {vocab} needs {want}"
                    )
                if not any(s.allowed_token_mask):
                    raise InvalidStep(f"{where}: allowed_token_mask allows no token")
            if s.prompt_logprobs is not None or s.next_prompt_token is not None:
                self._check_prompt_logprobs(where, s)
            if s.history is not None:
                ids = [*s.history.output_ids, *s.history.prompt_ids]
                if ids and max(ids) >= vocab:
                    raise InvalidStep(f"{where}: history token id {max(ids)} >= vocab_size {vocab}")
                if len(set(s.history.output_ids)) != len(s.history.output_ids):
                    raise InvalidStep(f"{where}: output_token_ids repeats a token")
                if any(c < 1 for c in s.history.output_counts):
                    raise InvalidStep(f"{where}: output_token_counts must be >= 1")
        self._check_pairs("ops.swap_out", ops.swap_out, self.num_gpu_blocks, self.num_cpu_blocks)
        self._check_pairs("ops.copies", ops.copies, self.num_gpu_blocks, self.num_gpu_blocks)
        sources = {s for s, _ in ops.copies}
        if any(d in sources for _, d in ops.copies):  # all copies run at once, in parallel
            raise InvalidStep("ops.copies: a destination block is also a source")
        self._check_pairs("ops.swap_in", ops.swap_in, self.num_cpu_blocks, self.num_gpu_blocks)

    def _check_group_tables(self, where: str, s: SequenceRequest) -> None:
        """Each group's table covers the step's tokens, and a window group's first live block is
        no later than the first one the step's first query reads (kernels: its window's start)."""
        bs = self.block_size
        end = s.end
        need = blocks_for_tokens(end, bs)
        for g, (first, ids) in enumerate(s.group_tables, start=1):
            group = self.layout.groups[g]
            if first + len(ids) < need:
                raise InvalidStep(
                    f"{where}: group {g}: {end} tokens need {need} blocks of {bs}, its table has "
                    f"{first + len(ids)}"
                )
            if first > group.first_live(s.num_cached_tokens, bs):
                raise InvalidStep(
                    f"{where}: group {g}'s table starts at block {first}, its window at position "
                    f"{s.num_cached_tokens} starts in block {group.first_live(s.num_cached_tokens, bs)}"
                )
            bad = [b for b in ids[: need - first] if b >= self.num_gpu_blocks]
            if bad:
                raise InvalidStep(
                    f"{where}: group {g}: block id {bad[0]} >= num_gpu_blocks {self.num_gpu_blocks}"
                )

    def _check_prompt_logprobs(self, where: str, s: SequenceRequest) -> None:
        """As many alternatives as ``logprobs`` allows, and a next token only to score."""
        if s.prompt_logprobs is None:
            raise InvalidStep(f"{where}: next_prompt_token_id without prompt_logprobs")
        if not 0 <= s.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidStep(f"{where}: prompt_logprobs {s.prompt_logprobs} is over {MAX_TOP_LOGPROBS}")
        vocab = self.model.cfg.vocab_size
        if s.next_prompt_token is not None and s.next_prompt_token >= vocab:
            raise InvalidStep(f"{where}: next_prompt_token_id {s.next_prompt_token} >= vocab_size {vocab}")

    def _check_proposals(self, where: str, s: SequenceRequest) -> None:
        """Verification samples every proposed position with the same parameters, so (like
        multi-step decode) it runs only on what the worker knows."""
        if not 1 <= s.num_proposed < len(s.token_ids) or s.num_proposed > MAX_DECODE_STEPS:
            raise InvalidStep(
                f"{where}: num_proposed_tokens {s.num_proposed} must be in [1, {MAX_DECODE_STEPS}] "
                f"and less than the {len(s.token_ids)} new tokens"
            )
        if s.decode_steps != 1:
            raise InvalidStep(f"{where}: num_proposed_tokens cannot be combined with decode_steps")
        why = self._engine_state(s)
        if why:
            raise InvalidStep(f"{where}: num_proposed_tokens cannot be combined with {why}")

    def _check_draft(self, where: str, s: SequenceRequest) -> None:
        """Draft proposals: a draft model here, one new token, and (as verification) only what the
        worker knows."""
        if self.draft is None:
            raise InvalidStep(
                f"{where}: num_draft_tokens, but this worker has no draft model (--speculative-model)"
            )
        if not 1 <= s.num_draft <= MAX_DECODE_STEPS:
            raise InvalidStep(f"{where}: num_draft_tokens {s.num_draft} is not in [1, {MAX_DECODE_STEPS}]")
        if len(s.token_ids) != 1:
            raise InvalidStep(f"{where}: num_draft_tokens needs one new token, got {len(s.token_ids)}")
        if s.num_proposed or s.decode_steps != 1:
            raise InvalidStep(
                f"{where}: num_draft_tokens cannot be combined with num_proposed_tokens or decode_steps"
            )
        why = self._engine_state(s)
        if why:
            raise InvalidStep(f"{where}: num_draft_tokens cannot be combined with {why}")

    @staticmethod
    def _engine_state(s: SequenceRequest) -> str:
        """What in ``s`` changes with every token in a way only the engine knows, or asks for more
        than each position's drawn token ("" = nothing)."""
        return (
            "prompt_logprobs"
            if s.prompt_logprobs is not None
            else "return_logits"
            if s.return_logits
            else "fork_sampling"
            if s.fork_sampling
            else "a token history (penalties)"
            if s.history is not None
            else "an allowed_token_mask"
            if s.allowed_token_mask
            else ""
        )

    def _check_decode_steps(self, where: str, s: SequenceRequest) -> None:
        """Multi-step decode runs on what the worker knows: a sequence whose sampling needs state only
        the engine updates (logits to return, forks, penalties' history, a grammar's mask) cannot."""
        if not 1 <= s.decode_steps <= MAX_DECODE_STEPS:
            raise InvalidStep(f"{where}: decode_steps {s.decode_steps} is not in [1, {MAX_DECODE_STEPS}]")
        if len(s.token_ids) != 1:
            raise InvalidStep(
                f"{where}: decode_steps {s.decode_steps} needs one new token, got {len(s.token_ids)}"
            )
        why = self._engine_state(s)
        if why:
            raise InvalidStep(f"{where}: decode_steps {s.decode_steps} cannot be combined with {why}")
        end = s.num_cached_tokens + s.decode_steps
        if len(s.block_ids) * self.block_size < end:
            raise InvalidStep(
                f"{where}: {s.decode_steps} decode steps write up to {end} tokens, its "
                f"{len(s.block_ids)} blocks of {self.block_size} hold {len(s.block_ids) * self.block_size}"
            )

    @staticmethod
    def _check_pairs(name: str, pairs: list[tuple[int, int]], n_src: int, n_dst: int) -> None:
        for j, (s, d) in enumerate(pairs):
            if s >= n_src or d >= n_dst:
                raise InvalidStep(f"{name}[{j}] = ({s}, {d}) out of range (src < {n_src}, dst < {n_dst})")
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise InvalidStep(f"{name}: a destination block appears twice")

    # ---------------------------------------------------------------- cache ops
    def run_cache_ops(self, ops: CacheOpsRequest) -> None:
        """swap-out, copies, swap-in: each one batched call covering all layers, K and V (the draft
        model's cache's too: its block b goes wherever the model's block b goes)."""
        caches = [(self.gpu_cache, self.cpu_cache)]
        if self.draft_gpu_cache is not None and self.draft_cpu_cache is not None:
            caches.append((self.draft_gpu_cache, self.draft_cpu_cache))
        # Built on the host: copy_blocks checks "destinations distinct, not also sources" there (on
        # the device it could not without a sync) and moves the pairs itself.
        swap_out, copies, swap_in = (
            torch.tensor(p, dtype=torch.int64) if p else None for p in (ops.swap_out, ops.copies, ops.swap_in)
        )
        for gpu, cpu in caches:
            if swap_out is not None:
                kernels.swap_blocks(_block_major(gpu), _block_major(cpu), swap_out)
            if copies is not None:
                layers = range(gpu.shape[0])  # the slots of a block: every group's the same
                kernels.copy_blocks([gpu[i, 0] for i in layers], [gpu[i, 1] for i in layers], copies)
            if swap_in is not None:
                kernels.swap_blocks(_block_major(cpu), _block_major(gpu), swap_in)

    # ---------------------------------------------------------------- batch assembly
    def build_batch(
        self, seqs: Sequence[SequenceRequest], grouped: bool = True
    ) -> tuple[torch.Tensor, AttentionBatch]:
        """Flat token ids and the attention metadata. The flat layout puts prefill sequences first,
        then the decode rows; ``logits_indices`` follows the requests' order, so logits row i is
        ``seqs[i]``'s (the output layer reorders its few hidden rows instead of the step reordering
        ``[num_seqs, vocab]``). Rows after those are the proposed positions of verifying sequences
        (``num_proposed``), in request order: for each, the rows of the positions before its last
        one. Then, in request order, the rows of the positions that score prompt tokens
        (``prompt_targets``, only for a sequence that asked: prompt logprobs). With several KV-cache
        groups, ``batch.groups`` holds groups 1..'s slots and tables (same tokens);
        ``grouped=False``: group 0's alone (the draft model's steps: its cache has group 0's table).

        A verifying sequence's new tokens are decode rows, one each, every one a decode query over
        the context up to and including its own position (its K/V and the ones before it are
        written before attention reads them), not a prefill chunk: that is exactly the computation
        plain decoding makes at each of those positions (the decode attention kernel, and the
        linear layers' one-row arithmetic, llama.py), so the greedy tokens verification keeps are
        plain decoding's to the bit."""
        bs = self.block_size
        pre_idx = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1 and not s.num_proposed]
        dec_idx = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 or s.num_proposed]
        order = pre_idx + dec_idx
        tokens: list[int] = []
        positions: list[int] = []
        last = [0] * len(seqs)  # flat index of each sequence's last new token
        for i in order:
            s = seqs[i]
            positions.extend(range(s.num_cached_tokens, s.seq_len))
            tokens.extend(s.token_ids)
            last[i] = len(tokens) - 1
        n_prefill_tokens = sum(len(seqs[i].token_ids) for i in pre_idx)
        # The decode rows: (sequence, context length through the row's own token).
        dec_rows = [
            (i, n) for i in dec_idx for n in range(seqs[i].num_cached_tokens + 1, seqs[i].seq_len + 1)
        ]
        dev = self.device
        qsl = [0]
        for i in pre_idx:
            qsl.append(qsl[-1] + len(seqs[i].token_ids))
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        verifying = any(s.num_proposed for s in seqs)
        logits_indices = torch.tensor(
            last
            + [last[i] - s.num_proposed + j for i, s in enumerate(seqs) for j in range(s.num_proposed)]
            + [
                last[i] - len(s.token_ids) + 1 + j
                for i, s in enumerate(seqs)
                for j in range(len(s.prompt_targets))
            ],
            dtype=torch.int64,
            device=dev,
        )
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=dev) if pre_idx else None
        pre_lens = (
            torch.tensor([seqs[i].seq_len for i in pre_idx], dtype=torch.int32, device=dev)
            if pre_idx
            else None
        )
        dec_lens = torch.tensor([n for _, n in dec_rows], dtype=torch.int32, device=dev) if dec_rows else None

        def group_batch(g: int) -> AttentionBatch:
            rows = {i: seqs[i].group_table(g) for i in order}
            slots: list[int] = []
            for i in order:
                s, table = seqs[i], rows[i]
                slots.extend(
                    table[pos // bs] * bs + pos % bs for pos in range(s.num_cached_tokens, s.seq_len)
                )

            def tables(idx: list[tuple[int, int]]) -> torch.Tensor:
                """One table row per (sequence, context length), as wide as the longest needs."""
                width = max(blocks_for_tokens(n, bs) for _, n in idx)
                padded = [rows[i][:width] + [0] * (width - min(width, len(rows[i]))) for i, _ in idx]
                return torch.tensor(padded, dtype=torch.int32, device=dev)

            window = self.layout.groups[g].window_tokens or None
            return AttentionBatch(
                positions=positions_t,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                logits_indices=logits_indices,
                num_prefill_tokens=n_prefill_tokens,
                prefill_block_tables=tables([(i, seqs[i].seq_len) for i in pre_idx]) if pre_idx else None,
                prefill_query_start_loc=qsl_t,
                prefill_seq_lens=pre_lens,
                decode_block_tables=tables(dec_rows) if dec_rows else None,
                decode_seq_lens=dec_lens,
                prefill_max_query_len=max((len(seqs[i].token_ids) for i in pre_idx), default=0),
                sliding_window=window if g else None,
                logits_in_order=not verifying,
            )

        batch = group_batch(0)
        if self.layout.grouped and grouped:
            batch.groups = tuple(group_batch(g) for g in range(1, len(self.layout.groups)))
        token_tensor = torch.tensor(tokens, dtype=torch.int64, device=dev)
        return token_tensor, batch

    def _forward_and_sample(
        self, seqs: Sequence[SequenceRequest], drafted: Sequence[bool] = ()
    ) -> list[SequenceResult]:
        """One forward pass over ``seqs`` and their samples (the step's work; the caller holds the
        lock). With a draft model, its KV of the same positions, but for the sequences ``drafted``
        marks (their proposals' draft KV is written: ``_draft_proposals``)."""
        outputs: list[SequenceResult] = []
        token_tensor, batch = self.build_batch(seqs)
        num_prompt_rows = sum(len(s.prompt_targets) for s in seqs)
        # A graph computes one row per sequence: a step that scores a prompt runs eagerly.
        if self.decode_graphs is not None and not num_prompt_rows:
            logits = self.decode_graphs.forward(self.model, token_tensor, batch, self.gpu_cache)
        else:
            logits = self.model.forward(token_tensor, batch, self.gpu_cache)  # row i: seqs[i]
        if self.draft is not None:
            rest = [s for s, d in zip(seqs, drafted or [False] * len(seqs), strict=True) if not d]
            if rest:  # all of them: the model's batch is theirs
                self._draft_kv(rest, (token_tensor, batch) if len(rest) == len(seqs) else None)
        # The rows after the sequences' own (build_batch): proposed positions, then prompt positions.
        prompt_rows = logits[logits.shape[0] - num_prompt_rows :]
        logits = logits[: logits.shape[0] - num_prompt_rows]
        proposed_rows = None
        if logits.shape[0] > len(seqs):  # verifying sequences' proposed positions (build_batch)
            logits, proposed_rows = logits[: len(seqs)], logits[len(seqs) :]
        # Forked samples draw from their parent's row: one sample() call over all rows.
        fork_rows = [i for i, s in enumerate(seqs) for _ in s.fork_sampling]
        rows_sampled = (
            logits.index_select(0, torch.tensor(list(range(len(seqs))) + fork_rows, device=logits.device))
            if fork_rows
            else logits
        )
        result = sample(
            rows_sampled,
            [s.sampling for s in seqs] + [p for s in seqs for p in s.fork_sampling],
            [s.seq_len for s in seqs] + [seqs[i].seq_len for i in fork_rows],
            [s.history for s in seqs] + [seqs[i].history for i in fork_rows],
            [s.allowed_token_mask for s in seqs] + [seqs[i].allowed_token_mask for i in fork_rows],
        )
        token_ids, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        want_logits = any(s.return_logits for s in seqs)
        logits_cpu = logits.cpu() if want_logits else None
        k = len(seqs)
        for i, s in enumerate(seqs):
            n = len(s.fork_sampling)
            outputs.append(
                SequenceResult(
                    seq_id=s.seq_id,
                    token_id=int(token_ids[i]),
                    logprob=float(logprobs[i]),
                    logits=logits_cpu[i] if (logits_cpu is not None and s.return_logits) else None,
                    fork_samples=[
                        Drawn(int(token_ids[j]), float(logprobs[j]), result.top[j]) for j in range(k, k + n)
                    ],
                    top=result.top[i],
                )
            )
            k += n
        if proposed_rows is not None:
            self._verify(seqs, proposed_rows, outputs)
        if num_prompt_rows:
            r = 0
            for s, o in zip(seqs, outputs, strict=True):
                targets = s.prompt_targets
                if s.prompt_logprobs is not None:
                    rows = prompt_rows[r : r + len(targets)]
                    o.prompt_logprobs = score_tokens(rows, targets, s.prompt_logprobs)
                r += len(targets)
        return outputs

    def _verify(
        self, seqs: Sequence[SequenceRequest], rows: torch.Tensor, outputs: list[SequenceResult]
    ) -> None:
        """Speculative decoding: draw the target's own token at every proposed position (row j of a
        sequence with k proposals is the position after new token j, drawn at the position plain
        decoding would draw it), keep the longest prefix of proposals it agrees with
        (sampling.accept_proposals), and make each verifying output those proposals followed by the
        target's next token. The last position's token, drawn with everything else, is that next
        token when every proposal is kept."""
        verifying = [i for i, s in enumerate(seqs) if s.num_proposed]
        positions = [
            seqs[i].num_cached_tokens + len(seqs[i].token_ids) - seqs[i].num_proposed + j
            for i in verifying
            for j in range(seqs[i].num_proposed)
        ]
        drawn = sample(
            rows, [seqs[i].sampling for i in verifying for _ in range(seqs[i].num_proposed)], positions
        )
        tokens, logprobs = drawn.token_ids.tolist(), drawn.logprobs.tolist()
        r = 0
        for i in verifying:
            s, o = seqs[i], outputs[i]
            k = s.num_proposed
            mine = [Drawn(int(tokens[r + j]), float(logprobs[r + j]), drawn.top[r + j]) for j in range(k)]
            mine.append(Drawn(o.token_id, o.logprob, o.top))
            r += k
            accepted = accept_proposals(s.token_ids[-k:], [d.token_id for d in mine])
            kept = mine[: accepted + 1]
            o.token_id, o.logprob, o.top = kept[0].token_id, kept[0].logprob, kept[0].top
            o.next_samples = kept[1:]
            o.num_accepted = accepted

    def _draft_kv(
        self, seqs: Sequence[SequenceRequest], built: tuple[torch.Tensor, AttentionBatch] | None = None
    ) -> None:
        """The draft model's KV of ``seqs``' new tokens (no output layer); ``built``: their batch,
        when the model's forward pass already built it."""
        assert self.draft is not None and self.draft_gpu_cache is not None
        token_tensor, batch = built or self.build_batch(seqs, grouped=False)
        kv_only = dataclasses.replace(batch, logits_indices=batch.logits_indices[:0], groups=())
        self.draft.forward(token_tensor, kv_only, self.draft_gpu_cache)

    def _draft_proposals(self, seqs: Sequence[SequenceRequest]) -> list[SequenceRequest]:
        """Speculative decoding with the draft model: for every sequence asking ``num_draft``
        tokens, the draft's one-row steps from its last token, each on the token the last one
        proposed (greedy: the draft's most likely token; a stop token ends the proposal), all such
        sequences batched per step. Returns ``seqs`` with those sequences as verifications of their
        proposals (``num_proposed``), which the step's forward pass then checks. Greedy proposals
        are a deterministic proposer's, so the verification keeps the target's distribution (its
        own draw at each position decides). The draft's KV of every position the verification
        computes is written here: one row per proposal, then the last proposal's own row (its KV
        only), so the verification's pass need not run the draft over them again."""
        assert self.draft is not None and self.draft_gpu_cache is not None
        tokens = {i: [s.token_ids[0]] for i, s in enumerate(seqs) if s.num_draft}

        def last_row(i: int) -> SequenceRequest:  # sequence i's last token so far, at its position
            s, toks = seqs[i], tokens[i]
            return SequenceRequest(s.seq_id, [toks[-1]], s.block_ids, s.num_cached_tokens + len(toks) - 1)

        going = list(tokens)
        for _ in range(max(seqs[i].num_draft for i in going)):
            token_tensor, ab = self.build_batch([last_row(i) for i in going], grouped=False)
            picks = self.draft.forward(token_tensor, ab, self.draft_gpu_cache).argmax(dim=-1).tolist()
            still = []
            for i, t in zip(going, picks, strict=True):
                tokens[i].append(int(t))
                if len(tokens[i]) <= seqs[i].num_draft and int(t) not in seqs[i].stop_token_ids:
                    still.append(i)
            going = still
            if not going:
                break
        self._draft_kv([last_row(i) for i in tokens])
        out = list(seqs)
        for i, toks in tokens.items():
            out[i] = dataclasses.replace(seqs[i], token_ids=toks, num_proposed=len(toks) - 1, num_draft=0)
        return out

    def _more_decode_steps(self, seqs: Sequence[SequenceRequest], outputs: list[SequenceResult]) -> None:
        """Multi-step decode (``decode_steps``): each further step feeds every sequence still going
        the token its last step drew, at the next position, until its steps are done or it drew a
        stop token. Why here: one engine round trip (block manager, step transport, the engine's own
        work) then serves several tokens; the KV and tokens are those of as many single steps."""
        last = {i: o.token_id for i, o in enumerate(outputs) if o.token_id not in seqs[i].stop_token_ids}
        for j in range(1, max(s.decode_steps for s in seqs)):
            going = [i for i in last if seqs[i].decode_steps > j]
            if not going:
                return
            batch = [
                SequenceRequest(
                    seq_id=seqs[i].seq_id,
                    token_ids=[last[i]],
                    block_ids=seqs[i].block_ids,
                    num_cached_tokens=seqs[i].num_cached_tokens + j,
                    group_tables=seqs[i].group_tables,
                    sampling=seqs[i].sampling,
                )
                for i in going
            ]
            last = {}
            for i, r in zip(going, self._forward_and_sample(batch), strict=True):
                outputs[i].next_samples.append(Drawn(r.token_id, r.logprob, r.top))
                if r.token_id not in seqs[i].stop_token_ids:
                    last[i] = r.token_id

    # ---------------------------------------------------------------- the step
    def _kernel_backend(self) -> contextlib.AbstractContextManager[None]:
        """This runner's kernel backend for the calls of one step (none: the process default)."""
        if self.kernel_backend is None:
            return contextlib.nullcontext()
        return kernels.use_backend(self.kernel_backend)  # type: ignore[arg-type]

    def step(self, seqs: Sequence[SequenceRequest], ops: CacheOpsRequest | None = None) -> StepResult:
        """Validate everything first (an invalid step changes nothing), then run it."""
        ops = ops or CacheOpsRequest()
        self.validate(seqs, ops)
        with self._lock, self._kernel_backend(), device_scope(self.device):  # steps run on gRPC pool threads
            if self._closed:
                raise RunnerClosed("the worker is shutting down")
            omp_spin.short_spin()  # no spinning helper thread between steps (worker_svc/omp_spin.py)
            clock = _StepClock(self.device)
            self.run_cache_ops(ops)
            clock.mark()
            if any(s.num_draft for s in seqs):
                drafted = self._draft_proposals(seqs)
                outputs = self._forward_and_sample(drafted, [bool(s.num_draft) for s in seqs])
                for s, d, o in zip(seqs, drafted, outputs, strict=True):
                    if s.num_draft:
                        o.num_drafted = d.num_proposed
            else:
                outputs = self._forward_and_sample(seqs) if seqs else []
            if any(s.decode_steps > 1 for s in seqs):
                self._more_decode_steps(seqs, outputs)
            # Cross-process visibility: other workers read this cache through their own CUDA
            # contexts and streams, so every cache write (cache ops and the forward's KV writes,
            # all on this stream) must be complete before the RPC replies. The sampled tokens
            # reaching the host already ensure it when there was a forward; done() ensures it for
            # a step of cache ops only.
            cache_ops_ms, forward_ms = clock.done()
        return StepResult(
            outputs=outputs,
            num_tokens=sum(len(s.token_ids) for s in seqs)
            + sum(
                len(o.next_samples)
                for s, o in zip(seqs, outputs, strict=True)
                if not s.num_proposed and not s.num_draft
            )
            + sum(o.num_drafted for o in outputs),
            cache_ops_ms=cache_ops_ms,
            forward_ms=forward_ms,
        )
