"""worker_svc/model/linear.py's quantized layers: a step's rows get the arithmetic their kind asks
(a prefill's the many-row one, decode rows the one-row one), whatever else the step holds."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import quant_linear
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from pagedkv.kernels.cpu.quant_linear import NativeMatmul
from pagedkv.worker_svc.model.linear import Linear
from tests.kernels import poisoned_io

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")


def _int4_layer(n: int, k: int, seed: int) -> Linear:
    g = poisoned_io.gen(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand((n, k // 32), generator=g) * 0.02 + 0.001
    offset = torch.randn((n, k // 32), generator=g) * 0.01
    return Linear.build(quant_linear.pack_int4(q, scale, offset))


@pytest.mark.parametrize("tiles", [True, False])
def test_a_mixed_steps_rows_are_those_of_their_kind_alone(
    monkeypatch: pytest.MonkeyPatch, tiles: bool
) -> None:
    """Rows [0, prefill_rows) equal a prefill's call of them alone and the rest a decode call of
    them alone, to the bit; with the AMX tiles on (asked for, and the CPU and OS give them) the step
    is one call (its weights read once), else two."""
    layer = _int4_layer(48, 96, seed=3)
    x = torch.randn((11, 96), generator=poisoned_io.gen(4))
    calls: list[int] = []
    real = NativeMatmul.__call__

    def counted(self: NativeMatmul, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    try:
        on = cpu_quant_linear.tile_products(tiles)  # False where the CPU or its OS gives none
        prefill, decode = layer(x[:7].clone(), 7), layer(x[7:].clone(), 0)
        monkeypatch.setattr(NativeMatmul, "__call__", counted)
        mixed = layer(x, 7)
    finally:
        cpu_quant_linear.tile_products(True)
    assert torch.equal(mixed[:7], prefill) and torch.equal(mixed[7:], decode)
    assert on <= tiles and len(calls) == (1 if on else 2)
