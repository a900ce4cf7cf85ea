"""Fixtures for the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedkv import kernels
from pagedkv.kernels import dispatch
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear


@pytest.fixture
def triton_backend() -> Iterator[None]:
    """Run the Triton kernels (compiled on CUDA, interpreted on CPU); skip where Triton is missing."""
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    with kernels.use_backend("triton"):
        yield


def _load_variant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Load native variant ``name`` afresh (monkeypatch puts the loaded one back after), or skip."""
    if name not in cpu_native.built_variants() or cpu_native.VARIANTS[name] > cpu_native.cpu_level():
        pytest.skip(f"{name} is not built or this CPU cannot run it")
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_variant", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setenv(cpu_native.ENV_SWITCH, name)
    assert cpu_native.active_variant() == name
    assert cpu_quant_linear.simd() == (name != "x86_64")  # the AVX2 code, or the plain C loops


@pytest.fixture(params=["avx2", "x86_64"])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each native CPU variant this machine runs, loaded afresh: the AVX2 build (the quantized
    linear kernels' intrinsics, 8-float attention tiles), then the baseline x86-64 build (plain C
    loops, 4-float tiles)."""
    name = str(request.param)
    _load_variant(name, monkeypatch)
    return name


@pytest.fixture(params=["avx512-words", "avx512-words-vnni", "avx512-fp32", "avx2", "x86_64"])
def quant_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each way this machine runs an int4 or int8 product of a few rows: the AVX-512 build's 16-bit
    integer products (where the CPU has VNNI and VBMI; int4's from 4 rows on the AMX tiles where it
    has those too), the same with the tiles turned off (the VNNI row tiles), its fp32 code with the
    integer products turned off, the AVX2 build's fp32 code and the plain C loops; all on the same
    rounded x."""
    name = str(request.param)
    _load_variant(name.split("-")[0], monkeypatch)
    if name.startswith("avx512-words") and not cpu_quant_linear.word_products(True):
        pytest.skip("this CPU has no AVX-512 VNNI + VBMI")
    if name == "avx512-words-vnni":
        assert not cpu_quant_linear.tile_products(False)
    if name == "avx512-fp32":
        assert not cpu_quant_linear.word_products(False)
    if name in ("avx2", "x86_64"):
        assert not cpu_quant_linear.word_products()  # built without them
        assert not cpu_quant_linear.tile_products()
    yield name
    cpu_quant_linear.word_products(True)  # the defaults (the library stays loaded)
    cpu_quant_linear.tile_products(True)
