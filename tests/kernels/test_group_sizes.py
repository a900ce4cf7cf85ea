"""The GQA group sizes of the model families pagedkv runs, on every kernel backend.

SmolLM2 (9 query heads over 3 KV heads) has group 3; Qwen2-0.5B and Qwen2-7B (14/2, 28/4) 7;
Qwen2.5-1.5B (12/2) 6; 5 stands for any other odd group. The native CPU decode kernel has
specialised paths for some groups and a generic one for the rest: these groups take the generic
path (or whatever the kernel picks), the gather + SDPA buckets, and the Triton kernels (interpreted
on CPU: small cases). Fresh random inputs, NaN-poisoned outputs, against the torch reference.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_native, reference
from tests.kernels.cases import DEVICE, assert_close, generator, make_paged, poisoned_like, randn

GROUPS = [3, 5, 6, 7]
NUM_KV_HEADS = 2


def _decode(num_heads: int, dtype: torch.dtype, lens: list[int], seed: int) -> None:
    case = make_paged(lens, 16, NUM_KV_HEADS, 64, dtype, seed=seed)
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


def _prefill(num_heads: int, dtype: torch.dtype, shape: list[tuple[int, int]], seed: int) -> None:
    case = make_paged([s for s, _ in shape], 16, NUM_KV_HEADS, 64, dtype, seed=seed)
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


@pytest.fixture(params=["native", "buckets"])
def cpu_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        pytest.skip("CPU backend cases (CPU tensors)")
    if request.param == "buckets":
        monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    elif not cpu_native.available():
        pytest.skip("no C compiler: the native decode kernel cannot be built here")
    with kernels.use_backend("cpu"):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
def test_cpu_decode(group: int, dtype: torch.dtype, cpu_backend: str) -> None:
    _decode(group * NUM_KV_HEADS, dtype, [1, 16, 17, 150, 33, 97, 2], seed=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
def test_cpu_prefill(group: int, dtype: torch.dtype, cpu_backend: str) -> None:
    _prefill(group * NUM_KV_HEADS, dtype, [(40, 40), (70, 23), (16, 1), (33, 0), (129, 17)], seed=group + 20)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("group", GROUPS)
def test_triton_decode(group: int) -> None:
    _decode(group * NUM_KV_HEADS, torch.float32, [1, 17, 70], seed=group + 40)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("group", GROUPS)
def test_triton_prefill(group: int) -> None:
    _prefill(group * NUM_KV_HEADS, torch.float32, [(17, 17), (40, 7), (1, 1)], seed=group + 60)
