"""Sliding-window attention cases: paged caches whose blocks before each sequence's window were
released, and a float64 oracle written here (plain softmax over each query's window).

Why its own oracle and not the reference: the reference implements the window too, so checking a
backend against it would share any mistake in the rule. Here a query at position ``p`` sees keys
``p - W < j <= p`` (Hugging Face Gemma 3's mask: kept iff ``q_pos - k_pos < sliding_window``),
computed from the K/V as they were before any block was released. Released blocks (wholly before
the window of every query of their sequence) are then poisoned: their rows NaN (an int8 cache's
scales NaN), and with ``release="minus_one"`` their block-table entries -1 as well, so a kernel
that reads one returns NaN (or faults) instead of a plausible answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv.kernels import quant
from tests.kernels.cases import DEVICE, PAD_BLOCK, generator

NAN_SCALE = torch.tensor([float("nan")], dtype=torch.float32).view(torch.int8)  # 4 bytes


@dataclass
class WindowCase:
    query: torch.Tensor  # [tokens, heads, head_dim]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32, released entries -1 or pointing at NaN blocks
    seq_lens: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32 [seqs + 1]
    scale: float
    window: int | None
    want: torch.Tensor  # float64 [tokens, heads, head_dim]
    released: int  # blocks released over the batch


def first_position(seq_len: int, q_len: int, window: int | None) -> int:
    """The first key position any of the sequence's queries sees."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], window: int | None, scale: float
) -> torch.Tensor:
    """float64 attention of one sequence's queries ``[n, H, D]`` at positions ``q_pos`` over its dense
    ``[L, Hkv, D]`` K/V: a plain softmax over the keys ``p - W < j <= p`` of each query."""
    if k.shape[0] == 0:  # nothing cached: attends to nothing
        return torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    p = torch.tensor(q_pos)[:, None]
    j = torch.arange(k.shape[0])[None, :]
    keep = j <= p
    if window is not None:
        keep &= p - j < window
    s = torch.einsum("qhd,khd->qhk", q.double(), kk) * scale
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("qhk,khd->qhd", torch.softmax(s, dim=-1), vv)


def build(
    seq_lens: list[int],
    q_lens: list[int],
    window: int | None,
    *,
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    kv: str = "float",
    seed: int = 0,
    release: str | None = "nan",
    device: torch.device = DEVICE,
) -> WindowCase:
    """A batch whose sequence i has ``seq_lens[i]`` cached tokens, the last ``q_lens[i]`` of them
    queries (decode: all 1). ``kv``: "float" (cache in ``dtype``) or "int8" (kernels/quant.py, fp32
    query). ``release``: None (nothing released), "nan" (released blocks' rows NaN, entries kept) or
    "minus_one" (rows NaN and entries -1)."""
    gen = generator(seed)
    need = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(need) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Tokens of different magnitudes, so a row read from the wrong place is a visible error.
    mag = torch.rand((num_blocks, block_size, 1, 1), generator=gen) * 2 + 0.5
    k_f = torch.randn(shape, generator=gen) * mag
    v_f = torch.randn(shape, generator=gen) * mag
    if kv == "int8":
        kc, vc = (quant.pack(*quant.quantize(x, torch.int8)) for x in (k_f, v_f))
        k_dense, v_dense = quant.dequantize(kc), quant.dequantize(vc)
    else:
        kc, vc = k_f.to(dtype), v_f.to(dtype)
        k_dense, v_dense = kc.double(), vc.double()
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(need) + 1), PAD_BLOCK, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    tokens = sum(q_lens)
    q = (torch.randn((tokens, num_heads, head_dim), generator=gen) * 0.5).to(
        torch.float32 if kv == "int8" else dtype
    )
    scale = head_dim**-0.5
    want = torch.empty((tokens, num_heads, head_dim), dtype=torch.float64)
    starts, r = [0], 0
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        ids = table[i, : need[i]].long()
        k_seq = k_dense[ids].reshape(-1, num_kv_heads, head_dim)[:n]
        v_seq = v_dense[ids].reshape(-1, num_kv_heads, head_dim)[:n]
        want[r : r + ql] = oracle(q[r : r + ql], k_seq, v_seq, list(range(n - ql, n)), window, scale)
        r += ql
        starts.append(r)
    released = 0
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        if release is None:
            break
        for b in range(first_position(n, ql, window) // block_size):
            blk = int(table[i, b])
            if kv == "int8":
                kc[blk, :, :, -quant.SCALE_BYTES :] = NAN_SCALE
                vc[blk, :, :, -quant.SCALE_BYTES :] = NAN_SCALE
            else:
                kc[blk] = float("nan")
                vc[blk] = float("nan")
            if release == "minus_one":
                table[i, b] = -1
            released += 1
    return WindowCase(
        q.to(device),
        kc.to(device),
        vc.to(device),
        table.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        scale,
        window,
        want,
        released,
    )


def tolerance(case: WindowCase) -> dict[str, float]:
    """Against the float64 oracle: fp32 kernels (and int8 caches, read exactly) to fp32 rounding."""
    dt = case.query.dtype
    if dt == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    if dt == torch.float16:
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 3e-2, "atol": 3e-2}


def check(case: WindowCase, got: torch.Tensor) -> None:
    assert not torch.isnan(got).any(), "NaN in the output: a released block read, or a row not written"
    torch.testing.assert_close(got.double().cpu(), case.want, **tolerance(case))


# Decode: lengths 1, a block, one past it, ragged ones, and windows smaller than, equal to (33) and
# larger than the contexts, multiples of the block size (16) and not.
DECODE_LENS = [1, 7, 16, 17, 33, 50, 95]
DECODE_WINDOWS = [1, 7, 16, 33, 40, 200]
# Prefill: (seq_len, q_len): whole prompts, chunks after a cached prefix, one-row chunks.
PREFILL_SHAPES = [(1, 1), (20, 20), (40, 7), (70, 33), (17, 1), (45, 45)]
PREFILL_WINDOWS = [1, 6, 16, 33, 300]
