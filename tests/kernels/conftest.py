"""Fixtures for the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kernels
from kernels import dispatch


@pytest.fixture
def triton_backend() -> Iterator[None]:
    """Run the Triton kernels (compiled on CUDA, interpreted on CPU); skip where Triton is missing."""
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    with kernels.use_backend("triton"):
        yield
