"""Triton paged prefill (interpreted on CPU, compiled on CUDA) against the torch reference.

Each case mixes full prompts (q_len == seq_len) with chunks that follow a cached prefix
(q_len < seq_len), with lengths of 1, exactly a block, and one past a block boundary.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import reference
from tests.kernels.cases import (
    DEVICE,
    assert_close,
    dtypes_cpu_gpu,
    generator,
    make_paged,
    poisoned_like,
    randn,
)

pytestmark = pytest.mark.usefixtures("triton_backend")


def _run(case, q_lens: list[int], num_heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    head_dim = case.key_cache.shape[3]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = randn((starts[-1], num_heads, head_dim), dtype, generator(seed))
    scale = head_dim**-0.5
    out = poisoned_like(q)
    got = kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, scale, out=out
    )
    assert got is out
    want = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, scale
    )
    assert_close(got, want, dtype)
    return got


# (seq_len, q_len) per sequence, for block size 16.
RAGGED = [(1, 1), (16, 16), (17, 17), (40, 7), (33, 1), (70, 45)]


@pytest.mark.parametrize("dtype", dtypes_cpu_gpu())
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_prefill_dtypes_and_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    lens, q_lens = zip(*RAGGED, strict=True)
    case = make_paged(list(lens), 16, 1, head_dim, dtype, seed=head_dim)
    _run(case, list(q_lens), 2, dtype, seed=head_dim + 1)


@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
def test_prefill_block_sizes(block_size: int) -> None:
    pairs = [(1, 1), (block_size, block_size), (block_size + 1, 9), (2 * block_size + 5, block_size + 2)]
    lens, q_lens = zip(*pairs, strict=True)
    case = make_paged(list(lens), block_size, 1, 64, torch.float32, seed=block_size)
    _run(case, list(q_lens), 2, torch.float32, seed=3)


@pytest.mark.parametrize(
    "heads", [(4, 4), (8, 2), (6, 2), (8, 1), (64, 1)], ids=["mha", "gqa4", "gqa3", "mqa8", "mqa64"]
)
def test_prefill_gqa_mqa(heads: tuple[int, int]) -> None:
    """A KV head's query heads are packed into one tile's rows: groups that divide the tile, one
    that does not (3: padding rows), and one larger than the interpreter's 32-row tile (64)."""
    h, hkv = heads
    lens, q_lens = ([17, 50], [17, 20]) if h < 32 else ([9, 21], [9, 4])  # interpreter cost ~ heads
    case = make_paged(lens, 16, hkv, 64, torch.float16, seed=h + hkv)
    _run(case, q_lens, h, torch.float16, seed=5)


@pytest.mark.parametrize("head_dim", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_head_dim_below_16(head_dim: int, dtype: torch.dtype) -> None:
    """The tile is padded to 16 columns (tl.dot needs K >= 16 on a GPU); padding must not leak."""
    case = make_paged([19, 40], 16, 2, head_dim, dtype, seed=head_dim)
    _run(case, [19, 6], 4, dtype, seed=head_dim + 1)


@pytest.mark.parametrize("layout", ["layers", "blocks_outer"])
def test_prefill_strided_cache_views(layout: str) -> None:
    case = make_paged([33, 48], 16, 2, 80, torch.float32, seed=7, layout=layout)
    _run(case, [33, 15], 4, torch.float32, seed=9)


def test_prefill_zero_length_query_run() -> None:
    """A sequence with no new queries in the batch (q_len 0) is skipped, the others are right."""
    case = make_paged([20, 9], 16, 1, 64, torch.float32, seed=11)
    _run(case, [0, 9], 2, torch.float32, seed=13)


def test_chunked_prefill_equals_whole_prompt() -> None:
    """Prefilling a prompt in two chunks (the second attending to the cached first) gives the same
    rows as one pass: the property chunked prefill and prefix caching rely on."""
    n, cut = 45, 19
    case = make_paged([n], 16, 1, 64, torch.float32, seed=15)
    q = randn((n, 2, 64), torch.float32, generator(17))
    qsl = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    whole = kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125
    )
    first = kernels.paged_prefill_attention(
        q[:cut],
        case.key_cache,
        case.value_cache,
        case.block_tables,
        torch.tensor([0, cut], dtype=torch.int32, device=DEVICE),
        torch.tensor([cut], dtype=torch.int32, device=DEVICE),
        0.125,
    )
    second = kernels.paged_prefill_attention(
        q[cut:],
        case.key_cache,
        case.value_cache,
        case.block_tables,
        torch.tensor([0, n - cut], dtype=torch.int32, device=DEVICE),
        case.seq_lens,
        0.125,
    )
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-5, atol=1e-5)


def test_prefill_long_cached_prefix() -> None:
    """A chunk far behind its cached prefix: the mask-free part of the loop runs for every tile
    size (interpreter 32-row tiles, GPU 64/128-row tiles)."""
    case = make_paged([300, 130], 16, 1, 64, torch.float16, seed=19)
    _run(case, [100, 3], 2, torch.float16, seed=21)
