"""The native prefill kernel (kernels/cpu/csrc/paged_prefill.c through cpu_native.prefill) against the
plain-torch reference, on fresh random inputs with NaN-poisoned outputs and NaN in every cache slot
no sequence owns."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.kernels import reference
from pagedkv.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")


def _case(
    seed: int,
    q_lens: list[int],
    ctx_extra: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """Sequences with ``q_len`` new rows after ``ctx_extra`` cached tokens; the first two sequences
    share their first block (a prefix hit). Unowned slots and blocks hold NaN."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_extra, strict=True)]
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    free = list(range(1, num_blocks))
    rnd.shuffle(free)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kc = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    for i, n in enumerate(seq_lens):
        for b in range(-(-n // block_size)):
            shared = i == 1 and b == 0 and seq_lens[0] >= block_size and n >= block_size
            tables[i, b] = tables[0, 0] if shared else free.pop()
            used = min(block_size, n - b * block_size)
            if not shared:
                kc[tables[i, b], :used] = torch.randn(used, kv_heads, head_dim, generator=g)
                vc[tables[i, b], :used] = torch.randn(used, kv_heads, head_dim, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, head_dim, generator=g)
    return query, kc, vc, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (8, 2, 64, 16),
        (4, 4, 64, 8),
        (16, 2, 128, 16),
        (6, 3, 128, 32),
        (4, 2, 16, 16),
        (6, 2, 96, 8),
    ],
)
@pytest.mark.parametrize(
    ("q_lens", "ctx_extra"),
    [([1], [0]), ([5, 16, 17], [0, 20, 3]), ([40, 33], [200, 100]), ([16, 1, 70], [16, 300, 0])],
)
def test_matches_the_reference(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    q_lens: list[int],
    ctx_extra: list[int],
    variant: str,  # each build's register tiles
) -> None:
    query, kc, vc, tables, qsl, lens = _case(
        sum(q_lens) + heads + block_size, q_lens, ctx_extra, heads, kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    assert cpu_native.prefill(query, kc, vc, tables, qsl, lens, scale, out) is out
    want = reference.paged_prefill_attention(query, kc, vc, tables, qsl, lens, scale)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    query, kc, vc, tables, qsl, lens = _case(3, [30, 7, 50], [64, 10, 0], 9, 3, 64, 16)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.full_like(query, float("nan"))
            results.append(cpu_native.prefill(query, kc, vc, tables, qsl, lens, 0.125, out))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_strided_query_and_output_rows() -> None:
    query, kc, vc, tables, qsl, lens = _case(5, [20, 9], [30, 0], 8, 2, 64, 16)
    wide_q = torch.randn(query.shape[0], 10, 64)
    wide_q[:, 1:9] = query
    wide_out = torch.full((query.shape[0], 12, 64), float("nan"))
    cpu_native.prefill(wide_q[:, 1:9], kc, vc, tables, qsl, lens, 0.125, wide_out[:, 2:10])
    want = reference.paged_prefill_attention(query, kc, vc, tables, qsl, lens, 0.125)
    torch.testing.assert_close(wide_out[:, 2:10], want, rtol=2e-5, atol=2e-5)
    assert wide_out[:, :2].isnan().all() and wide_out[:, 10:].isnan().all()


def test_bad_arguments_raise_and_write_nothing() -> None:
    query, kc, vc, tables, qsl, lens = _case(7, [4, 3], [5, 0], 4, 2, 64, 16)
    out = torch.full_like(query, float("nan"))
    bad = [
        ((query.to(torch.bfloat16), kc.to(torch.bfloat16), vc.to(torch.bfloat16), tables, qsl, lens), "fp32"),
        ((query[..., :40], kc[..., :40], vc[..., :40], tables, qsl, lens), "multiple of 16"),
        ((query, kc, vc, tables.long(), qsl, lens), "block_tables"),
        ((query, kc, vc, tables, qsl[:-1], lens), "query_start_loc"),
        ((query, kc, vc, tables[:1], qsl, lens), "block_tables"),
        ((query, kc, vc, tables, qsl, lens.long()), "seq_lens"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            cpu_native.prefill(*args, 0.125, out)
    with pytest.raises(ValueError, match="out"):
        cpu_native.prefill(query, kc, vc, tables, qsl, lens, 0.125, out[:-1])
    with pytest.raises(ValueError, match="more new rows than tokens"):  # 4 new rows, 3 tokens
        cpu_native.prefill(query, kc, vc, tables, qsl, torch.tensor([3, 3], dtype=torch.int32), 0.125, out)
    with pytest.raises(ValueError, match="within query's 7 rows"):
        bad_starts = torch.tensor([0, 4, 9], dtype=torch.int32)
        cpu_native.prefill(query, kc, vc, tables, bad_starts, lens, 0.125, out)
    assert out.isnan().all()
