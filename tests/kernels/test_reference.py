"""The torch reference against an independent, naive oracle (dense SDPA per sequence).

Why: every Triton kernel is judged against ``pagedkv.kernels.reference``, so the reference itself must be
right. The oracle shares no code with it: it gathers each sequence's K/V block by block in a Python
loop and calls ``torch.nn.functional.scaled_dot_product_attention`` in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.kernels import reference
from tests.kernels.cases import generator, make_paged, randn

CPU = torch.device("cpu")


def _dense_kv(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    bs = cache.shape[1]
    rows = [cache[int(table[t // bs]), t % bs] for t in range(n)]
    return torch.stack(rows).double()  # [n, kv_heads, d]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int) -> torch.Tensor:
    """q [m, H, d] at positions q_offset.., k/v [n, Hkv, d] -> [m, H, d], causal by absolute position."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    m, n = q.shape[0], k.shape[0]
    mask = torch.arange(n)[None, :] <= (q_offset + torch.arange(m))[:, None]
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_reference_decode_matches_sdpa(heads: tuple[int, int], head_dim: int) -> None:
    h, hkv = heads
    case = make_paged([1, 16, 17, 45], 16, hkv, head_dim, torch.float32, seed=1)
    case = _on_cpu(case)
    q = randn((4, h, head_dim), torch.float32, generator(2)).cpu()
    scale = head_dim**-0.5
    out = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale
    )
    for i, n in enumerate(case.seq_lens.tolist()):
        k = _dense_kv(case.key_cache, case.block_tables[i], n)
        v = _dense_kv(case.value_cache, case.block_tables[i], n)
        want = _sdpa(q[i : i + 1], k, v, scale, n - 1)[0]
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
def test_reference_prefill_matches_sdpa(heads: tuple[int, int]) -> None:
    h, hkv = heads
    lens, q_lens = [1, 16, 17, 40], [1, 16, 5, 23]  # full prompts and chunks after a cached prefix
    case = _on_cpu(make_paged(lens, 8, hkv, 32, torch.float32, seed=3))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = randn((sum(q_lens), h, 32), torch.float32, generator(4)).cpu()
    out = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.2
    )
    for i, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
        k = _dense_kv(case.key_cache, case.block_tables[i], n)
        v = _dense_kv(case.value_cache, case.block_tables[i], n)
        want = _sdpa(q[int(qsl[i]) : int(qsl[i + 1])], k, v, 0.2, n - m)
        torch.testing.assert_close(out[int(qsl[i]) : int(qsl[i + 1])].double(), want, rtol=1e-5, atol=1e-6)


def test_reference_write_and_copy_and_swap() -> None:
    gen = generator(5)
    kc = torch.randn(6, 4, 2, 8, generator=gen)
    vc = torch.randn(6, 4, 2, 8, generator=gen)
    key = torch.randn(3, 2, 8, generator=gen)
    val = torch.randn(3, 2, 8, generator=gen)
    before_k, before_v = kc.clone(), vc.clone()
    reference.write_kv_cache(key, val, kc, vc, torch.tensor([9, -1, 0]))
    assert torch.equal(kc[2, 1], key[0]) and torch.equal(vc[0, 0], val[2])
    untouched = torch.ones(6, 4, dtype=torch.bool)
    untouched[2, 1] = untouched[0, 0] = False
    assert torch.equal(kc[untouched], before_k[untouched]) and torch.equal(vc[untouched], before_v[untouched])

    kc2, vc2 = kc.clone(), vc.clone()
    reference.copy_blocks([kc2], [vc2], torch.tensor([[1, 4], [2, 5]]))
    assert torch.equal(kc2[4], kc[1]) and torch.equal(vc2[5], vc[2]) and torch.equal(kc2[:4], kc[:4])

    dst = torch.randn(3, 4, 2, 8, generator=gen)
    reference.swap_blocks(kc, dst, torch.tensor([[5, 0], [1, 2]]))
    assert torch.equal(dst[0], kc[5]) and torch.equal(dst[2], kc[1])


def _on_cpu(case):  # type: ignore[no-untyped-def]
    case.key_cache, case.value_cache = case.key_cache.cpu(), case.value_cache.cpu()
    case.block_tables, case.seq_lens = case.block_tables.cpu(), case.seq_lens.cpu()
    return case
