"""write_kv_cache, copy_blocks and swap_blocks: Triton / batched paths against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import reference, swap
from tests.kernels.cases import DEVICE, HAS_CUDA, dtypes_cpu_gpu, generator, make_caches, randn


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("dtype", dtypes_cpu_gpu())
@pytest.mark.parametrize("layout", ["plain", "layers", "blocks_outer"])
def test_write_kv_cache_skips_padding(dtype: torch.dtype, layout: str) -> None:
    gen = generator(1)
    kc, vc = make_caches(7, 8, 2, 80, dtype, gen, layout)
    # key/value as strided views of a fused qkv projection output (token stride > heads * dim).
    qkv = randn((9, 6, 80), dtype, gen)
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([3, -1, 8, 15, 16, -1, 55, 0, 40], dtype=torch.int64, device=DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(key, value, want_k, want_v, slots)
    kernels.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # The padding tokens (-1) were written nowhere: every slot that changed is a real slot.
    written = torch.tensor([3, 8, 15, 16, 55, 0, 40])
    assert torch.equal(kc.reshape(56, 2, 80)[written].cpu(), key[slots >= 0].cpu())


def _layer_views(
    layout: str, gen: torch.Generator, layers: int = 3
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if layout == "6d":
        big = randn((layers, 2, 10, 16, 2, 64), torch.float16, gen)
        return [big[i, 0] for i in range(layers)], [big[i, 1] for i in range(layers)]
    if layout == "blocks_outer":
        big = randn((10, layers, 2, 16, 2, 64), torch.float16, gen)
        return [big[:, i, 0] for i in range(layers)], [big[:, i, 1] for i in range(layers)]
    return (
        [randn((10, 16, 2, 64), torch.float16, gen) for _ in range(layers)],
        [randn((10, 16, 2, 64), torch.float16, gen) for _ in range(layers)],
    )


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["separate", "6d", "blocks_outer"])
def test_copy_blocks_all_layers(layout: str) -> None:
    kcs, vcs = _layer_views(layout, generator(2))
    want_k = [c.clone() for c in kcs]
    want_v = [c.clone() for c in vcs]
    pairs = torch.tensor([[1, 7], [4, 2], [9, 0]], dtype=torch.int64)
    reference.copy_blocks(want_k, want_v, pairs)
    kernels.copy_blocks(kcs, vcs, pairs)
    for got, want in zip(kcs + vcs, want_k + want_v, strict=True):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_overlapping_pairs() -> None:
    kcs, vcs = _layer_views("separate", generator(3), layers=1)
    with pytest.raises(ValueError, match="distinct"):
        kernels.copy_blocks(kcs, vcs, torch.tensor([[1, 2], [2, 3]]))
    with pytest.raises(ValueError, match="distinct"):
        kernels.copy_blocks(kcs, vcs, torch.tensor([[1, 2], [3, 2]]))


SWAP_DEVICES = [("cpu", "cpu")] + ([("cuda", "cpu"), ("cpu", "cuda")] if HAS_CUDA else [])


@pytest.mark.parametrize("src_dev,dst_dev", SWAP_DEVICES)
@pytest.mark.parametrize(
    "pairs",
    [[[0, 3]], [[2, 5], [3, 6], [4, 7]], [[7, 1], [0, 4], [5, 0], [2, 6], [6, 2], [1, 7]]],
    ids=["one", "one-run", "scattered"],
)
def test_swap_blocks(src_dev: str, dst_dev: str, pairs: list[list[int]]) -> None:
    gen = generator(4)
    pin = HAS_CUDA and "cpu" in (src_dev, dst_dev)
    src = torch.randn((8, 16, 2, 64), generator=gen).to(src_dev)
    dst = torch.randn((8, 16, 2, 64), generator=gen).to(dst_dev)
    if pin:
        src = src.pin_memory() if src_dev == "cpu" else src
        dst = dst.pin_memory() if dst_dev == "cpu" else dst
    want = dst.cpu().clone()
    p = torch.tensor(pairs)
    reference.swap_blocks(src.cpu(), want, p)
    kernels.swap_blocks(src, dst, p)
    assert torch.equal(dst.cpu(), want)


def test_swap_blocks_many_layers_staging_path() -> None:
    """Per-layer sequences, scattered pairs (more runs than copied directly): the staging path."""
    gen = generator(5)
    srcs = [torch.randn((12, 8, 1, 32), generator=gen) for _ in range(4)]
    dsts = [torch.randn((6, 8, 1, 32), generator=gen) for _ in range(4)]
    p = torch.tensor([[11, 0], [3, 5], [7, 1], [0, 3], [5, 2], [9, 4]])
    assert len(swap.contiguous_runs(p.tolist())) > swap.MAX_DIRECT_RUNS
    wants = [d.clone() for d in dsts]
    for s, w in zip(srcs, wants, strict=True):
        reference.swap_blocks(s, w, p)
    kernels.swap_blocks(srcs, dsts, p)
    for d, w in zip(dsts, wants, strict=True):
        assert torch.equal(d, w)


def test_contiguous_runs() -> None:
    assert swap.contiguous_runs([[2, 5], [3, 6], [4, 7], [9, 1], [10, 2], [0, 0]]) == [
        (2, 5, 3),
        (9, 1, 2),
        (0, 0, 1),
    ]


def test_contiguous_pieces_of_block_major_views() -> None:
    """A run of blocks in a block-major view ([N, L, 2, ...] of an [L, 2, N, ...] cache) splits into
    L * 2 pieces contiguous on both sides: what a swap DMAs straight into the pinned pool."""
    gen = generator(6)
    layers = 3
    src = torch.randn((layers, 2, 10, 4, 2, 8), generator=gen)
    dst = torch.randn((layers, 2, 7, 4, 2, 8), generator=gen)
    want = dst.clone()
    want[:, :, 2:5] = src[:, :, 6:9]
    d_view, s_view = dst.permute(2, 0, 1, 3, 4, 5)[2:5], src.permute(2, 0, 1, 3, 4, 5)[6:9]
    assert not d_view.is_contiguous()
    pieces = list(swap.contiguous_pieces(d_view, s_view))
    assert len(pieces) == layers * 2
    for d, s in pieces:
        assert d.is_contiguous() and s.is_contiguous() and d.shape == (3, 4, 2, 8)
        d.copy_(s)
    assert torch.equal(dst, want)
    contiguous = torch.empty((3, 4, 2, 8))
    assert [p[0] is contiguous for p in swap.contiguous_pieces(contiguous, contiguous)] == [True]


@pytest.mark.parametrize("src_dev,dst_dev", SWAP_DEVICES)
def test_swap_blocks_block_major_views_all_layers(src_dev: str, dst_dev: str) -> None:
    """The worker's call: every layer's K and V in one swap through permuted views (runs and scattered)."""
    gen = generator(7)
    src = torch.randn((4, 2, 12, 8, 2, 16), generator=gen).to(src_dev)
    dst = torch.randn((4, 2, 9, 8, 2, 16), generator=gen)
    dst = dst.pin_memory() if (HAS_CUDA and dst_dev == "cpu") else dst.to(dst_dev)
    for pairs in ([[3, 0], [4, 1], [5, 2]], [[11, 0], [3, 5], [7, 1], [0, 3], [5, 2], [9, 4]]):
        want = dst.cpu().clone()
        p = torch.tensor(pairs)
        reference.swap_blocks(src.cpu().permute(2, 0, 1, 3, 4, 5), want.permute(2, 0, 1, 3, 4, 5), p)
        kernels.swap_blocks(src.permute(2, 0, 1, 3, 4, 5), dst.permute(2, 0, 1, 3, 4, 5), p)
        assert torch.equal(dst.cpu(), want)
