"""Paged-attention kernels: pure functions on tensors (Triton on GPU, plain torch as reference).

Public API (argument names, order and shapes are a contract; see docs/kernels.md):

- ``write_kv_cache(key, value, key_cache, value_cache, slot_mapping)``
- ``paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale) -> out``
- ``paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale) -> out``
- ``copy_blocks(key_caches, value_caches, pairs)``
- ``swap_blocks(src, dst, pairs)``
- ``kernels.reference``: the same five in plain torch.

One layer's cache is ``key_cache``/``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views, e.g. a layer of a
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor, are fine; head_dim must
be contiguous). A token's slot is ``block_id * block_size + offset``.

Backends and dispatch
---------------------
Each call picks a backend from its tensors' device:

- CUDA tensors run the Triton kernels.
- CPU tensors run the CPU backend (``kernels/cpu.py``: length-bucketed gathers + torch's fused SDPA,
  GQA folded per KV head; block copies/swaps as the reference), unless ``TRITON_INTERPRET=1`` was
  set before ``kernels`` was imported, in which case the Triton kernels run in Triton's interpreter
  (how CI tests them). bf16 on CPU always uses the CPU backend (the interpreter cannot do bf16 math).

Override (innermost wins): the context manager ``kernels.use_backend(name)`` or the environment
variable ``PAGEDKV_KERNEL_BACKEND``, with ``name`` in {"auto", "reference", "triton", "cpu"} (default
"auto", the rule above). E.g. a model runner whose tests run with TRITON_INTERPRET=1 keeps the fast
path with ``with kernels.use_backend("reference"): ...``. "triton" on CPU tensors requires the
interpreter. ``kernels.backend_for(tensor)`` says what a call on that tensor would use.

Triton is imported lazily (only when its backend is chosen), so ``import kernels`` works without it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import checks, cpu, reference
from kernels.dispatch import BACKENDS, ENV_VAR, requested_backend, resolve, triton_module, use_backend

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
    "reference",
    "use_backend",
    "backend_for",
    "requested_backend",
    "BACKENDS",
    "ENV_VAR",
]


def backend_for(t: torch.Tensor) -> str:
    """The backend ("triton", "cpu" or "reference") a call on tensors like ``t`` would use right now."""
    return resolve(t.device, t.dtype)


def _interpreted() -> bool:
    return bool(triton_module("cache_ops").INTERPRETED)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V (``[num_tokens, num_kv_heads, head_dim]``) into its cache slot.

    ``slot_mapping[i] = block_id * block_size + offset``; -1 means padding (nothing is written).
    """
    k = checks.tensor("key", key, 3)
    v = checks.tensor("value", value, 3)
    checks.kv_cache_pair(key_cache, value_cache)
    checks.float_dtype("key", k)
    checks.float_dtype("value", v)
    sm = checks.tensor("slot_mapping", slot_mapping, 1)
    checks.int_dtype("slot_mapping", sm)
    if k.shape != v.shape:
        raise ValueError(f"key shape {tuple(k.shape)} != value shape {tuple(v.shape)}")
    if tuple(k.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"key is [num_tokens, {k.shape[1]}, {k.shape[2]}] but the cache holds "
            f"[..., {key_cache.shape[2]}, {key_cache.shape[3]}] (num_kv_heads, head_dim)"
        )
    if sm.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {sm.shape[0]} entries for {k.shape[0]} tokens")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("key/value must be contiguous along head_dim")
    dev = checks.same_device(
        ["key_cache", "value_cache", "key", "value", "slot_mapping"], [key_cache, value_cache, k, v, sm]
    )
    if sm.device.type == "cpu" and sm.numel():
        capacity = key_cache.shape[0] * key_cache.shape[1]
        if int(sm.max()) >= capacity or int(sm.min()) < -1:
            raise ValueError(f"slot_mapping values must be -1 or in [0, {capacity})")
    backend = resolve(dev, key_cache.dtype)
    if backend == "triton":
        triton_module("cache_ops").write_kv_cache(k, v, key_cache, value_cache, sm)
    elif backend == "cpu":
        cpu.write_kv_cache(k, v, key_cache, value_cache, sm)
    else:
        reference.write_kv_cache(k, v, key_cache, value_cache, sm)


