"""Builders for 8-bit KV-cache test cases (kernels/quant.py): the float64 oracle, random quantized
caches with shuffled block tables, and the helpers that run a backend on them.

Why a module of its own: the backend tests (test_quant_kv.py: reference and CPU; test_quant_kv_triton.py:
the Triton kernels, interpreted on CPU, compiled on a GPU) hold every backend to the same oracle on
the same inputs. Caches are built on the CPU through the reference writer and moved to ``device``;
the oracle runs on the CPU in float64.
"""

from __future__ import annotations

import random

import torch

from pagedkv import kernels
from pagedkv.kernels import quant, reference

DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# Padding past a sequence's blocks in a block table: an id no cache has, so a kernel reading it faults.
PAD_BLOCK = 2**30

CASES = [  # heads, kv_heads, head_dim, block_size, lens
    (9, 3, 64, 16, [1, 17, 33, 70, 5]),  # SmolLM2's group of 3
    (4, 4, 32, 8, [3, 40, 9]),
    (8, 2, 128, 16, [129, 1]),
]


def deq64(cache: torch.Tensor) -> torch.Tensor:
    return quant.values(cache).double() * quant.scales(cache).double().unsqueeze(-1)


def _slot(table: list[int], t: int, block_size: int) -> tuple[int, int]:
    return table[t // block_size], t % block_size


def oracle(
    query: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    tables: list[list[int]],
    seq_lens: list[int],
    q_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """float64 causal attention of each sequence's last ``q_len`` rows over its dequantized K/V (CPU)."""
    query, kc, vc = query.cpu(), kc.cpu(), vc.cpu()
    k64, v64 = deq64(kc), deq64(vc)
    bs, hkv = kc.shape[1], kc.shape[2]
    group = query.shape[1] // hkv
    out = torch.zeros(query.shape, dtype=torch.float64)
    heads_kv = torch.arange(query.shape[1]) // group  # query head h reads KV head h // group
    row = 0
    for table, n, ql in zip(tables, seq_lens, q_lens, strict=True):
        slots = [_slot(table, t, bs) for t in range(n)]
        k = torch.stack([k64[s] for s in slots])[:, heads_kv] if n else None  # [n, heads, head_dim]
        v = torch.stack([v64[s] for s in slots])[:, heads_kv] if n else None
        for j in range(ql):
            seen = n - ql + j + 1
            if seen == 0 or k is None or v is None:
                continue
            s = torch.einsum("thd,hd->ht", k[:seen], query[row + j].double()) * scale
            out[row + j] = torch.einsum("ht,thd->hd", torch.softmax(s, -1), v[:seen])
        row += ql
    return out


def batch(
    seed: int,
    kv: str,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    shared: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """An 8-bit cache with ``lens`` sequences written through the reference writer, block ids shuffled;
    the first ``shared`` blocks of every table are the same physical blocks (prefix hits). Tokens
    differ in magnitude (x 0.05 to 20); every slot no sequence owns holds random values and a NaN scale."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = shared + sum(max(0, b - shared) for b in need) + 3
    free = list(range(num_blocks))
    rnd.shuffle(free)
    prefix = [free.pop() for _ in range(shared)]
    tables = [prefix[: min(shared, b)] + [free.pop() for _ in range(max(0, b - shared))] for b in need]
    dt = DTYPES[kv]
    kc = torch.randint(-127, 128, (num_blocks, block_size, kv_heads, head_dim + 4), generator=g).to(
        torch.int8
    )
    kc = kc.view(dt) if dt is not torch.int8 else kc
    vc = kc.clone()
    quant.scales(kc).fill_(float("nan"))
    quant.scales(vc).fill_(float("nan"))
    written: set[tuple[int, int]] = set()
    for table, n in zip(tables, lens, strict=True):
        slots = [b * block_size + o for t in range(n) for b, o in [_slot(table, t, block_size)]]
        fresh = [s for s in slots if (s // block_size, s % block_size) not in written]
        written |= {(s // block_size, s % block_size) for s in fresh}
        mag = torch.rand(len(fresh), kv_heads, 1, generator=g) * 20 + 0.05
        k = torch.randn(len(fresh), kv_heads, head_dim, generator=g) * mag
        v = torch.randn(len(fresh), kv_heads, head_dim, generator=g) * mag.flip(0)
        reference.write_kv_cache(k, v, kc, vc, torch.tensor(fresh, dtype=torch.int64))
    return kc.to(device), vc.to(device), tables


def tables_tensor(tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Block tables as int32 rows padded with PAD_BLOCK (garbage no kernel may read)."""
    width = max(1, *(len(t) for t in tables))
    return torch.tensor(
        [t + [PAD_BLOCK] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )


def q_lens_of(lens: list[int]) -> list[int]:
    """Whole prompts and chunks after a prefix hit, alternately."""
    return [max(1, n // 3) if i % 2 else n for i, n in enumerate(lens)]


def decode(
    backend: str,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
    scale: float,
    **kw: object,
) -> torch.Tensor:
    """``paged_decode_attention`` through ``backend`` into a NaN-poisoned output."""
    out = torch.full_like(q, float("nan"))
    dev = q.device
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        got = kernels.paged_decode_attention(
            q,
            kc,
            vc,
            tables_tensor(tables, dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
            scale,
            out=out,
            **kw,  # type: ignore[arg-type]
        )
    assert got is out
    return out


def prefill(
    backend: str,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
    q_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """``paged_prefill_attention`` through ``backend`` into a NaN-poisoned output."""
    out = torch.full_like(q, float("nan"))
    dev = q.device
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        got = kernels.paged_prefill_attention(
            q,
            kc,
            vc,
            tables_tensor(tables, dev),
            qsl,
            torch.tensor(lens, dtype=torch.int32, device=dev),
            scale,
            out=out,
        )
    assert got is out
    return out
