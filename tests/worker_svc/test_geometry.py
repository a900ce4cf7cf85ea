"""The cache host's geometry: block manager values win, explicit settings must agree with them."""

from __future__ import annotations

import pytest

from worker_svc.cache_layout import GeometryMismatch
from worker_svc.geometry import PoolConfig, host_geometry
from worker_svc.model.config import DEFAULT_MODEL_CONFIG as M
from worker_svc.settings import CacheHostSettings


def test_defaults_without_a_block_manager() -> None:
    g = host_geometry(CacheHostSettings(), M, None)
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (M.num_layers, M.num_kv_heads, M.head_dim)
    assert (g.block_size, g.num_gpu_blocks, g.num_cpu_blocks) == (16, 4096, 0)


def test_block_manager_values_are_taken() -> None:
    g = host_geometry(CacheHostSettings(), M, PoolConfig(block_size=8, num_gpu_blocks=100, num_cpu_blocks=7))
    assert (g.block_size, g.num_gpu_blocks, g.num_cpu_blocks) == (8, 100, 7)


def test_env_setting_that_disagrees_with_the_block_manager_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGEDKV_NUM_CPU_BLOCKS", "9")
    with pytest.raises(GeometryMismatch, match="num_cpu_blocks: settings .* have 9, the block manager has 7"):
        host_geometry(CacheHostSettings(), M, PoolConfig(block_size=8, num_gpu_blocks=100, num_cpu_blocks=7))
    # agreeing explicitly is fine
    monkeypatch.setenv("PAGEDKV_NUM_CPU_BLOCKS", "7")
    assert host_geometry(CacheHostSettings(), M, PoolConfig(8, 100, 7)).num_cpu_blocks == 7


def test_num_layers_flag_must_match_the_model() -> None:
    with pytest.raises(GeometryMismatch, match="num_layers"):
        host_geometry(CacheHostSettings(num_layers=M.num_layers + 1), M, None)