def _attention_common(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.device, int]:
    q = checks.tensor("query", query, 3)
    checks.float_dtype("query", q)
    num_blocks, block_size, num_kv_heads, head_dim = checks.kv_cache_pair(key_cache, value_cache)
    if q.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {q.dtype} != cache dtype {key_cache.dtype}")
    if q.shape[2] != head_dim:
        raise ValueError(f"query head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.stride(-1) != 1:
        raise ValueError("query must be contiguous along head_dim")
    checks.heads(q.shape[1], num_kv_heads)
    bt = checks.tensor("block_tables", block_tables, 2)
    checks.int_dtype("block_tables", bt)
    sl = checks.tensor("seq_lens", seq_lens, 1)
    checks.int_dtype("seq_lens", sl)
    if bt.shape[0] != sl.shape[0]:
        raise ValueError(f"block_tables has {bt.shape[0]} rows but seq_lens has {sl.shape[0]} entries")
    if bt.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    dev = checks.same_device(
        ["query", "key_cache", "value_cache", "block_tables", "seq_lens"], [q, key_cache, value_cache, bt, sl]
    )
    checks.block_table_values(bt, sl, num_blocks, block_size)
    return dev, num_blocks


def _check_out(out: torch.Tensor | None, query: torch.Tensor) -> None:
    if out is None:
        return
    checks.tensor("out", out, 3)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"want {tuple(query.shape)} {query.dtype} on {query.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along head_dim")


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
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context; returns ``[num_seqs, num_heads, head_dim]``.

    ``seq_lens[i]`` counts the tokens to attend, including the new one (already written to the cache).
    Optional: ``max_seq_len`` (a host-side upper bound of ``seq_lens``, used to choose the split-KV
    count without reading the device; defaults to the block table's capacity) and ``num_splits``
    (force the split count, mainly for tests and tuning). The reference ignores both. ``out``: an
    optional preallocated output (same shape/dtype/device as ``query``), filled and returned.
    """
    dev, _ = _attention_common(query, key_cache, value_cache, block_tables, seq_lens)
    _check_out(out, query)
    if query.shape[0] != block_tables.shape[0]:
        raise ValueError(f"query has {query.shape[0]} sequences but block_tables has {block_tables.shape[0]}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    backend = resolve(dev, query.dtype)
    if backend == "triton":
        return triton_module("decode").paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale,
            max_seq_len=max_seq_len, num_splits=num_splits, interpreted=_interpreted(), out=out,
        )
    if backend == "cpu":
        return cpu.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out=out)
    return reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out=out)


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
) -> torch.Tensor:
    """Causal attention for a ragged batch of query tokens ``[total_q, num_heads, head_dim]``.

    Sequence i's queries are ``query[query_start_loc[i]:query_start_loc[i+1]]``, its LAST ``q_len``
    tokens out of ``seq_lens[i]`` whose K/V are already in the cache. ``max_query_len`` (optional)
    spares the Triton path a device->host read of the longest query run; ``out`` is an optional
    preallocated output like ``query``.
    """
    dev, _ = _attention_common(query, key_cache, value_cache, block_tables, seq_lens)
    _check_out(out, query)
    qsl = checks.tensor("query_start_loc", query_start_loc, 1)
    checks.int_dtype("query_start_loc", qsl)
    if qsl.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc needs num_seqs + 1 = {seq_lens.shape[0] + 1} entries, has {qsl.shape[0]}")
    checks.same_device(["query", "query_start_loc"], [query, qsl])
    if qsl.device.type == "cpu" and seq_lens.device.type == "cpu" and qsl.numel():
        q_lens = qsl[1:] - qsl[:-1]
        if int(qsl[0]) != 0 or int(qsl[-1]) != query.shape[0] or (q_lens.numel() and int(q_lens.min()) < 0):
            raise ValueError("query_start_loc must start at 0, be non-decreasing and end at total_q")
        if q_lens.numel() and bool((q_lens > seq_lens.to(q_lens.dtype)).any()):
            raise ValueError("a sequence has more queries than seq_len tokens (queries are its last tokens)")
    backend = resolve(dev, query.dtype)
    if backend == "triton":
        return triton_module("prefill").paged_prefill_attention(
            query, key_cache, value_cache, block_tables, qsl, seq_lens, scale,
            max_query_len=max_query_len, interpreted=_interpreted(), out=out,
        )
    if backend == "cpu":
        return cpu.paged_prefill_attention(query, key_cache, value_cache, block_tables, qsl, seq_lens, scale, out=out)
    return reference.paged_prefill_attention(query, key_cache, value_cache, block_tables, qsl, seq_lens, scale, out=out)


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy block src over block dst (rows of ``pairs`` ``[n, 2]``) in every layer's K and V cache.

    Copy-on-write: destinations must be distinct and not also sources (checked when ``pairs`` is on
    the CPU), since all pairs of all layers run in one launch, in parallel.
    """
    kcs, vcs = list(key_caches), list(value_caches)
    if not kcs or len(kcs) != len(vcs):
        raise ValueError(f"need equal, non-zero numbers of key and value caches, got {len(kcs)} and {len(vcs)}")
    caches = kcs + vcs
    shape = checks.kv_cache_pair(kcs[0], vcs[0])
    for i, c in enumerate(caches):
        checks.tensor(f"cache {i}", c, 4)
        if c.shape != caches[0].shape or c.dtype != caches[0].dtype or c.stride() != caches[0].stride():
            raise ValueError("all key/value caches must share shape, dtype and strides")
    p = checks.pairs_tensor(pairs, shape[0])
    dev = checks.same_device([f"cache {i}" for i in range(len(caches))], caches)
    if p.device.type == "cpu" and p.numel():
        dst = p[:, 1]
        if dst.unique().numel() != dst.numel() or bool(torch.isin(dst, p[:, 0]).any()):
            raise ValueError("copy_blocks: destination blocks must be distinct and not also sources")
    elif p.device != dev:
        raise ValueError(f"pairs is on {p.device}; put it on the CPU or the caches' device {dev}")
    if p.shape[0] == 0:
        return
    if resolve(dev, caches[0].dtype) == "triton":
        triton_module("cache_ops").copy_blocks(kcs, vcs, p)
    else:
        reference.copy_blocks(kcs, vcs, p)


def swap_blocks(
    src: torch.Tensor | Sequence[torch.Tensor],
    dst: torch.Tensor | Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """Copy blocks ``src[s] -> dst[d]`` between caches on different devices (swap out / in).

    ``src``/``dst``: one cache each (block index on dim 0, e.g. ``[num_blocks, block_size, heads,
    head_dim]``) or equal-length sequences of them (per layer, K and V). Batched: contiguous runs are
    copied directly, anything else is gathered into one staging buffer and moved in one transfer.
    Synchronous. The reference backend copies block by block.
    """
    srcs = [src] if isinstance(src, torch.Tensor) else list(src)
    dsts = [dst] if isinstance(dst, torch.Tensor) else list(dst)
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(f"src and dst must hold the same non-zero number of caches ({len(srcs)} vs {len(dsts)})")
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        checks.tensor(f"src[{i}]", s)
        checks.tensor(f"dst[{i}]", d)
        if s.dim() < 1 or tuple(s.shape[1:]) != tuple(d.shape[1:]) or s.dtype != d.dtype:
            raise ValueError(
                f"src[{i}] {tuple(s.shape)} {s.dtype} and dst[{i}] {tuple(d.shape)} {d.dtype} must agree "
                "in block shape and dtype"
            )
    p = checks.pairs_tensor(pairs, srcs[0].shape[0], dsts[0].shape[0])
    if p.shape[0] == 0:
        return
    if requested_backend() == "reference":
        for s, d in zip(srcs, dsts):
            reference.swap_blocks(s, d, p)
        return
    from kernels import swap  # plain torch: no Triton needed, fast on every device

    swap.swap_blocks(srcs, dsts, p)
