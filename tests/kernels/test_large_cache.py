"""A cache with more than 2^31 elements: block ids must be widened before address arithmetic.

On CPU the 4 GiB cache is ``torch.empty`` (the OS commits only the pages we touch), so the test
costs a few MB; on a GPU it is a real 4 GiB allocation.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import reference
from tests.kernels.cases import DEVICE, generator, randn

pytestmark = pytest.mark.usefixtures("triton_backend")

BLOCK, HEADS, DIM = 16, 1, 64
NUM_BLOCKS = 2**31 // (BLOCK * HEADS * DIM) + 64  # just over 2^31 elements per cache


@pytest.fixture(scope="module")
def huge_caches() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        kc = torch.empty((NUM_BLOCKS, BLOCK, HEADS, DIM), dtype=torch.float16, device=DEVICE)
        vc = torch.empty((NUM_BLOCKS, BLOCK, HEADS, DIM), dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"cannot reserve a 2 x 4 GiB cache here: {exc}")
    assert kc.numel() > 2**31
    return kc, vc


def test_write_decode_copy_beyond_2_pow_31(huge_caches: tuple[torch.Tensor, torch.Tensor]) -> None:
    kc, vc = huge_caches
    gen = generator(1)
    high = [NUM_BLOCKS - 1, NUM_BLOCKS - 40, NUM_BLOCKS - 7]  # all past element 2^31
    n = 40  # 3 blocks: 16 + 16 + 8
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in high])[:n].to(DEVICE)
    key = randn((n, HEADS, DIM), torch.float16, gen)
    value = randn((n, HEADS, DIM), torch.float16, gen)
    kernels.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc[high[1], 3].cpu(), key[BLOCK + 3].cpu())

    bt = torch.tensor([high], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    q = randn((1, 2, DIM), torch.float16, gen)
    got = kernels.paged_decode_attention(q, kc, vc, bt, sl, 0.125, num_splits=2)
    want = reference.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)

    dst = NUM_BLOCKS - 20
    kernels.copy_blocks([kc], [vc], torch.tensor([[high[0], dst]]))
    assert torch.equal(kc[dst].cpu(), kc[high[0]].cpu()) and torch.equal(vc[dst].cpu(), vc[high[0]].cpu())
