"""A pytest plugin that makes this CPU machine look like the GPU image to the kernel tests.

Loaded with ``-p tests.kernels.gpu_image_plugin`` by tests/kernels/test_gpu_selection.py only. The
GPU image has a C compiler and a CUDA device: there ``torch.cuda.is_available()`` is True and
``cases.DEVICE`` is ``cuda``. Here ``cases.DEVICE`` becomes ``meta`` (a non-CPU device that exists
without a GPU and holds no memory): a CPU-only test that still builds its tensors on
``cases.DEVICE`` hands them to host code and fails, as it would on the GPU.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    torch.cuda.is_available = lambda: True  # type: ignore[assignment] - what the skip markers ask
    from tests.kernels import cases

    cases.HAS_CUDA = True
    cases.PRETENDED_CUDA = True
    cases.DEVICE = torch.device("meta")
