"""Fixtures for the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kernels
from kernels import cpu_native, cpu_quant_linear, dispatch


@pytest.fixture
def triton_backend() -> Iterator[None]:
    """Run the Triton kernels (compiled on CUDA, interpreted on CPU); skip where Triton is missing."""
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    with kernels.use_backend("triton"):
        yield


@pytest.fixture(params=["avx2", "x86_64"])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each native CPU variant this machine runs, loaded afresh (monkeypatch puts the loaded one
    back after): the AVX2 build (the quantized linear kernels' intrinsics, 8-float attention tiles),
    then the baseline x86-64 build (plain C loops, 4-float tiles)."""
    name = str(request.param)
    if name not in cpu_native.built_variants() or cpu_native.VARIANTS[name] > cpu_native.cpu_level():
        pytest.skip(f"{name} is not built or this CPU cannot run it")
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_variant", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setenv(cpu_native.ENV_SWITCH, name)
    assert cpu_native.active_variant() == name
    assert cpu_quant_linear.simd() == (name == "avx2")  # the AVX2 code, or the plain C loops
    return name
