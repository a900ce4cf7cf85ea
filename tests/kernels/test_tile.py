"""The shared online-softmax step (pagedkv.kernels.tile.attend_tile) on rows that see no token at all.

Such a row keeps a running max of -inf; without the guard its exponentials are exp2(-inf - -inf) =
NaN and poison the output. The callers never hand a row a fully masked first tile today, so this
drives the helper directly through a one-program kernel (interpreted on CPU, compiled on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import dispatch
from tests.kernels.cases import DEVICE, generator, randn

pytestmark = pytest.mark.usefixtures("triton_backend")


triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from pagedkv.kernels.tile import attend_tile, dot_precision  # noqa: E402 - needs triton


@triton.jit
def _one_tile(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    limit,
    acc_ptr,
    m_ptr,
    l_ptr,
    M: tl.constexpr,
    D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.arange(0, M)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r[:, None] * D + d[None, :])
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([M, D], dtype=tl.float32)
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    # Rows 0..M/2-1 may see every token; rows M/2.. have q_pos = -1: causally masked everywhere.
    q_pos = tl.where(r < M // 2, 1000, -1)
    acc, m_i, l_i = attend_tile(
        acc,
        m_i,
        l_i,
        q,
        k_ptr,
        v_ptr,
        bt_ptr,
        0,
        0,  # lower: no window, every token from the start
        limit,
        q_pos,
        tl.zeros([M], dtype=tl.int32),  # q_lo: unused without WINDOWED
        16 * D,
        D,
        16 * D,
        D,
        k_ptr,  # the scale pointers and strides: unused without QUANT
        v_ptr,
        0,
        0,
        0,
        0,
        1.0,
        16,
        D,
        16,
        D,
        True,
        True,
        False,  # WINDOWED
        UPCAST,
        PRECISION,
        False,
    )
    tl.store(acc_ptr + r[:, None] * D + d[None, :], acc)
    tl.store(m_ptr + r, m_i)
    tl.store(l_ptr + r, l_i)


@pytest.mark.parametrize("limit", [0, 5], ids=["all_masked", "half_masked"])
def test_fully_masked_rows_stay_finite_and_empty(limit: int) -> None:
    m, d = 16, 16
    gen = generator(limit)
    q = randn((m, d), torch.float32, gen)
    k = randn((1, 16, 1, d), torch.float32, gen)
    v = randn((1, 16, 1, d), torch.float32, gen)
    bt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    acc = torch.full((m, d), float("nan"), device=DEVICE)
    mx = torch.full((m,), float("nan"), device=DEVICE)
    ls = torch.full((m,), float("nan"), device=DEVICE)
    _one_tile[(1,)](
        q,
        k,
        v,
        bt,
        limit,
        acc,
        mx,
        ls,
        M=m,
        D=d,
        UPCAST=True,
        PRECISION=dot_precision(dispatch.triton_interpreted()),
    )
    acc, mx, ls = acc.cpu(), mx.cpu(), ls.cpu()
    assert not acc.isnan().any() and not ls.isnan().any()
    masked = slice(m // 2, m)
    assert torch.equal(ls[masked], torch.zeros(m // 2)) and torch.equal(acc[masked], torch.zeros(m // 2, d))
    assert bool((mx[masked] == float("-inf")).all())
    if limit:  # the visible rows really attended: softmax over the first `limit` tokens
        s = q[: m // 2].cpu() @ k[0, :limit, 0].cpu().T
        p = torch.exp2(s - s.max(1, keepdim=True).values)
        torch.testing.assert_close(ls[: m // 2], p.sum(1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(acc[: m // 2], p @ v[0, :limit, 0].cpu(), rtol=1e-4, atol=1e-4)
