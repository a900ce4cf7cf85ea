"""The CPU attention backend: paged attention without padding to the batch.

Why not the reference on CPU: it gathers every sequence's K/V up to the LONGEST context in the
batch, upcasts the whole copy to fp32 and runs two einsums with the GQA group as a tiny matrix
dimension; at 48 sequences it spends most of a decode step copying. This backend, chosen by
measurement (the attention rows of bench/vs_vllm.py's breakdown, bench/cpu_decode_bench.py;
docs/kernels.md):

- **The native kernel first** (``kernels/cpu/native.py``, small C kernels built at install): decode
  reads K/V in place from the blocks, one task per (sequence, KV head); prefill runs on the native
  prefill kernel (fp32, head_dim a multiple of 16: 16 or 32 rows of a sequence per task, both
  products as register-tiled small matrix products, so the context is read once per task rather
  than once per row as on the per-row path below) or, for bf16, on
  the decode kernel with each query row a decode query over its causal prefix, while contexts are
  short enough (``NATIVE_PREFILL_MAX_CONTEXT``). Decode sequences whose tables start with the same
  blocks (a shared system prompt) run as a native cascade when a group saves
  ``NATIVE_CASCADE_MIN_SAVED_TOKENS`` (fp32): the decode kernel over each member's own blocks with its
  log-sum-exps, then the prefill kernel over each shared prefix once, every member's query a row of
  it, merged in place (``cpu_native.cascade``). The plans below are built only when the native
  kernels are unavailable (no compiler at install, ``PAGEDKV_CPU_NATIVE=0``, an fp16 cache), when a
  non-fp32 decode batch's shared prefixes would save ``NATIVE_MAX_SAVED_TOKENS`` (their cascade
  reads a prefix once, the decode kernel once per member), or when a prefill context is longer than
  that bound.

Without it, torch's fused SDPA over gathered blocks:

- **Length buckets**: decode sequences are sorted by length and cut into buckets whose padding is
  at most ``PAD_FRACTION`` of the bucket (and at most ``MAX_BUCKET`` sequences), so the work
  follows the real context lengths, not the longest one.
- **One gather per bucket, in the cache dtype**: ``index_select`` of the bucket's blocks only, into
  buffers the step's plan keeps for all layers; no fp32 copy (SDPA accumulates in fp32 internally
  for fp16/bf16).
- **Shared prefixes once** (cascade): decode sequences whose block tables start with the same
  physical blocks (prefix-cache hits on one system prompt) attend to those blocks in one call, the
  blocks gathered once and every member's query rows stacked; each member's own part runs in the
  buckets, and the two are merged by their softmax normalisers (log-sum-exp).
- **GQA once per KV head**: the ``group`` query heads sharing a KV head are the "query rows" of one
  SDPA problem ``[seqs, kv_heads, group, head_dim]`` against ``[seqs, kv_heads, tokens, head_dim]``
  (a strided view of the gathered blocks: no transpose copy), so each K/V element is read once.
- **Prefill**: buckets of sequences with similar query chunks and contexts (``prefill_buckets``),
  one SDPA call per bucket over the gathered contexts with the same GQA folding and an
  offset-causal mask (queries are the last ``q_len`` tokens), padded rows dropped. A step after a
  burst of requests sharing a cached system prompt holds dozens of short chunks over long
  contexts; one call per sequence spent most of its time in per-call overhead.
- **KV writes**: one ``index_copy_`` per cache into its ``[slots, kv_heads, head_dim]`` view.
- **Block copies and swaps**: the reference's copy and ``kernels/swap.py``'s batched swap.

This module is the "cpu" backend of ``pagedkv.kernels.backend.KernelBackend`` (where each operation's
contract is documented once). Arguments are validated before they get here (``kernels/checks.py``);
these functions assume valid input on CPU tensors. Results match ``pagedkv.kernels.reference`` to fp32
rounding (tests/kernels/cpu/test_attention.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedkv.arith import ceil_div
from pagedkv.kernels import quant, reference
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.reference import copy_blocks
from pagedkv.kernels.swap import swap_blocks
from pagedkv.kv_capacity import blocks_for_tokens

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
    "decode_buckets",
    "prefill_buckets",
    "DecodePlan",
    "PrefillPlan",
    "plan_decode",
    "plan_buckets",
    "plan_prefill",
    "plan_prefill_buckets",
]

PAD_FRACTION = 0.25  # largest share of a decode bucket's tokens that may be padding
PREFILL_PAD_FRACTION = 0.5  # largest share of a prefill bucket's query x key work that may be padding
MAX_BUCKET = 64  # sequences per decode bucket (bounds the gather buffer)
MIN_SHARED_BLOCKS = 4  # leading blocks decode sequences must share to attend to them together
# One more SDPA call (and gather) costs about what attending to this many more padded K/V tokens
# does (bench/kernel_bench.py --cpu-decode; docs/kernels.md): a bucket may always hold this much
# padding, since splitting it off would cost more than the padding.
PAD_TOKENS = 1024
# A shared prefix is attended once (cascade) only when that saves at least this many K/V tokens
# of attention, (members - 1) x shared tokens: its own call, the log-sum-exp merge and the members'
# own parts in separate buckets cost about as much as this many tokens.
CASCADE_MIN_SAVED_TOKENS = 4096
# The native kernel (kernels/cpu/native.py) reads K/V in place and beats the buckets on chat batches
# and on moderately shared prefixes ((64 - 4) x 432 = 26K tokens the cascade would save), but once a
# step's shared prefixes would save this many tokens the buckets' cascade, which attends to each
# prefix once, is ahead (bench/cpu_decode_bench.py; docs/kernels.md, "Shared prefixes once").
NATIVE_MAX_SAVED_TOKENS = 32768
# With fp32 caches (head_dim a multiple of 16) the native kernels run the cascade themselves
# (``cpu_native.cascade``): each shared prefix once per group on the prefill kernel, merged into the
# decode kernel's own parts. A group is attended that way when it saves at least this many K/V tokens
# of per-member attention ((members - 1) x shared tokens). Below it the cascade's second call and
# thread team a layer cost more than the prefix work they save, so smaller groups run the plain
# kernel (bench/cpu_decode_bench.py and vs_vllm's workload R; docs/kernels.md, "Shared prefixes
# once", has the figures).
NATIVE_CASCADE_MIN_SAVED_TOKENS = 4096
# Prefill rows run on the native kernel (each row a decode query over its causal prefix) while
# every prefill sequence's context x head_dim stays at most this: 2,048 tokens at head_dim 64,
# 1,024 at 128, about where one KV head's context stops fitting in a core's L2. The kernel reads
# that context once per query row; past it, SDPA's tiled GEMMs win; below it the native rows are
# ahead of the buckets on nearly every shape, a burst's short chunks over a cached prompt most
# (docs/kernels.md, "Prefill on the decode kernel", has the figures).
NATIVE_PREFILL_MAX_CONTEXT = 131072
# The native prefill kernel (fp32) reads a sequence's context once per 16 or 32 rows and keeps each
# task's scores ([context, 32 x group lanes] floats per thread), so it takes contexts up to this
# many tokens (16 MB of scores per thread at group 4). It is about level with the buckets on
# chat-sized chunks and behind them on contexts of thousands of tokens, where its scores no longer
# fit in cache (bench/cpu_prefill_bench.py; docs/kernels.md, "Prefill kernel"); one bound for every
# build keeps the choice simple, and it also serves int8 caches and the cascade.
NATIVE_PREFILL_KERNEL_MAX_TOKENS = 32768


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as SDPA's additive form (0 / -inf) in the query dtype: torch's CPU
    flash kernel runs faster with it than with a boolean mask (docs/benchmarks.md, "Measurements
    behind smaller choices")."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def _slot_view(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks * block_size, kv_heads, head_dim]`` view of one layer's cache (no copy)."""
    n, bs, h, d = cache.shape
    if cache.stride(0) == bs * cache.stride(1):
        return (
            cache.view(n * bs, h, d)
            if cache.is_contiguous()
            else cache.as_strided(
                (n * bs, h, d), (cache.stride(1), cache.stride(2), cache.stride(3)), cache.storage_offset()
            )
        )
    raise ValueError("cache blocks are not laid out back to back")  # not reachable from the worker


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token i's K/V at slot ``slot_mapping[i]``; -1 skips the token. 8-bit caches quantize
    (kernels/quant.py): int8 from fp32 in the native kernel, anything else in torch (same bytes)."""
    slots = slot_mapping.to(torch.int64)
    if quant.is_quantized(key_cache):
        if (
            key_cache.dtype is torch.int8
            and key.dtype is torch.float32
            and value.dtype is torch.float32
            and key_cache.stride() == value_cache.stride()
            and cpu_native.available()
        ):
            cpu_native.write_kv_i8(key, value, key_cache, value_cache, slots)
        else:
            reference.write_kv_cache(key, value, key_cache, value_cache, slots)
        return
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if not slots.numel():
        return
    kc, vc = key_cache, value_cache
    if kc.stride(0) == kc.shape[1] * kc.stride(1) and vc.stride(0) == vc.shape[1] * vc.stride(1):
        _slot_view(kc).index_copy_(0, slots, key.to(kc.dtype))
        _slot_view(vc).index_copy_(0, slots, value.to(vc.dtype))
        return
    bs = kc.shape[1]
    kc[slots // bs, slots % bs] = key.to(kc.dtype)
    vc[slots // bs, slots % bs] = value.to(vc.dtype)


def decode_buckets(lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Group sequence indices into (indices, blocks) buckets, longest first.

    A bucket starts at its longest sequence and takes the next-longest ones while the padded
    tokens stay under ``PAD_FRACTION`` of the bucket (so no bucket is padded to the batch's longest
    context unless its sequences are all close to it).
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    buckets: list[tuple[list[int], int]] = []
    i = 0
    while i < len(order):
        nb = max(1, blocks_for_tokens(lens[order[i]], block_size))
        width = nb * block_size
        members = [order[i]]
        real = lens[order[i]]
        j = i + 1
        while j < len(order) and len(members) < MAX_BUCKET:
            cand = lens[order[j]]
            padding = width * (len(members) + 1) - (real + cand)
            if padding > max(PAD_FRACTION * width * (len(members) + 1), PAD_TOKENS):
                break
            members.append(order[j])
            real += cand
            j += 1
        buckets.append((members, nb))
        i = j
    return buckets


@dataclass(slots=True)
class _Bucket:
    idx: torch.Tensor  # int64 [b]: rows of the batch in this bucket
    ids: (
        torch.Tensor
    )  # int64 [b, nb]: their blocks past any shared prefix (padding columns -> block 0, masked)
    mask: torch.Tensor | None  # bool [b, 1, 1, nb * block_size], None when nothing is padding
    empty: torch.Tensor | None  # bool [b]: zero-length rows (attend to nothing), None when none
    k_buf: torch.Tensor | None = None  # gather buffers, allocated by the first layer, reused by the rest
    v_buf: torch.Tensor | None = None
    mask_add: torch.Tensor | None = None  # `mask` in additive form, made by the first layer


@dataclass(slots=True)
class _SharedPrefix:
    """Sequences whose block tables start with the same physical blocks (prefix-cache hits on one
    system prompt): their queries attend to those blocks in ONE call, gathered once."""

    idx: torch.Tensor  # int64 [m]: rows of the batch
    ids: torch.Tensor  # int64 [shared blocks]


@dataclass(slots=True)
class DecodePlan:
    """Which sequences share a gather + SDPA call, with their block ids and masks.

    Depends only on the block tables and lengths, so a model builds it once per step and reuses
    it in every layer (``plan=`` of ``paged_decode_attention``). With ``shared`` prefixes the
    buckets hold each sequence's context past its shared blocks; the two parts are merged by their
    softmax normalisers (cascade attention, as FlashInfer does it on GPU).
    """

    num_seqs: int
    buckets: list[_Bucket]
    shared: list[_SharedPrefix] = field(default_factory=list)
    # The native kernel's int32 block tables and lengths (``kernels/cpu/native.py``); None when it
    # is unavailable. ``bucketed`` says whether ``buckets``/``shared`` were built: a plan made for
    # the native kernel builds them only if a call cannot use it (e.g. an fp16 cache).
    native_tables: torch.Tensor | None = None
    native_lens: torch.Tensor | None = None
    bucketed: bool = True
    # The native cascade's arguments when sequences share prefixes (None: none worth it); a call the
    # cascade cannot take (not fp32) runs the plain native kernel, or the buckets when
    # ``buckets_first`` (its shared prefixes save NATIVE_MAX_SAVED_TOKENS or more).
    cascade: _NativeCascade | None = None
    buckets_first: bool = False
    # The sliding window it was built for (None: full attention); a call with another rebuilds it.
    sliding_window: int | None = None


@dataclass(slots=True)
class _NativeCascade:
    """``cpu_native.cascade``'s index tensors (int32): each row's table and length past its group's
    shared prefix, and per group its prefix blocks, token count and member rows."""

    own_tables: torch.Tensor  # [num_seqs, width]
    own_lens: torch.Tensor  # [num_seqs]
    prefix_tables: torch.Tensor  # [groups, longest prefix in blocks]
    prefix_starts: torch.Tensor  # [groups + 1]: group i's members are row_map[starts[i]:starts[i + 1]]
    prefix_lens: torch.Tensor  # [groups]
    row_map: torch.Tensor  # [members]


def _native_cascade(
    tables: list[list[int]], lens: list[int], groups: list[tuple[list[int], int]], block_size: int
) -> _NativeCascade:
    offset = [0] * len(lens)
    row_map: list[int] = []
    starts = [0]
    prefixes: list[list[int]] = []
    for rows, nb in groups:
        for r in rows:
            offset[r] = nb
        row_map += rows
        starts.append(len(row_map))
        prefixes.append(tables[rows[0]][:nb])
    longest = max(len(p) for p in prefixes)
    i32 = torch.int32
    return _NativeCascade(
        torch.tensor([t[o:] + [0] * o for t, o in zip(tables, offset, strict=True)], dtype=i32),
        torch.tensor([n - o * block_size for n, o in zip(lens, offset, strict=True)], dtype=i32),
        torch.tensor([p + [0] * (longest - len(p)) for p in prefixes], dtype=i32),
        torch.tensor(starts, dtype=i32),
        torch.tensor([len(p) * block_size for p in prefixes], dtype=i32),
        torch.tensor(row_map, dtype=i32),
    )


def shared_prefixes(
    tables: list[list[int]], lens: list[int], block_size: int, min_saved: int | None = None
) -> list[tuple[list[int], int]]:
    """(rows, blocks): groups of at least two sequences whose first ``MIN_SHARED_BLOCKS`` block ids
    are equal, with the number of leading blocks ALL members share, that save at least ``min_saved``
    tokens of attention. Every member keeps at least one token past the shared blocks (its own new
    token's position), so each part is non-empty. ``min_saved`` defaults to ``CASCADE_MIN_SAVED_TOKENS``
    (the bucket path's rule).

    Rows whose whole table equals another row's are one sequence's positions (a speculative
    verification's, each a decode query of its own; two live sequences never share the block their
    new token is written into) and join no group: each keeps the arithmetic plain decoding gives
    that position, to the bit, where a group's would also depend on the shortest member's length."""
    if min_saved is None:
        min_saved = CASCADE_MIN_SAVED_TOKENS
    whole = Counter(tuple(t) for t in tables)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, n in enumerate(lens):
        if n > MIN_SHARED_BLOCKS * block_size and whole[tuple(tables[i])] == 1:
            groups.setdefault(tuple(tables[i][:MIN_SHARED_BLOCKS]), []).append(i)
    out: list[tuple[list[int], int]] = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        cap = min((lens[r] - 1) // block_size for r in rows)
        if (len(rows) - 1) * cap * block_size < min_saved:
            continue  # even sharing every block it can would not save enough: no comparing
        first = tables[rows[0]]
        n = MIN_SHARED_BLOCKS
        while n < cap and all(tables[r][n] == first[n] for r in rows):
            n += 1
        n = min(n, cap)
        if (len(rows) - 1) * n * block_size >= min_saved:
            out.append((rows, n))
    return out


def plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sliding_window: int | None = None
) -> DecodePlan:
    """The step's decode plan: the native kernel's arguments when it is available (no buckets,
    nothing gathered), else length buckets and shared prefixes (``plan_buckets``). Also the
    buckets when shared prefixes would save ``NATIVE_MAX_SAVED_TOKENS`` or more (the cascade
    attends a prefix once for all its members; the native kernel reads it once per member).
    With a ``sliding_window`` there is no cascade (a shared prefix would hold keys outside some
    members' windows): the native kernel or the buckets read each sequence from its window's first
    block."""
    if cpu_native.available():
        lens = seq_lens.tolist()
        plan = DecodePlan(
            len(lens),
            [],
            [],
            block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            bucketed=False,
            sliding_window=sliding_window,
        )
        if (
            sliding_window is None and sum(lens) > NATIVE_CASCADE_MIN_SAVED_TOKENS
        ):  # else no prefix can save enough: no search
            tables = block_tables.tolist()
            groups = shared_prefixes(tables, lens, block_size, NATIVE_CASCADE_MIN_SAVED_TOKENS)
            if groups:
                plan.cascade = _native_cascade(tables, lens, groups, block_size)
                big = [
                    (rows, nb)
                    for rows, nb in groups
                    if (len(rows) - 1) * nb * block_size >= CASCADE_MIN_SAVED_TOKENS
                ]
                plan.buckets_first = (
                    sum((len(r) - 1) * nb * block_size for r, nb in big) >= NATIVE_MAX_SAVED_TOKENS
                )
        return plan
    return plan_buckets(block_tables, seq_lens, block_size, sliding_window)


def plan_buckets(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sliding_window: int | None = None
) -> DecodePlan:
    """Length buckets and shared prefixes for the gather + SDPA path (the module docstring). With a
    ``sliding_window``, no shared prefixes: each sequence's gather starts at its window's first
    block, the keys of that block before the window masked."""
    lens = seq_lens.tolist()
    tables = block_tables.to(torch.int64)
    host_tables = tables.tolist()
    offset = [0] * len(lens)  # blocks of each sequence covered by a shared prefix, or before its window
    skip = [0] * len(lens)  # keys of its first gathered block before its window
    shared: list[_SharedPrefix] = []
    if sliding_window is not None:
        for i, n in enumerate(lens):
            lo = max(0, n - sliding_window)
            offset[i], skip[i] = divmod(lo, block_size)
    for rows, nb in shared_prefixes(host_tables, lens, block_size) if sliding_window is None else []:
        for r in rows:
            offset[r] = nb
        shared.append(
            _SharedPrefix(
                torch.tensor(rows, dtype=torch.int64),
                torch.tensor(host_tables[rows[0]][:nb], dtype=torch.int64),
            )
        )
    rest = [n - o * block_size for n, o in zip(lens, offset, strict=True)]
    width = tables.shape[1]
    buckets: list[_Bucket] = []
    for members, nb in decode_buckets(rest, block_size):
        idx = torch.tensor(members, dtype=torch.int64)
        blens = torch.tensor([rest[m] for m in members], dtype=torch.int64)
        used = ceil_div(blens, block_size)  # blocks each member's tokens fill
        cols = (
            torch.tensor([offset[m] for m in members], dtype=torch.int64)[:, None] + torch.arange(nb)[None, :]
        )
        ids = tables.index_select(0, idx).gather(1, cols.clamp_(max=width - 1))
        # Padding columns read a block of the member's own (masked): with a window, block 0 may be
        # one the block manager released (anything, NaN included, and 0 x NaN is NaN in SDPA).
        padding = torch.arange(nb)[None, :] >= used[:, None]
        if sliding_window is None:
            ids = ids.masked_fill(padding, 0)
        else:
            ids = torch.where(padding, torch.where(used > 0, ids[:, 0], 0)[:, None], ids)
        t = nb * block_size
        shortest = min(rest[m] for m in members)
        skipped = max(skip[m] for m in members)
        mask = None
        if shortest < t or skipped:
            pos = torch.arange(t)[None, :]
            keep = pos < blens[:, None]
            if skipped:
                keep &= pos >= torch.tensor([skip[m] for m in members], dtype=torch.int64)[:, None]
            mask = keep[:, None, None, :]
        buckets.append(_Bucket(idx, ids.contiguous(), mask, (blens == 0) if shortest == 0 else None))
    return DecodePlan(len(lens), buckets, shared, sliding_window=sliding_window)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    plan: object | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached context (see the module docstring)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if not isinstance(plan, DecodePlan) or plan.sliding_window != sliding_window:
        plan = plan_decode(block_tables, seq_lens, block_size, sliding_window)
    nc = plan.cascade
    if nc is not None and out.stride(-1) == 1 and cpu_native.prefill_supports(query, key_cache, value_cache):
        return cpu_native.cascade(
            query,
            key_cache,
            value_cache,
            nc.own_tables,
            nc.own_lens,
            nc.prefix_tables,
            nc.prefix_starts,
            nc.prefix_lens,
            nc.row_map,
            scale,
            out,
        )
    if (
        plan.native_tables is not None
        and plan.native_lens is not None
        and not plan.buckets_first
        and out.stride(-1) == 1
        and cpu_native.supports(query, key_cache, value_cache)
    ):
        return cpu_native.decode(
            query, key_cache, value_cache, plan.native_tables, plan.native_lens, scale, out, sliding_window
        )
    if quant.is_quantized(key_cache):  # an 8-bit cache the native kernel cannot take: dequantized
        return reference.paged_decode_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale,
            out=out,
            sliding_window=sliding_window,
        )
    if not plan.bucketed:  # planned for the native kernel, which cannot take this call
        built = plan_buckets(block_tables, seq_lens, block_size, sliding_window)
        plan.buckets, plan.shared, plan.bucketed = built.buckets, built.shared, True
    q_all = query.view(num_seqs, num_kv_heads, group, head_dim)
    out_view = out.view(num_seqs, num_kv_heads, group, head_dim)
    # Softmax normalisers of each row's own part, for the merge with its shared prefix.
    lse = torch.empty(num_seqs, num_kv_heads, group, dtype=torch.float32) if plan.shared else None
    for bk in plan.buckets:
        b, nb = bk.ids.shape
        t = nb * block_size
        flat = bk.ids.view(-1)
        shape = (flat.shape[0], *key_cache.shape[1:])
        if bk.k_buf is None or bk.k_buf.shape != shape or bk.k_buf.dtype != key_cache.dtype:
            bk.k_buf = torch.empty(shape, dtype=key_cache.dtype)
            bk.v_buf = torch.empty(shape, dtype=key_cache.dtype)
        assert bk.v_buf is not None
        torch.index_select(key_cache, 0, flat, out=bk.k_buf)
        torch.index_select(value_cache, 0, flat, out=bk.v_buf)
        # [b, kv_heads, t, head_dim] strided views of the gathered blocks: no transpose copy.
        k = bk.k_buf.view(b, t, num_kv_heads, head_dim).transpose(1, 2)
        v = bk.v_buf.view(b, t, num_kv_heads, head_dim).transpose(1, 2)
        q = q_all.index_select(0, bk.idx)
        if bk.mask is not None and (bk.mask_add is None or bk.mask_add.dtype != q.dtype):
            bk.mask_add = _additive(bk.mask, q.dtype)
        if lse is None:
            res = F.scaled_dot_product_attention(q, k, v, attn_mask=bk.mask_add, scale=scale)
        else:
            res, part_lse = _attention_with_lse(q, k, v, bk.mask_add, scale)
            lse.index_copy_(0, bk.idx, part_lse)
        if bk.empty is not None:
            res[bk.empty] = 0
        out_view.index_copy_(0, bk.idx, res.to(out.dtype))
    for sp in plan.shared:
        _merge_shared_prefix(sp, q_all, key_cache, value_cache, out_view, lse, scale)  # type: ignore[arg-type]
    return out


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel (what ``F.scaled_dot_product_attention`` runs here) with its row
    log-sum-exp of the scaled scores, which the public function does not return."""
    res, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )
    return res, lse.to(torch.float32)


def _merge_shared_prefix(
    sp: _SharedPrefix,
    q_all: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out_view: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> None:
    """Attention of the group's queries over its shared blocks (one gather, one call: the group's
    queries are the rows of one problem), merged into each member's own-part result."""
    m = sp.idx.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = q_all.shape[2]
    t = sp.ids.shape[0] * block_size
    k = key_cache.index_select(0, sp.ids).view(1, t, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache.index_select(0, sp.ids).view(1, t, num_kv_heads, head_dim).transpose(1, 2)
    # [m, Hkv, g, D] -> [1, Hkv, m * g, D]: every member's query rows against the same keys.
    q = q_all.index_select(0, sp.idx).permute(1, 0, 2, 3).reshape(1, num_kv_heads, m * group, head_dim)
    res, pre_lse = _attention_with_lse(q, k, v, None, scale)
    pre = res.view(num_kv_heads, m, group, head_dim).permute(1, 0, 2, 3).float()
    pre_lse = pre_lse.view(num_kv_heads, m, group).permute(1, 0, 2)
    own = out_view.index_select(0, sp.idx).float()
    own_lse = lse.index_select(0, sp.idx)
    top = torch.maximum(pre_lse, own_lse)
    w_pre, w_own = torch.exp(pre_lse - top), torch.exp(own_lse - top)
    merged = (pre * w_pre[..., None] + own * w_own[..., None]) / (w_pre + w_own)[..., None]
    out_view.index_copy_(0, sp.idx, merged.to(out_view.dtype))


def prefill_buckets(
    seq_lens: list[int], q_lens: list[int], block_size: int
) -> list[tuple[list[int], int, int]]:
    """Group prefill sequences into (indices, blocks, query rows) buckets that share one SDPA call.

    Every member is padded to the bucket's longest context (``blocks``) and longest query chunk
    (``query rows``); a sequence joins while the padded work (query rows x keys) stays under
    ``PREFILL_PAD_FRACTION`` of the bucket's. Sequences are taken by query size class (powers of
    two), then longest context first, so a long first chunk never pads many short ones: the
    typical step of chat traffic (many short suffixes after a shared, cached system prompt) is one
    or two calls instead of one per sequence.
    """
    live = [i for i in range(len(seq_lens)) if q_lens[i] > 0]
    order = sorted(live, key=lambda i: (-(q_lens[i] - 1).bit_length(), -seq_lens[i]))
    buckets: list[tuple[list[int], int, int]] = []
    i = 0
    while i < len(order):
        first = order[i]
        nb = max(1, blocks_for_tokens(seq_lens[first], block_size))
        width, rows = nb * block_size, q_lens[first]
        members, real = [first], q_lens[first] * seq_lens[first]
        j = i + 1
        while j < len(order) and len(members) < MAX_BUCKET:
            cand = order[j]
            new_rows = max(rows, q_lens[cand])
            new_width = max(width, blocks_for_tokens(seq_lens[cand], block_size) * block_size)
            padded = new_width * new_rows * (len(members) + 1)
            new_real = real + q_lens[cand] * seq_lens[cand]
            if padded - new_real > PREFILL_PAD_FRACTION * padded:
                break
            members.append(cand)
            rows, width, real = new_rows, new_width, new_real
            j += 1
        buckets.append((members, width // block_size, rows))
        i = j
    return buckets


@dataclass(slots=True)
class _PrefillBucket:
    ids: torch.Tensor  # int64 [b, nb]: blocks (padding columns point at block 0, masked)
    q_index: torch.Tensor  # int64 [b * rows]: the query row of each padded slot (padding -> 0)
    out_index: torch.Tensor  # int64 [real rows]: where the real rows go in the output
    keep: torch.Tensor | None  # int64 [real rows]: which padded slots are real (None: all are)
    rows: int
    mask: torch.Tensor  # bool [b, 1, group * rows, nb * block_size]: offset-causal + padding
    mask_add: torch.Tensor | None = None  # `mask` in additive form, made by the first layer


@dataclass(slots=True)
class PrefillPlan:
    """Prefill buckets with their query gathers and masks (built once per step, used by every layer).

    With the native kernel available, each query row is instead a decode query of its own: query
    ``j`` of a sequence's ``q_len``-token chunk attends, through that sequence's block table, to the
    ``seq_len - q_len + j + 1`` tokens up to and including itself, which is the causal mask with
    nothing padded or gathered.
    ``native_tables`` / ``native_lens`` hold those per-row tables and lengths; the buckets are built
    only for a call that cannot use them (``bucketed``). The native prefill kernel (fp32) takes the
    sequences' own tables, starts and lengths as int32 (``seq_tables``, ``query_start``,
    ``seq_lens``)."""

    buckets: list[_PrefillBucket]
    native_tables: torch.Tensor | None = None  # int32 [prefill tokens, max blocks]
    native_lens: torch.Tensor | None = None  # int32 [prefill tokens]
    seq_tables: torch.Tensor | None = None  # int32 [sequences, max blocks]
    query_start: torch.Tensor | None = None  # int32 [sequences + 1]
    seq_lens: torch.Tensor | None = None  # int32 [sequences]
    # The longest context a task reads: the longest sequence, or with a window at most the window,
    # a task's rows and the part of a block before the window (the native paths' size limits).
    max_seq_len: int = 0
    bucketed: bool = True
    sliding_window: int | None = None  # the window it was built for (None: full causal attention)


def plan_prefill(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    group: int,
    sliding_window: int | None = None,
) -> PrefillPlan:
    """The step's prefill plan: per-row native arguments when the native kernel is available (the
    buckets follow if a call cannot use them), else the buckets (``plan_prefill_buckets``). A
    ``sliding_window`` goes to the kernels (each row a decode query of its own sees its window) and
    into the buckets' masks."""
    if cpu_native.available() and seq_lens.numel():
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
        seq_of_row = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), q_lens)
        rows = torch.arange(seq_of_row.shape[0])
        # Row r of sequence s sits (query_start_loc[s + 1] - 1 - r) tokens before the sequence's end.
        lens = seq_lens.to(torch.int64)[seq_of_row] - (
            query_start_loc.to(torch.int64)[seq_of_row + 1] - 1 - rows
        )
        tables32 = block_tables.to(torch.int32).contiguous()
        return PrefillPlan(
            [],
            tables32.index_select(0, seq_of_row),
            lens.to(torch.int32).contiguous(),
            tables32,
            query_start_loc.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            max_seq_len=_longest_read(int(seq_lens.max()), block_size, sliding_window),
            bucketed=False,
            sliding_window=sliding_window,
        )
    return plan_prefill_buckets(block_tables, query_start_loc, seq_lens, block_size, group, sliding_window)


def _longest_read(longest: int, block_size: int, sliding_window: int | None) -> int:
    """The most keys a prefill task reads: the longest context, or under a window at most the window
    plus the native prefill kernel's 32 rows and the part of a block before the window."""
    return longest if sliding_window is None else min(longest, sliding_window + 32 + block_size)


def plan_prefill_buckets(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    group: int,
    sliding_window: int | None = None,
) -> PrefillPlan:
    """Prefill buckets, their query gathers and masks (the module docstring). With a
    ``sliding_window``, each sequence's gather starts at the block holding its first query's first
    key (earlier blocks may have been released), and each row's mask keeps its window only."""
    starts = query_start_loc.tolist()
    all_lens = seq_lens.tolist()
    q_lens = [int(starts[i + 1]) - int(starts[i]) for i in range(len(all_lens))]
    # Blocks of each sequence before the first one any of its queries sees (0 without a window).
    first = [
        0 if sliding_window is None else max(0, n - q - sliding_window + 1) // block_size
        for n, q in zip(all_lens, q_lens, strict=True)
    ]
    lens = [n - f * block_size for n, f in zip(all_lens, first, strict=True)]  # tokens gathered
    tables = block_tables.to(torch.int64)
    width = tables.shape[1]
    buckets: list[_PrefillBucket] = []
    for members, nb, rows in prefill_buckets(lens, q_lens, block_size):
        t = nb * block_size
        b = len(members)
        blens = torch.tensor([lens[m] for m in members], dtype=torch.int64)
        qlens = torch.tensor([q_lens[m] for m in members], dtype=torch.int64)
        q0 = torch.tensor([int(starts[m]) for m in members], dtype=torch.int64)
        used = ceil_div(blens, block_size)  # blocks each member's tokens fill
        idx = torch.tensor(members, dtype=torch.int64)
        padding = torch.arange(nb)[None, :] >= used[:, None]
        if sliding_window is None:
            ids = tables.index_select(0, idx)[:, :nb].masked_fill(padding, 0)
        else:  # padding reads a block of the member's own (block 0 may have been released)
            cols = torch.tensor([first[m] for m in members], dtype=torch.int64)[:, None] + torch.arange(nb)
            ids = tables.index_select(0, idx).gather(1, cols.clamp_(max=width - 1))
            ids = torch.where(padding, ids[:, :1], ids)
        j = torch.arange(rows)[None, :]  # [1, rows]
        real = j < qlens[:, None]  # [b, rows]
        slot = (q0[:, None] + j).masked_fill(~real, 0)
        flat_real = real.reshape(-1)
        all_real = bool(flat_real.all())
        # Query j of sequence m sits at position seq_len - q_len + j; padded rows see key 0 only
        # (never a row with nothing to attend to), and are dropped.
        pos = (blens - qlens)[:, None] + j  # [b, rows], counted from the first gathered block
        pos = pos.masked_fill(~real, 0)
        mask = torch.arange(t)[None, None, :] <= pos[:, :, None]  # [b, rows, t]
        if sliding_window is not None:  # key t of the gather is at position t (+ the skipped blocks)
            mask &= torch.arange(t)[None, None, :] > pos[:, :, None] - sliding_window
        mask = mask[:, None, :, :].expand(b, group, rows, t).reshape(b, 1, group * rows, t)
        buckets.append(
            _PrefillBucket(
                ids=ids.contiguous(),
                q_index=slot.reshape(-1),
                out_index=slot.reshape(-1)[flat_real],
                keep=None if all_real else flat_real.nonzero().view(-1),
                rows=rows,
                mask=mask.contiguous(),
            )
        )
    return PrefillPlan(buckets, sliding_window=sliding_window)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    plan: object | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's last ``q_len`` tokens over its ``seq_len`` cached tokens."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if not isinstance(plan, PrefillPlan) or plan.sliding_window != sliding_window:
        plan = plan_prefill(block_tables, query_start_loc, seq_lens, block_size, group, sliding_window)
    if (
        out.stride(-1) == 1
        and plan.max_seq_len <= NATIVE_PREFILL_KERNEL_MAX_TOKENS
        and plan.seq_tables is not None
        and plan.query_start is not None
        and plan.seq_lens is not None
        and cpu_native.prefill_supports(query, key_cache, value_cache)
    ):
        return cpu_native.prefill(
            query,
            key_cache,
            value_cache,
            plan.seq_tables,
            plan.query_start,
            plan.seq_lens,
            scale,
            out,
            sliding_window,
        )
    if (
        out.stride(-1) == 1
        and plan.max_seq_len * head_dim <= NATIVE_PREFILL_MAX_CONTEXT
        and plan.native_tables is not None
        and plan.native_lens is not None
        and cpu_native.supports(query, key_cache, value_cache)
    ):
        return cpu_native.decode(
            query, key_cache, value_cache, plan.native_tables, plan.native_lens, scale, out, sliding_window
        )
    if quant.is_quantized(key_cache):  # an 8-bit cache the native kernels cannot take: dequantized
        return reference.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            out=out,
            sliding_window=sliding_window,
        )
    if not plan.bucketed:  # planned for the native kernel, which cannot take this call
        built = plan_prefill_buckets(
            block_tables, query_start_loc, seq_lens, block_size, group, sliding_window
        )
        plan.buckets, plan.bucketed = built.buckets, True
    for bk in plan.buckets:
        b, nb = bk.ids.shape
        t, rows = nb * block_size, bk.rows
        flat = bk.ids.view(-1)
        k = key_cache.index_select(0, flat).view(b, t, num_kv_heads, head_dim).transpose(1, 2)
        v = value_cache.index_select(0, flat).view(b, t, num_kv_heads, head_dim).transpose(1, 2)
        # [b * rows, H, D] -> [b, Hkv, group * rows, D]: row (g, j) is query j of head kv * group + g.
        q = (
            query.index_select(0, bk.q_index)
            .view(b, rows, num_kv_heads, group, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(b, num_kv_heads, group * rows, head_dim)
        )
        if bk.mask_add is None or bk.mask_add.dtype != q.dtype:
            bk.mask_add = _additive(bk.mask, q.dtype)
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=bk.mask_add, scale=scale)
        res = (
            res.view(b, num_kv_heads, group, rows, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(b * rows, num_heads, head_dim)
        )
        if bk.keep is not None:
            res = res.index_select(0, bk.keep)
        out.index_copy_(0, bk.out_index, res.to(out.dtype))
    return out
