"""Input validation shared by both backends.

Why a separate module: the Triton kernels do raw pointer arithmetic, so a wrong shape, dtype or
device is a silent wrong answer or a memory fault rather than an exception. Every public entry point
checks its arguments here first and raises ``ValueError`` with a message naming the argument.
Checks that would need a device->host copy (block ids in range, lengths within the block table) only
run when the index tensors live on the CPU, so the CUDA hot path never synchronises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
    for n, t in zip(names, tensors):
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device} but {names[0]} is on {dev}: all must share a device")
    return dev


def kv_cache_pair(key_cache: object, value_cache: object) -> tuple[int, int, int, int]:
    """Check a layer's caches; return (num_blocks, block_size, num_kv_heads, head_dim)."""
    kc = tensor("key_cache", key_cache, 4)
    vc = tensor("value_cache", value_cache, 4)
    float_dtype("key_cache", kc)
    if vc.shape != kc.shape:
        raise ValueError(f"value_cache shape {tuple(vc.shape)} != key_cache shape {tuple(kc.shape)}")
    if vc.dtype != kc.dtype:
        raise ValueError(f"value_cache dtype {vc.dtype} != key_cache dtype {kc.dtype}")
    if kc.stride(-1) != 1 or vc.stride(-1) != 1:
        raise ValueError("key_cache/value_cache must be contiguous along head_dim (stride(-1) == 1)")
    nb, bs, hkv, d = (int(x) for x in kc.shape)
    if nb < 1 or bs < 1 or hkv < 1 or d < 1:
        raise ValueError(f"empty KV cache shape {tuple(kc.shape)}")
    return nb, bs, hkv, d


def heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA/MQA"
        )


def block_table_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Value checks (CPU index tensors only): lengths fit the table, used block ids are in range."""
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
    used_blocks = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    cols = torch.arange(max_blocks).unsqueeze(0)
    used = block_tables[cols < used_blocks.unsqueeze(1)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) for used blocks")


def pairs_tensor(pairs: object, num_blocks: int | None = None, dst_num_blocks: int | None = None) -> torch.Tensor:
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
