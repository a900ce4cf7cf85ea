"""Builders for paged-attention test cases: random caches, shuffled block tables, ragged lengths.

Why a module of its own: every kernel test needs the same ingredients (fresh seeded random data,
never zeros; non-contiguous block tables; padding entries that would fault if read), and the
tolerances per dtype live in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# True only under tests/kernels/gpu_image_plugin.py: CUDA is pretended, not there. Code that really
# calls the CUDA runtime (torch.compile's and opcheck's RNG bookkeeping) cannot run under it.
PRETENDED_CUDA = False
# Block-table padding: an id no cache has, so a kernel that reads past a sequence's blocks faults
# (GPU) or trips the reference's range check instead of silently reading a valid block.
PAD_BLOCK = 1_000_000

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (the interpreter cannot do bf16 math)")


def dtypes_cpu_gpu() -> list[object]:
    """fp32 and fp16 everywhere; bf16 only on a GPU."""
    return [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=cuda_only)]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        # Exact in the interpreter; on a GPU the float32 dots are tf32x3 (about, not exactly, fp32).
        return {"rtol": 1e-4, "atol": 1e-4} if HAS_CUDA else {"rtol": 1e-5, "atol": 1e-5}
    if dtype == torch.float16:
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 3e-2, "atol": 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "output has NaN (an element the kernel never wrote?)"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tolerance(dtype))


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel forgets to write stays NaN."""
    return torch.full_like(t, float("nan"))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=DEVICE)


@dataclass
class PagedCache:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.key_cache.shape[1])


def make_caches(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    layout: str = "plain",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (key_cache, value_cache), random.

    ``layout``: "plain" (two tensors), "layers" (views of a [layers, 2, blocks, ...] tensor) or
    "blocks_outer" (views of a [blocks, layers, 2, ...] tensor: a strided, non-contiguous layer).
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "plain":
        return randn(shape, dtype, gen), randn(shape, dtype, gen)
    if layout == "layers":
        big = randn((3, 2, *shape), dtype, gen)
        return big[1, 0], big[1, 1]
    if layout == "blocks_outer":
        big = randn((num_blocks, 3, 2, *shape[1:]), dtype, gen)
        kc, vc = big[:, 2, 0], big[:, 2, 1]
        assert not kc.is_contiguous()
        return kc, vc
    raise ValueError(layout)


def make_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Shuffled, distinct physical blocks per sequence; unused entries hold PAD_BLOCK."""
    need = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    assert sum(need) <= num_blocks, "cache too small for the case"
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(need) + 1  # one spare column of padding
    table = torch.full((len(seq_lens), max_blocks), PAD_BLOCK, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[pos : pos + n].to(torch.int32)
        pos += n
    return table.to(DEVICE)


def make_paged(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    layout: str = "plain",
    spare_blocks: int = 3,
) -> PagedCache:
    gen = generator(seed)
    num_blocks = sum(max(1, math.ceil(n / block_size)) for n in seq_lens) + spare_blocks
    kc, vc = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen, layout)
    bt = make_block_tables(seq_lens, block_size, num_blocks, gen)
    return PagedCache(kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def ragged_lens(block_size: int, longest: int) -> list[int]:
    """Length 1, exactly one block, one past a block boundary, and a long ragged one."""
    return [1, block_size, block_size + 1, longest]


def triton_backend_active() -> bool:
    """Whether calls on DEVICE tensors run the Triton kernels (GPU, or the interpreter on CPU)."""
    return kernels.backend_for(torch.empty(1, device=DEVICE)) == "triton"


# The GQA group sizes of the model families pagedkv runs: SmolLM2 (9/3) has group 3; Qwen2-0.5B and
# Qwen2-7B (14/2, 28/4) 7; Qwen2.5-1.5B (12/2) 6; 5 stands for any other odd group.
GQA_GROUPS = [3, 5, 6, 7]
GQA_NUM_KV_HEADS = 2


def check_decode_group(num_heads: int, dtype: torch.dtype, lens: list[int], seed: int) -> None:
    """Paged decode at ``num_heads`` over GQA_NUM_KV_HEADS KV heads (head_dim 64) through the selected
    backend, against the reference (test_group_sizes*.py)."""
    case = make_paged(lens, 16, GQA_NUM_KV_HEADS, 64, dtype, seed=seed)
    q = randn((len(lens), num_heads, 64), dtype, generator(seed + 1))
    out = poisoned_like(q)
    got = kernels.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, out=out
    )
    assert got is out
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    assert_close(got, want, dtype)


def check_prefill_group(num_heads: int, dtype: torch.dtype, shape: list[tuple[int, int]], seed: int) -> None:
    case = make_paged([s for s, _ in shape], 16, GQA_NUM_KV_HEADS, 64, dtype, seed=seed)
    starts = [0]
    for _, n in shape:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = randn((starts[-1], num_heads, 64), dtype, generator(seed + 1))
    out = poisoned_like(q)
    got = kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125, out=out
    )
    assert got is out
    want = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125
    )
    assert_close(got, want, dtype)
