"""Input validation of the kernel operations, for every backend.

Why a separate module: the Triton kernels do raw pointer arithmetic, so a wrong shape, dtype or
device is a silent wrong answer or a memory fault rather than an exception. Every public entry point
(``kernels/__init__.py``) checks its arguments here first (one function per operation, named like
it, taking the call's bound arguments) and raises ``ValueError`` with a message naming the argument.
A model step validates its attention metadata once for all layers (``kernels/step.py``, with
``step_metadata`` below) instead of once per layer and call.
Checks that would need a device->host copy (block ids in range, lengths within the block table) only
run when the index tensors live on the CPU, so the CUDA hot path never synchronises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels import quant

Args = dict[str, Any]
# Where a call runs (device and dtype pick the backend), or None when there is nothing to do.
Where = tuple[torch.device, torch.dtype] | None

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


def tensor(name: str, t: object, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    return t


def float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def int_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = INT_DTYPES) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {allowed}, got {t.dtype}")


def same_device(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> torch.device:
    dev = tensors[0].device
    for n, t in zip(names, tensors, strict=True):
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device} but {names[0]} is on {dev}: all must share a device")
    return dev


def kv_cache_pair(key_cache: object, value_cache: object) -> tuple[int, int, int, int]:
    """Check a layer's caches; return (num_blocks, block_size, num_kv_heads, head_dim), head_dim
    without an 8-bit row's scale bytes (kernels/quant.py)."""
    kc = tensor("key_cache", key_cache, 4)
    vc = tensor("value_cache", value_cache, 4)
    if quant.is_quantized(kc):
        if kc.shape[-1] <= quant.SCALE_BYTES or kc.shape[-1] % 4:
            raise ValueError(
                f"an 8-bit key_cache's rows are head_dim values + a 4-byte scale, head_dim a multiple of 4; "
                f"got rows of {kc.shape[-1]}"
            )
    else:
        float_dtype("key_cache", kc)
    if vc.shape != kc.shape:
        raise ValueError(f"value_cache shape {tuple(vc.shape)} != key_cache shape {tuple(kc.shape)}")
    if vc.dtype != kc.dtype:
        raise ValueError(f"value_cache dtype {vc.dtype} != key_cache dtype {kc.dtype}")
    if kc.stride(-1) != 1 or vc.stride(-1) != 1:
        raise ValueError("key_cache/value_cache must be contiguous along head_dim (stride(-1) == 1)")
    nb, bs, hkv, _ = (int(x) for x in kc.shape)
    d = quant.head_dim(kc)
    if nb < 1 or bs < 1 or hkv < 1 or d < 1:
        raise ValueError(f"empty KV cache shape {tuple(kc.shape)}")
    return nb, bs, hkv, d


def heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA/MQA"
        )


