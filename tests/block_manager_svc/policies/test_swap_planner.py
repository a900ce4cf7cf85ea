"""The swap-or-recompute cost model."""

from __future__ import annotations

import pytest

from pagedkv.block_manager_svc.core.swap_planner import CostModel, PreemptionMode, decide

MODEL = CostModel(kv_bytes_per_block=2 * 1024 * 1024, host_link_bytes_per_s=25e9, prefill_tokens_per_s=10_000)


def test_costs_follow_the_documented_formulas() -> None:
    assert MODEL.swap_cost_s(10) == pytest.approx(2 * 10 * 2 * 1024 * 1024 / 25e9)
    assert MODEL.recompute_cost_s(500) == pytest.approx(0.05)


def test_auto_takes_the_cheaper_mode() -> None:
    # 10 blocks: swap 1.68 ms; 160 private tokens: recompute 16 ms.
    d = decide("auto", MODEL, 10, 160, cpu_free=100)
    assert d.mode is PreemptionMode.SWAP and d.cost_s == pytest.approx(MODEL.swap_cost_s(10))
    # Mostly shared prefix: 10 tokens to recompute (1 ms) beat moving 10 blocks.
    d = decide("auto", MODEL, 10, 10, cpu_free=100)
    assert d.mode is PreemptionMode.RECOMPUTE and d.cost_s == pytest.approx(0.001)


@pytest.mark.parametrize("mode", ["auto", "swap"])
def test_swap_only_when_the_cpu_pool_has_room(mode: str) -> None:
    assert decide(mode, MODEL, 10, 10_000, cpu_free=9).mode is PreemptionMode.RECOMPUTE
    assert decide(mode, MODEL, 10, 10_000, cpu_free=10).mode is PreemptionMode.SWAP


def test_fixed_modes() -> None:
    assert decide("recompute", MODEL, 1, 10**6, cpu_free=100).mode is PreemptionMode.RECOMPUTE
    assert decide("swap", MODEL, 100, 1, cpu_free=100).mode is PreemptionMode.SWAP
    with pytest.raises(ValueError):
        decide("sometimes", MODEL, 1, 1, cpu_free=100)


def test_bad_model_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        CostModel(kv_bytes_per_block=0)
    with pytest.raises(ValueError):
        CostModel(host_link_bytes_per_s=0)
