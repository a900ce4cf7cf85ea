"""Triton paged decode (interpreted on CPU, compiled on CUDA) against the torch reference.

Cases stay small because the interpreter costs a few ms per (program x KV tile): each case is a
handful of sequences x kv heads x a few 64-token tiles.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import decode, reference
from tests.kernels.cases import (
    assert_close,
    dtypes_cpu_gpu,
    generator,
    make_paged,
    poisoned_like,
    ragged_lens,
    randn,
)

pytestmark = pytest.mark.usefixtures("triton_backend")


def _run(case, num_heads: int, dtype: torch.dtype, seed: int, **kw: object) -> None:  # type: ignore[no-untyped-def]
    num_seqs = case.seq_lens.shape[0]
    head_dim = case.key_cache.shape[3]
    q = randn((num_seqs, num_heads, head_dim), dtype, generator(seed))
    scale = head_dim**-0.5
    out = poisoned_like(q)
    got = kernels.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale, out=out, **kw
    )
    assert got is out
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale
    )
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", dtypes_cpu_gpu())
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_dtypes_and_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    case = make_paged(ragged_lens(16, 150), 16, 2, head_dim, dtype, seed=head_dim)
    _run(case, 4, dtype, seed=head_dim + 1)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_decode_block_sizes(block_size: int) -> None:
    case = make_paged(
        ragged_lens(block_size, 2 * block_size + 3), block_size, 2, 64, torch.float32, seed=block_size
    )
    _run(case, 4, torch.float32, seed=7)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_forced_splits(num_splits: int, dtype: torch.dtype) -> None:
    """Split-KV and its reduce, including splits left empty for short sequences."""
    case = make_paged([1, 17, 64, 65, 300], 16, 1, 64, dtype, seed=num_splits)
    _run(case, 2, dtype, seed=11, num_splits=num_splits)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1), (32, 1)], ids=["mha", "gqa4", "mqa8", "mqa32"])
def test_decode_gqa_mqa(heads: tuple[int, int]) -> None:
    h, hkv = heads
    case = make_paged([1, 33, 97], 16, hkv, 64, torch.float32, seed=h * 10 + hkv)
    _run(case, h, torch.float32, seed=13)


@pytest.mark.parametrize("layout", ["layers", "blocks_outer"])
def test_decode_strided_cache_views(layout: str) -> None:
    """A layer passed as a view of an all-layers tensor (contiguous slice, and a strided one)."""
    case = make_paged([5, 32, 70], 16, 2, 80, torch.float16, seed=17, layout=layout)
    _run(case, 4, torch.float16, seed=19, num_splits=2)


def test_decode_auto_splits_with_max_seq_len_hint() -> None:
    case = make_paged([3, 260, 520], 16, 1, 64, torch.float32, seed=23)
    _run(case, 4, torch.float32, seed=29, max_seq_len=520)


def test_decode_int64_block_tables_and_lens() -> None:
    case = make_paged([16, 17], 16, 2, 64, torch.float32, seed=31)
    case.block_tables = case.block_tables.long()
    case.seq_lens = case.seq_lens.long()
    _run(case, 4, torch.float32, seed=37)


def test_choose_num_splits_fills_the_gpu() -> None:
    """Small batches with long contexts split; big batches and short contexts do not."""
    sms = 132
    assert decode.choose_num_splits(1, 8, 32768, sms) * 8 >= 2 * sms
    assert decode.choose_num_splits(16, 8, 4096, sms) > 1
    assert decode.choose_num_splits(64, 8, 4096, sms) == 1
    assert decode.choose_num_splits(256, 8, 16384, sms) == 1
    assert decode.choose_num_splits(1, 8, 200, sms) == 1  # too short to be worth a reduce
    assert decode.choose_num_splits(1, 1, 10**6, sms) == decode.MAX_SPLITS


@pytest.mark.parametrize("head_dim", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_head_dim_below_16(head_dim: int, dtype: torch.dtype) -> None:
    """The tile is padded to 16 columns (tl.dot needs K >= 16 on a GPU); padding must not leak."""
    case = make_paged([1, 17, 90], 16, 2, head_dim, dtype, seed=head_dim)
    _run(case, 6, dtype, seed=head_dim + 3)  # group 3: not a power of two
    _run(case, 6, dtype, seed=head_dim + 4, num_splits=2)