def sliding_window(value: object) -> int | None:
    """``sliding_window``: None (full attention) or the number of positions a query sees, >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1, got {value}")
    return value


def window_first_positions(seq_lens: torch.Tensor, q_lens: torch.Tensor | None, window: int) -> torch.Tensor:
    """int64 ``[num_seqs]``: the first key position any query of each sequence sees under a sliding
    ``window`` (its first query sits at ``seq_len - q_len``; decode: ``q_len`` 1). Blocks before the
    one holding it are never read."""
    lens = seq_lens.to(torch.int64)
    first_q = lens - (1 if q_lens is None else q_lens.to(torch.int64))
    return (first_q - window + 1).clamp(min=0)


def block_table_values(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    first_positions: torch.Tensor | None = None,
) -> None:
    """Value checks (CPU index tensors only): lengths fit the table, used block ids are in range.
    With ``first_positions`` (a sliding window's, ``window_first_positions``), blocks before the one
    holding each sequence's first position are unused (released blocks may be -1)."""
    if block_tables.device.type != "cpu" or seq_lens.device.type != "cpu":
        return
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must be >= 0")
    max_blocks = block_tables.shape[1]
    if int(seq_lens.max()) > max_blocks * block_size:
        raise ValueError(
            f"a seq_len of {int(seq_lens.max())} needs more than block_tables' {max_blocks} blocks "
            f"of {block_size} tokens"
        )
    used_blocks = ceil_div(seq_lens.to(torch.int64), block_size)
    cols = torch.arange(max_blocks).unsqueeze(0)
    in_use = cols < used_blocks.unsqueeze(1)
    if first_positions is not None:
        in_use &= cols >= (first_positions // block_size).unsqueeze(1)
    used = block_tables[in_use]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) for used blocks")


def pairs_tensor(
    pairs: object, num_blocks: int | None = None, dst_num_blocks: int | None = None
) -> torch.Tensor:
    p = tensor("pairs", pairs, 2)
    if p.shape[1] != 2:
        raise ValueError(f"pairs must have shape [n, 2] (src, dst), got {tuple(p.shape)}")
    int_dtype("pairs", p)
    if p.device.type == "cpu" and p.numel():
        src_n = num_blocks
        dst_n = num_blocks if dst_num_blocks is None else dst_num_blocks
        if int(p.min()) < 0:
            raise ValueError("pairs holds negative block ids")
        if src_n is not None and int(p[:, 0].max()) >= src_n:
            raise ValueError(f"pairs holds source block ids >= {src_n}")
        if dst_n is not None and int(p[:, 1].max()) >= dst_n:
            raise ValueError(f"pairs holds destination block ids >= {dst_n}")
    return p


def slot_mapping(sm: object, num_tokens: int, key_cache: torch.Tensor) -> torch.Tensor:
    t = tensor("slot_mapping", sm, 1)
    int_dtype("slot_mapping", t)
    if t.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {t.shape[0]} entries for {num_tokens} tokens")
    if t.device.type == "cpu" and t.numel():
        capacity = key_cache.shape[0] * key_cache.shape[1]
        if int(t.max()) >= capacity or int(t.min()) < -1:
            raise ValueError(f"slot_mapping values must be -1 or in [0, {capacity})")
    return t


def block_tables_and_lens(
    block_tables: object,
    seq_lens: object,
    num_blocks: int,
    block_size: int,
    window: int | None = None,
    query_start_loc: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a block table and its lengths; with a sliding ``window``, only the blocks it reaches
    (decode, or prefill when ``query_start_loc`` is given: from each sequence's first query)."""
    bt = tensor("block_tables", block_tables, 2)
    int_dtype("block_tables", bt)
    sl = tensor("seq_lens", seq_lens, 1)
    int_dtype("seq_lens", sl)
    if bt.shape[0] != sl.shape[0]:
        raise ValueError(f"block_tables has {bt.shape[0]} rows but seq_lens has {sl.shape[0]} entries")
    if bt.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    first = None
    if window is not None and bt.device.type == "cpu" and sl.device.type == "cpu":
        q_lens = None
        if isinstance(query_start_loc, torch.Tensor) and query_start_loc.device.type == "cpu":
            if query_start_loc.shape == (sl.shape[0] + 1,):
                q_lens = (query_start_loc[1:] - query_start_loc[:-1]).clamp(min=0)
            else:
                q_lens = torch.zeros_like(sl)  # the shape error is raised by query_start_loc()
        first = window_first_positions(sl, q_lens, window)
    block_table_values(bt, sl, num_blocks, block_size, first)
    return bt, sl


def query_start_loc(qsl: object, seq_lens: torch.Tensor, total_q: int) -> torch.Tensor:
    t = tensor("query_start_loc", qsl, 1)
    int_dtype("query_start_loc", t)
    if t.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"query_start_loc needs num_seqs + 1 = {seq_lens.shape[0] + 1} entries, has {t.shape[0]}"
        )
    if t.device.type == "cpu" and seq_lens.device.type == "cpu" and t.numel():
        q_lens = t[1:] - t[:-1]
        if int(t[0]) != 0 or int(t[-1]) != total_q or (q_lens.numel() and int(q_lens.min()) < 0):
            raise ValueError("query_start_loc must start at 0, be non-decreasing and end at total_q")
        if q_lens.numel() and bool((q_lens > seq_lens.to(q_lens.dtype)).any()):
            raise ValueError("a sequence has more queries than seq_len tokens (queries are its last tokens)")
    return t


def _query(
    query: object, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """The query of an attention call against a layer's caches; returns it, num_blocks, block_size."""
    q = tensor("query", query, 3)
    float_dtype("query", q)
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache_pair(key_cache, value_cache)
    if q.dtype != key_cache.dtype and not quant.is_quantized(key_cache):
        raise ValueError(f"query dtype {q.dtype} != cache dtype {key_cache.dtype}")
    if q.shape[2] != head_dim:
        raise ValueError(f"query head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.stride(-1) != 1:
        raise ValueError("query must be contiguous along head_dim")
    heads(q.shape[1], num_kv_heads)
    return q, num_blocks, block_size


def _out(out: torch.Tensor | None, query: torch.Tensor) -> None:
    if out is None:
        return
    tensor("out", out, 3)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"want {tuple(query.shape)} {query.dtype} on {query.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along head_dim")


# ---------------------------------------------------------------- one validator per operation
def write_kv_cache(a: Args) -> Where:
    k = tensor("key", a["key"], 3)
    v = tensor("value", a["value"], 3)
    key_cache, value_cache = a["key_cache"], a["value_cache"]
    _, _, num_kv_heads, head_dim = kv_cache_pair(key_cache, value_cache)
    float_dtype("key", k)
    float_dtype("value", v)
    if k.shape != v.shape:
        raise ValueError(f"key shape {tuple(k.shape)} != value shape {tuple(v.shape)}")
    if tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key is [num_tokens, {k.shape[1]}, {k.shape[2]}] but the cache holds "
            f"[..., {num_kv_heads}, {head_dim}] (num_kv_heads, head_dim)"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("key/value must be contiguous along head_dim")
    sm = slot_mapping(a["slot_mapping"], k.shape[0], key_cache)
    dev = same_device(
        ["key_cache", "value_cache", "key", "value", "slot_mapping"], [key_cache, value_cache, k, v, sm]
    )
    return dev, key_cache.dtype


def _attention(a: Args) -> tuple[torch.Tensor, torch.Tensor, torch.device]:
    """What decode and prefill share: query vs. caches, block tables and lengths, devices, ``out``."""
    q, num_blocks, block_size = _query(a["query"], a["key_cache"], a["value_cache"])
    window = sliding_window(a["sliding_window"])
    bt, sl = block_tables_and_lens(
        a["block_tables"], a["seq_lens"], num_blocks, block_size, window, a.get("query_start_loc")
    )
    dev = same_device(
        ["query", "key_cache", "value_cache", "block_tables", "seq_lens"],
        [q, a["key_cache"], a["value_cache"], bt, sl],
    )
    _out(a["out"], q)
    return q, sl, dev


def paged_decode_attention(a: Args) -> Where:
    q, sl, dev = _attention(a)
    if q.shape[0] != sl.shape[0]:
        raise ValueError(f"query has {q.shape[0]} sequences but block_tables has {sl.shape[0]}")
    if a["num_splits"] is not None and a["num_splits"] < 1:
        raise ValueError(f"num_splits must be >= 1, got {a['num_splits']}")
    return dev, _routing_dtype(q, a["key_cache"])


def paged_prefill_attention(a: Args) -> Where:
    q, sl, dev = _attention(a)
    qsl = query_start_loc(a["query_start_loc"], sl, q.shape[0])
    same_device(["query", "query_start_loc"], [q, qsl])
    return dev, _routing_dtype(q, a["key_cache"])


def _routing_dtype(query: torch.Tensor, key_cache: torch.Tensor) -> torch.dtype:
    """The dtype dispatch routes an attention call by: an 8-bit cache's, else the query's."""
    return key_cache.dtype if quant.is_quantized(key_cache) else query.dtype


def copy_blocks(a: Args) -> Where:
    kcs, vcs = list(a["key_caches"]), list(a["value_caches"])
    if not kcs or len(kcs) != len(vcs):
        raise ValueError(
            f"need equal, non-zero numbers of key and value caches, got {len(kcs)} and {len(vcs)}"
        )
    caches = kcs + vcs
    shape = kv_cache_pair(kcs[0], vcs[0])
    for i, c in enumerate(caches):
        tensor(f"cache {i}", c, 4)
        if c.shape != caches[0].shape or c.dtype != caches[0].dtype or c.stride() != caches[0].stride():
            raise ValueError("all key/value caches must share shape, dtype and strides")
    p = pairs_tensor(a["pairs"], shape[0])
    dev = same_device([f"cache {i}" for i in range(len(caches))], caches)
    if p.device.type == "cpu" and p.numel():
        dst = p[:, 1]
        if dst.unique().numel() != dst.numel() or bool(torch.isin(dst, p[:, 0]).any()):
            raise ValueError("copy_blocks: destination blocks must be distinct and not also sources")
    elif p.device != dev:
        raise ValueError(f"pairs is on {p.device}; put it on the CPU or the caches' device {dev}")
    a["key_caches"], a["value_caches"] = kcs, vcs
    return (dev, caches[0].dtype) if p.shape[0] else None


def swap_blocks(a: Args) -> Where:
    """Where a swap runs is the device side of it (a swap moves blocks between CPU and device)."""
    srcs = [a["src"]] if isinstance(a["src"], torch.Tensor) else list(a["src"])
    dsts = [a["dst"]] if isinstance(a["dst"], torch.Tensor) else list(a["dst"])
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(
            f"src and dst must hold the same non-zero number of caches ({len(srcs)} vs {len(dsts)})"
        )
    for i, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
        tensor(f"src[{i}]", s)
        tensor(f"dst[{i}]", d)
        if s.dim() < 1 or tuple(s.shape[1:]) != tuple(d.shape[1:]) or s.dtype != d.dtype:
            raise ValueError(
                f"src[{i}] {tuple(s.shape)} {s.dtype} and dst[{i}] {tuple(d.shape)} {d.dtype} must agree "
                "in block shape and dtype"
            )
    p = pairs_tensor(a["pairs"], srcs[0].shape[0], dsts[0].shape[0])
    a["src"], a["dst"] = srcs, dsts
    if p.shape[0] == 0:
        return None
    dev = next((t.device for t in (srcs[0], dsts[0]) if t.device.type != "cpu"), srcs[0].device)
    return dev, srcs[0].dtype
