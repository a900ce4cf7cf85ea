"""The GQA group sizes of the model families pagedkv runs (test_group_sizes.py says which), on the
Triton kernels: interpreted on CPU (small cases), compiled on a GPU. Fresh random inputs, NaN-poisoned
outputs, against the torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import GQA_GROUPS as GROUPS
from tests.kernels.cases import GQA_NUM_KV_HEADS as NUM_KV_HEADS
from tests.kernels.cases import check_decode_group, check_prefill_group


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("group", GROUPS)
def test_triton_decode(group: int) -> None:
    check_decode_group(group * NUM_KV_HEADS, torch.float32, [1, 17, 70], seed=group + 40)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("group", GROUPS)
def test_triton_prefill(group: int) -> None:
    check_prefill_group(group * NUM_KV_HEADS, torch.float32, [(17, 17), (40, 7), (1, 1)], seed=group + 60)
