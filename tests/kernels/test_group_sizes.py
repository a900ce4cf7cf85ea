"""The GQA group sizes of the model families pagedkv runs, on every kernel backend.

SmolLM2 (9 query heads over 3 KV heads) has group 3; Qwen2-0.5B and Qwen2-7B (14/2, 28/4) 7;
Qwen2.5-1.5B (12/2) 6; 5 stands for any other odd group. The native CPU decode kernel has
specialised paths for some groups and a generic one for the rest: these groups take the generic
path (or whatever the kernel picks) and the gather + SDPA buckets; the Triton kernels in
test_group_sizes_triton.py (a module of its own: on the GPU image the CPU-backend cases here skip while
the Triton ones run on the GPU). Fresh random inputs, NaN-poisoned outputs, against the torch reference.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels.cpu import native as cpu_native
from tests.kernels.cases import GQA_GROUPS as GROUPS
from tests.kernels.cases import GQA_NUM_KV_HEADS as NUM_KV_HEADS
from tests.kernels.cases import check_decode_group, check_prefill_group


@pytest.fixture(params=["native", "buckets"])
def cpu_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        pytest.skip("CPU backend cases (CPU tensors)")
    if request.param == "buckets":
        monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    elif not cpu_native.available():
        pytest.skip("the native kernels were not built at install (no C compiler then)")
    with kernels.use_backend("cpu"):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
def test_cpucheck_decode_group(group: int, dtype: torch.dtype, cpu_backend: str) -> None:
    check_decode_group(group * NUM_KV_HEADS, dtype, [1, 16, 17, 150, 33, 97, 2], seed=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
def test_cpucheck_prefill_group(group: int, dtype: torch.dtype, cpu_backend: str) -> None:
    check_prefill_group(
        group * NUM_KV_HEADS, dtype, [(40, 40), (70, 23), (16, 1), (33, 0), (129, 17)], seed=group + 20
    )
