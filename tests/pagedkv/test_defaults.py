"""Each shared default is written once (pagedkv/defaults.py) and every role and command agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedkv import defaults
from pagedkv.block_manager_svc.core.manager import CoreConfig
from pagedkv.block_manager_svc.server import build_core
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.apps import demo, generate, loadtest
from pagedkv.frontend.launch import processes as stack
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.serve.settings import ServeSettings
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings
from tests.pagedkv.source_scan import code_lines

ROOT = Path(__file__).resolve().parents[2]


def test_every_role_has_the_same_pool_and_ports_by_default() -> None:
    bm, host, worker = BlockManagerSettings(), CacheHostSettings(), WorkerSettings()
    for s in (bm, host, worker):
        assert (s.block_size, s.num_gpu_blocks, s.num_cpu_blocks) == (
            defaults.BLOCK_SIZE,
            defaults.NUM_GPU_BLOCKS,
            defaults.NUM_CPU_BLOCKS,
        )
        assert s.host == defaults.HOST
    assert (bm.port, host.port, worker.port) == (
        defaults.BLOCK_MANAGER_PORT,
        defaults.CACHE_HOST_PORT,
        defaults.WORKER_PORT,
    )
    assert worker.cache_host == f"127.0.0.1:{host.port}"
    serve = ServeSettings()
    assert serve.port == defaults.SERVE_PORT
    assert serve.block_manager == f"127.0.0.1:{bm.port}"
    assert serve.workers == f"127.0.0.1:{worker.port}"


def test_the_core_and_the_service_agree_on_the_memory_policies() -> None:
    """CoreConfig once defaulted to preemption "off" and eviction "lru" while the service said
    "auto" and "lru-size"."""
    settings = BlockManagerSettings()
    core = CoreConfig(num_gpu_blocks=settings.num_gpu_blocks)
    assert core.preemption_mode == settings.preemption_mode == defaults.PREEMPTION_MODE == "auto"
    assert core.eviction_policy == settings.eviction_policy == defaults.EVICTION_POLICY
    assert core.block_size == settings.block_size
    assert (core.kv_bytes_per_block, core.host_link_bytes_per_s, core.prefill_tokens_per_s) == (
        settings.kv_bytes_per_block,
        settings.host_link_gb_per_s * 1e9,
        settings.prefill_tokens_per_s,
    )
    assert settings.watermark_fraction == defaults.WATERMARK_FRACTION
    assert build_core(settings).config.preemption_mode == core.preemption_mode


def test_commands_take_their_pool_from_the_named_constants() -> None:
    up = stack.build_parser().parse_args([])
    # Workers and KV blocks are planned from the machine (pagedkv/plan.py) unless given.
    assert (up.num_gpu_blocks, up.num_cpu_blocks, up.num_workers, up.block_size) == (
        None,
        defaults.UP_NUM_CPU_BLOCKS,
        None,
        defaults.BLOCK_SIZE,
    )
    assert (up.block_manager_port, up.cache_host_port, up.worker_port, up.serve_port) == (
        defaults.BLOCK_MANAGER_PORT,
        defaults.CACHE_HOST_PORT,
        defaults.WORKER_PORT,
        defaults.SERVE_PORT,
    )
    gen = generate.build_parser().parse_args(["--token-ids", "1"])
    assert (gen.num_gpu_blocks, gen.block_size) == (defaults.LOCAL_NUM_GPU_BLOCKS, defaults.BLOCK_SIZE)
    assert gen.url == f"http://127.0.0.1:{up.serve_port}"
    # `generate --block-manager` without --workers finds the workers `pagedkv up` starts.
    assert gen.workers == f"127.0.0.1:{up.worker_port}"
    assert demo.build_parser().parse_args([]).num_gpu_blocks == defaults.DEMO_NUM_GPU_BLOCKS
    assert loadtest.build_parser().parse_args([]).target == f"127.0.0.1:{up.block_manager_port}"
    assert StackConfig().num_gpu_blocks == defaults.LOCAL_NUM_GPU_BLOCKS


# Pool sizes and the well-known ports: the values that drifted.
LITERAL = re.compile(
    r"\b(num_gpu_blocks|num_cpu_blocks|block_size)\s*(:\s*int\s*)?=\s*(Field\()?[1-9]"
    r"|--(num-gpu-blocks|num-cpu-blocks|block-size)\"[^)]*default=[1-9]"
    r"|\b(50051|50052|50053|8000)\b"
)


@pytest.mark.parametrize("path", ["frontend", "block_manager_svc", "worker_svc", "pagedkv"])
def test_no_role_writes_its_own_pool_or_port_literal(path: str) -> None:
    """A literal default for the pool or a well-known port outside pagedkv/defaults.py is the drift
    that module exists to stop (generated code excepted)."""
    bad = []
    for f in sorted((ROOT / path).rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("pagedkv/v1/") or rel == "pagedkv/defaults.py":
            continue
        bad += [f"{rel}:{n}: {line.strip()}" for n, line in code_lines(f) if LITERAL.search(line)]
    assert not bad, "\n".join(bad)


def test_the_literal_scan_sees_a_literal() -> None:
    """The scan above can fail: it flags a pool default written in code, not one in a docstring."""
    assert LITERAL.search("    num_gpu_blocks: int = 512")
    assert LITERAL.search('p.add_argument("--num-gpu-blocks", type=int, default=256)')
    assert LITERAL.search('target = "127.0.0.1:50051"')
    assert not LITERAL.search("    num_gpu_blocks: int = defaults.NUM_GPU_BLOCKS")


def test_the_watermark_arithmetic_is_shared() -> None:
    """The block manager turns the fraction into blocks and the engine plans admissions with the
    same two functions (pagedkv/watermark.py)."""
    from pagedkv.watermark import admission_room, watermark_blocks

    assert watermark_blocks(0.01, 4096) == 40  # rounded down
    assert watermark_blocks(0.9, 2) == 1  # always one block left to admit into
    assert admission_room(10, 3) == 7 and admission_room(2, 3) == -1
    settings = BlockManagerSettings(num_gpu_blocks=1000, watermark_fraction=0.05)
    assert build_core(settings).config.watermark_blocks == watermark_blocks(0.05, 1000) == 50


def test_pagedkv_serve_runs_the_engine_with_the_engines_defaults() -> None:
    from pagedkv.frontend.engine import EngineConfig

    engine, serve = EngineConfig(), ServeSettings()
    for name in ("max_num_seqs", "max_batch_tokens", "timeout_s", "block_manager_outage_s"):
        assert getattr(serve, name) == getattr(engine, name), name
    assert generate.build_parser().parse_args(["--token-ids", "1"]).timeout_s == engine.timeout_s


def test_the_docs_state_the_pools_as_they_are() -> None:
    text = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    d = defaults
    assert f"A deployed role defaults to {d.NUM_GPU_BLOCKS} GPU blocks" in text
    assert (
        f"`pagedkv up` plans its pool in bytes from the machine's memory and the model (and "
        f"{d.UP_NUM_CPU_BLOCKS} CPU blocks; [Planning](#planning-the-stack-from-the-machine)); the "
        f"commands that run a whole stack in one process use named smaller pools: the in-process "
        f"stack and `generate --local` {d.LOCAL_NUM_GPU_BLOCKS}, `demo` {d.DEMO_NUM_GPU_BLOCKS}."
    ) in text
