"""The cache host's geometry: block manager values win, explicit settings must agree with them."""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest
import torch

from pagedkv.worker_svc.cache.layout import GeometryMismatch
from pagedkv.worker_svc.geometry import (
    PoolConfig,
    check_against_host,
    check_block_bytes,
    host_geometry,
    known_values,
)
from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG as M
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings
from tests.worker_svc.conftest import HFModel, build_hf_model


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


def test_kv_dtype_comes_from_the_block_manager_and_an_explicit_other_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = PoolConfig(block_size=8, num_gpu_blocks=100, num_cpu_blocks=0, kv_cache_dtype="int8")
    assert host_geometry(CacheHostSettings(), M, pool).kv_cache_dtype == "int8"
    monkeypatch.setenv("PAGEDKV_KV_CACHE_DTYPE", "auto")
    with pytest.raises(
        GeometryMismatch, match="kv_cache_dtype: settings .* have auto, the block manager has int8"
    ):
        host_geometry(CacheHostSettings(), M, pool)


def test_a_cache_host_with_another_kv_dtype_is_refused_naming_both() -> None:
    pool = PoolConfig(block_size=8, num_gpu_blocks=100, num_cpu_blocks=0, kv_cache_dtype="int8")
    known = known_values(WorkerSettings(), M, pool)
    host = replace(host_geometry(CacheHostSettings(), M, pool), kv_cache_dtype="auto")
    with pytest.raises(
        GeometryMismatch, match="kv_cache_dtype: the block manager has int8, the cache host at h:1 has auto"
    ):
        check_against_host(known, host, "the cache host at h:1")
    check_against_host(known, replace(host, kv_cache_dtype="int8"), "the cache host at h:1")


def test_bytes_per_block_are_checked_when_the_pool_was_sized_from_a_budget() -> None:
    g = host_geometry(CacheHostSettings(), M, PoolConfig(16, 10, 0, "int8"))
    mine = g.block_bytes(torch.float32)
    assert mine == M.num_layers * 2 * 16 * M.num_kv_heads * (M.head_dim + 4)
    sized = PoolConfig(16, 10, 0, "int8", kv_bytes_per_block=mine + 1, kv_cache_memory_bytes=10 * (mine + 1))
    with pytest.raises(GeometryMismatch, match=f"the block manager has {mine + 1} .*, this host has {mine}"):
        check_block_bytes(sized, g, torch.float32, "this host")
    check_block_bytes(replace(sized, kv_bytes_per_block=mine), g, torch.float32, "this host")
    check_block_bytes(
        replace(sized, kv_cache_memory_bytes=0), g, torch.float32, "this host"
    )  # counted in blocks
    check_block_bytes(None, g, torch.float32, "this host")


def test_a_draft_model_is_part_of_the_geometry_and_must_agree(
    hf_llama: HFModel, tmp_path: pathlib.Path
) -> None:
    """--speculative-model adds the draft's layers, KV heads and head_dim (each block holds its KV
    too); a worker without the host's draft, or a draft with another vocabulary, is refused."""
    from pagedkv.worker_svc.model.config import ModelConfig

    small = build_hf_model(tmp_path / "d", num_hidden_layers=1, num_key_value_heads=1)
    target = ModelConfig.from_dir(hf_llama.path)
    draft = {"speculative_model": str(small.path)}
    g = host_geometry(CacheHostSettings(**draft), target, None)
    assert (g.draft_num_layers, g.draft_num_kv_heads, g.draft_head_dim) == (1, 1, 16)
    assert (
        g.block_bytes(torch.float32)
        == replace(g, draft_num_layers=0).block_bytes(torch.float32) + 2 * 16 * 16 * 4
    )
    check_against_host(known_values(WorkerSettings(**draft), target, None), g, "the cache host at h:1")
    with pytest.raises(
        GeometryMismatch, match="draft_num_layers: settings \\(no --speculative-model\\) has 0"
    ):
        check_against_host(known_values(WorkerSettings(), target, None), g, "the cache host at h:1")
    other = build_hf_model(tmp_path / "v", vocab_size=64)
    with pytest.raises(GeometryMismatch, match="vocabulary of 64 tokens, the model .* 128"):
        host_geometry(CacheHostSettings(speculative_model=str(other.path)), target, None)
