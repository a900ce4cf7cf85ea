"""The block manager's capacity in bytes: --kv-cache-memory sizes the pools, GetConfig and the
metrics report it, admission and the watermark count in the blocks it gives, and a state dir
written with another KV dtype is refused."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedkv.block_manager_svc.core import BlockManager
from pagedkv.block_manager_svc.core.errors import ResourceExhausted
from pagedkv.block_manager_svc.metrics import CoreCollector
from pagedkv.block_manager_svc.server import build_core, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.kv_capacity import GIB, block_bytes
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from pagedkv.watermark import watermark_blocks

FP32 = block_bytes(30, 3, 64, 16, "auto", 4)
INT8 = block_bytes(30, 3, 64, 16, "int8", 4)


def _settings(**kw: object) -> BlockManagerSettings:
    return BlockManagerSettings(port=0, **kw)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0.0005, 4.0),
    st.integers(1_000, 4_000_000),
    st.floats(0.0, 0.5),
    st.sampled_from(["auto", "int8", "fp8_e4m3"]),
)
def test_budget_gives_the_pool_and_the_watermark_counts_in_it(
    gib: float, per_block: int, fraction: float, kv: str
) -> None:
    want = int(gib * GIB) // per_block
    if not 1 <= want:
        with pytest.raises(ValidationError, match="holds 0 blocks"):
            _settings(kv_cache_memory=gib, kv_bytes_per_block=per_block)
        return
    s = _settings(
        kv_cache_memory=gib,
        kv_swap_memory=gib / 2,
        kv_bytes_per_block=per_block,
        kv_cache_dtype=kv,
        watermark_fraction=fraction,
    )
    assert s.num_gpu_blocks == want
    assert s.num_cpu_blocks == int(gib / 2 * GIB) // per_block
    cfg = build_core(s).config
    assert (cfg.num_gpu_blocks, cfg.kv_cache_dtype, cfg.kv_cache_memory_bytes) == (want, kv, int(gib * GIB))
    assert cfg.num_gpu_blocks * cfg.kv_bytes_per_block <= cfg.kv_cache_memory_bytes
    assert cfg.watermark_blocks == watermark_blocks(fraction, want) < want


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 40), st.floats(0.0, 0.5))
def test_admission_takes_exactly_the_budgeted_blocks_above_the_watermark(
    blocks: int, fraction: float
) -> None:
    """The same budget holds ~3.8x the int8 blocks of fp32; Allocate admits up to the watermark."""
    for per_block in (FP32, INT8):
        s = _settings(
            kv_cache_memory=blocks * per_block / GIB,
            kv_bytes_per_block=per_block,
            watermark_fraction=fraction,
            block_size=16,
        )
        core: BlockManager = build_core(s)
        room = s.num_gpu_blocks - core.config.watermark_blocks
        core.allocate("fits", room * 16)
        with pytest.raises(ResourceExhausted):
            core.allocate("over", 1)
        assert core.stats().num_free_blocks == core.config.watermark_blocks


def test_int8_budget_holds_3_76x_the_fp32_blocks() -> None:
    fp32 = _settings(kv_cache_memory=1.0, kv_bytes_per_block=FP32)
    int8 = _settings(kv_cache_memory=1.0, kv_bytes_per_block=INT8, kv_cache_dtype="int8")
    assert (fp32.num_gpu_blocks, int8.num_gpu_blocks) == (1456, 5482)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kv_cache_memory": 1.0, "kv_bytes_per_block": 1000, "num_gpu_blocks": 5}, "not both"),
        ({"kv_swap_memory": 1.0, "kv_bytes_per_block": 1000, "num_cpu_blocks": 5}, "not both"),
        ({"kv_cache_memory": 1.0}, "needs --kv-bytes-per-block"),
        ({"kv_cache_memory": 1e-6, "kv_bytes_per_block": 1 << 20}, "holds 0 blocks"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ],
)
def test_bad_budgets_are_refused_by_name(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _settings(**kw)


def test_get_config_and_metrics_report_the_bytes() -> None:
    r = start_server(_settings(kv_cache_memory=0.01, kv_bytes_per_block=INT8, kv_cache_dtype="int8"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            c = stub.GetConfig(pb.GetConfigRequest())
            stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=40))
        metrics = {
            (m.name, tuple(s.labels.values())): s.value
            for m in CoreCollector(r.servicer).collect()
            for s in m.samples
        }
    finally:
        r.stop(0)
    n = int(0.01 * GIB) // INT8
    assert (c.kv_cache_dtype, c.kv_bytes_per_block, c.kv_cache_memory_bytes, c.num_gpu_blocks) == (
        "int8",
        INT8,
        int(0.01 * GIB),
        n,
    )
    assert metrics[("pagedkv_kv_cache_bytes", ("used",))] == 3 * INT8
    assert metrics[("pagedkv_kv_cache_bytes", ("free",))] == (n - 3) * INT8
    assert metrics[("pagedkv_kv_bytes_per_block", ("int8",))] == INT8


def test_a_state_dir_written_with_another_kv_dtype_is_refused(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    first = start_server(_settings(num_gpu_blocks=32, block_size=4, state_dir=state, kv_cache_dtype="int8"))
    with grpc.insecure_channel(f"127.0.0.1:{first.port}") as ch:
        pb_grpc.BlockManagerStub(ch).Allocate(pb.AllocateRequest(seq_id="a", num_tokens=5))
    first.stop(0)
    with pytest.raises(RuntimeError, match="kv_cache_dtype='int8' \\(settings say 'auto'\\)"):
        start_server(_settings(num_gpu_blocks=32, block_size=4, state_dir=state))
    again = start_server(_settings(num_gpu_blocks=32, block_size=4, state_dir=state, kv_cache_dtype="int8"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{again.port}") as ch:
            table = pb_grpc.BlockManagerStub(ch).GetBlockTable(pb.GetBlockTableRequest(seq_id="a"))
        assert table.num_tokens == 5
    finally:
        again.stop(0)
