"""The native packed linear layer (kernels/cpu/csrc/linear.c through kernels/cpu/linear.py) against
``F.linear`` on fresh random inputs, into NaN-poisoned outputs; and which path worker_svc/model/linear.py
picks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu import linear as cpu_linear
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.worker_svc.model import linear

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """In float64, so the comparison measures the kernel's rounding alone."""
    return F.linear(x.double(), w.double(), bias.double() if bias is not None else None)


# rows across the 3-row (AVX2) and 8-row (AVX-512) tiles and the 64-row block edges; outputs across the
# 32-column panel edge.
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 1, 1),
        (1, 31, 7),
        (7, 32, 64),
        (8, 33, 576),
        (9, 960, 576),
        (13, 576, 1536),
        (64, 65, 33),
        (65, 100, 129),
        (130, 576, 576),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear_into_a_poisoned_output(rows: int, n: int, k: int, with_bias: bool) -> None:
    g = _gen(rows * 1000 + n * 10 + k)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g)
    layer = cpu_linear.PackedLinear.pack(w, bias)
    assert layer is not None
    out = torch.full((rows, n), float("nan"))
    assert layer(x, out=out) is out
    ref = _reference(x, w, bias)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)


def test_strided_rows_in_the_weight_the_input_and_the_output() -> None:
    g = _gen(7)
    wide_w = torch.randn(70, 90, generator=g)
    w = wide_w[:, 5:85]  # row stride 90, 80 dense columns
    x = torch.randn(11, 100, generator=g)[:, 10:90]
    out = torch.full((11, 120), float("nan"))
    layer = cpu_linear.PackedLinear.pack(w)
    assert layer is not None
    layer(x, out=out[:, 20:90])
    torch.testing.assert_close(out[:, 20:90].double(), _reference(x, w, None), rtol=1e-5, atol=1e-4)
    assert out[:, :20].isnan().all() and out[:, 90:].isnan().all()  # nothing written outside


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    """Each output is one sequential sum over k whichever thread computes it."""
    g = _gen(3)
    w, x = torch.randn(300, 577, generator=g), torch.randn(70, 577, generator=g)
    layer = cpu_linear.PackedLinear.pack(w)
    assert layer is not None
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(layer(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_bad_arguments_raise_and_write_nothing() -> None:
    g = _gen(5)
    layer = cpu_linear.PackedLinear.pack(torch.randn(40, 24, generator=g))
    assert layer is not None
    x = torch.randn(3, 24, generator=g)
    out = torch.full((3, 40), float("nan"))
    bad_calls = [
        (torch.randn(3, 23), None, "columns"),
        (x.to(torch.bfloat16), None, "fp32"),
        (torch.randn(24), None, "2-D"),
        (torch.randn(24, 3).t(), None, "dense columns"),
        (x, torch.full((3, 41), float("nan")), r"\[3, 40\]"),
        (x, torch.full((3, 40), float("nan"), dtype=torch.float64), "fp32"),
        (x, torch.full((1, 40), float("nan")).expand(3, 40), "overlap"),
    ]
    for bad_x, bad_out, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            layer(bad_x, out=bad_out if bad_out is not None else out)
    assert out.isnan().all()
    shared = torch.randn(3, 64)
    with pytest.raises(ValueError, match="share memory"):
        layer(shared[:, :24], out=shared[:, 24:64])
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.PackedLinear.pack(torch.randn(4, 4), torch.randn(5))


def test_pack_declines_what_it_does_not_handle() -> None:
    assert cpu_linear.PackedLinear.pack(torch.randn(4, 4).to(torch.bfloat16)) is None
    assert cpu_linear.PackedLinear.pack(torch.randn(4, 4).t()) is None  # columns not dense
    assert cpu_linear.PackedLinear.pack(torch.randn(4)) is None


def test_zero_rows_and_an_empty_reduction() -> None:
    layer = cpu_linear.PackedLinear.pack(torch.randn(5, 0), torch.arange(5.0))
    assert layer is not None
    torch.testing.assert_close(layer(torch.randn(2, 0)), torch.arange(5.0).expand(2, 5))
    assert layer(torch.randn(0, 0)).shape == (0, 5)


def test_the_model_linear_picks_native_then_onednn_then_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    g = _gen(11)
    w, bias, x = (
        torch.randn(48, 40, generator=g),
        torch.randn(48, generator=g),
        torch.randn(6, 40, generator=g),
    )
    ref = _reference(x, w, bias)
    native = linear.Linear.build(w, bias, native=True)
    assert native.path == "native" and native.packed is None
    # By default fp32 takes the native kernel only where its build beats oneDNN (AVX-512, AVX2).
    default = linear.Linear.build(w, bias)
    faster = cpu_native.active_variant() in ("avx512", "avx2")
    assert default.path == ("native" if faster else native_or_onednn(w))
    monkeypatch.setattr(cpu_linear, "preferred", lambda: True)
    assert linear.Linear.build(w, bias).path == "native"
    monkeypatch.setattr(cpu_linear, "preferred", lambda: False)
    assert linear.Linear.build(w, bias).path == native_or_onednn(w)
    monkeypatch.undo()
    onednn = linear.Linear.build(w, bias, native=False)
    assert onednn.path == ("onednn" if linear.packing_enabled(w) else "torch")
    bf16 = linear.Linear.build(w.to(torch.bfloat16))
    assert bf16.path != "native"
    for layer in (native, onednn):
        torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)
        # a 3-D input goes to F.linear, strided columns are copied first
        torch.testing.assert_close(layer(x.unsqueeze(0)).double(), ref.unsqueeze(0), rtol=1e-5, atol=1e-4)
        xt = torch.randn(40, 6, generator=g).t()
        torch.testing.assert_close(layer(xt).double(), _reference(xt, w, bias), rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("PAGEDKV_CPU_NATIVE", "0")
    assert linear.Linear.build(w, bias, native=True).path == native_or_onednn(w)


def native_or_onednn(w: torch.Tensor) -> str:
    """The path fp32 takes without the native kernel."""
    return "onednn" if linear.packing_enabled(w) else "torch"
