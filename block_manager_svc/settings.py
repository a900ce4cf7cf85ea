"""The block manager's configuration: one object, from env vars and CLI flags.

Precedence: command-line flag > environment variable (PAGEDKV_<NAME>) >
default. Defaults are safe: listen on loopback only.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedkv import defaults, settings_cli

# The cost model's defaults are the core's (one value for CoreConfig and the service).
from pagedkv.block_manager_svc.core.swap_planner import (
    DEFAULT_HOST_LINK_BYTES_PER_S,
    DEFAULT_KV_BYTES_PER_BLOCK,
    DEFAULT_PREFILL_TOKENS_PER_S,
)
from pagedkv.kv_capacity import KvCacheDtype, blocks_for_memory, memory_bytes


class BlockManagerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDKV_", extra="forbid")

    host: str = Field(defaults.HOST, description="address to listen on (127.0.0.1 = this machine only)")
    port: int = Field(
        defaults.BLOCK_MANAGER_PORT, ge=0, le=65535, description="port to listen on (0 = pick a free one)"
    )
    num_gpu_blocks: int = Field(
        defaults.NUM_GPU_BLOCKS, ge=1, le=2**31 - 1, description="blocks in the GPU pool"
    )
    block_size: int = Field(defaults.BLOCK_SIZE, ge=1, le=4096, description="tokens per block")
    num_cpu_blocks: int = Field(
        defaults.NUM_CPU_BLOCKS, ge=0, le=2**31 - 1, description="blocks in the CPU swap pool (0 = none)"
    )
    eviction_policy: Literal["lru", "lru-size"] = Field(
        defaults.EVICTION_POLICY,
        description="prefix-cache eviction order: lru (vLLM's) or lru-size (GDSF: recency, hits, "
        "run size and miss cost; docs/policies.md)",
    )
    preemption_mode: Literal["auto", "swap", "recompute", "off"] = Field(
        defaults.PREEMPTION_MODE,
        description="when a running sequence cannot grow, preempt lower-ranked ones by: auto (cost "
        "model), swap (to the CPU pool when it fits), recompute, or off (RESOURCE_EXHAUSTED)",
    )
    watermark_fraction: float = Field(
        defaults.WATERMARK_FRACTION,
        ge=0,
        lt=1,
        description="share of GPU blocks Allocate and SwapIn leave free so admissions do not "
        "force preemption of running sequences (rounded down to whole blocks)",
    )
    kv_bytes_per_block: int = Field(
        DEFAULT_KV_BYTES_PER_BLOCK,
        ge=1,
        description="bytes of K+V in one block, all layers, scales included (pool size with "
        "--kv-cache-memory, and the cost model; 2 MiB = Llama-3-8B at 16 tokens in bf16)",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="KV dtype every cache host and worker must use: auto (the model's), int8 or "
        "fp8_e4m3 (8-bit values with per-token scales)",
    )
    kv_cache_memory: float = Field(
        0.0,
        ge=0,
        description="GiB of KV cache: the GPU pool is this budget over --kv-bytes-per-block "
        "(0 = --num-gpu-blocks counts it)",
    )
    kv_swap_memory: float = Field(
        0.0,
        ge=0,
        description="GiB of CPU swap pool: --num-cpu-blocks from this budget over --kv-bytes-per-block "
        "(0 = --num-cpu-blocks counts it)",
    )
    host_link_gb_per_s: float = Field(
        DEFAULT_HOST_LINK_BYTES_PER_S / 1e9,
        gt=0,
        description="effective GPU<->host copy bandwidth in GB/s (cost model; PCIe 5 x16)",
    )
    prefill_tokens_per_s: float = Field(
        DEFAULT_PREFILL_TOKENS_PER_S,
        gt=0,
        description="prefill throughput in tokens/s (cost model of recompute)",
    )
    enable_prefix_caching: bool = Field(
        True, description="look up and register prompt blocks by content hash"
    )
    kv_groups: str = Field(
        "",
        description="the model's KV-cache groups, one block table each: comma-separated full or "
        "window:W (sliding window of W tokens), xN repeats; group 0 full (Gemma 3 270M: "
        "full,window:512x5); empty = one full group (docs/block_manager.md)",
    )
    max_workers: int = Field(4, ge=1, le=256, description="gRPC server threads")
    max_concurrent_rpcs: int = Field(
        256, ge=1, description="RPCs in flight before new ones get RESOURCE_EXHAUSTED"
    )
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request/response")
    enable_reflection: bool = Field(True, description="serve gRPC server reflection")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log threshold")
    log_format: Literal["console", "json"] = Field("console", description="key=value or JSON lines")
    grace_period_s: float = Field(5.0, ge=0, description="seconds in-flight RPCs get on SIGTERM")
    # Reliability (docs/reliability.md).
    state_dir: str = Field(
        "", description="journal + snapshots here; restart restores the state (empty = memory only)"
    )
    fsync: Literal["always", "batch", "off"] = Field(
        "always", description="journal fsync: before each reply, every --fsync-interval-ms, or never"
    )
    fsync_interval_ms: float = Field(5.0, gt=0, le=60_000, description="batch fsync period")
    snapshot_every_ops: int = Field(
        20_000, ge=0, description="snapshot after this many journal records (0 = off)"
    )
    snapshot_interval_s: float = Field(
        60.0, ge=0, description="snapshot at least this often when changed (0 = off)"
    )
    dedupe_max_entries: int = Field(100_000, ge=0, description="request ids remembered for retries")
    dedupe_ttl_s: float = Field(600.0, ge=0, description="how long a request id is remembered")
    lease_ttl_s: float = Field(30.0, gt=0, description="TTL of a lease created without ttl_ms")
    lease_sweep_interval_s: float = Field(1.0, gt=0, description="how often expired leases are swept")

    # Security and observability (docs/security.md, docs/observability.md).
    tls_cert: str = Field("", description="server certificate chain (PEM); with tls_key: serve TLS")
    tls_key: str = Field("", description="server private key (PEM)")
    tls_client_ca: str = Field(
        "", description="CA bundle (PEM) for client certificates: mutual TLS, required"
    )
    allow_insecure: bool = Field(
        False, description="allow plaintext gRPC on a non-loopback address (trusted networks only)"
    )
    auth_tokens_file: str = Field(
        "",
        description="tenants and their sha256 token hashes (TOML/JSON): bearer-token auth, "
        "tenant namespaces and quotas (empty = no auth)",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 = off)")
    metrics_host: str = Field(defaults.HOST, description="address of the metrics HTTP server")
    enable_kv_events: bool = Field(True, description="serve WatchEvents (KV cache events for routers)")
    max_event_watchers: int = Field(
        4, ge=0, le=64, description="concurrent WatchEvents streams (each holds a server thread)"
    )
    event_queue_size: int = Field(
        10_000, ge=16, description="events buffered per watcher before a slow one is dropped"
    )
    # vLLM-format KV events over ZeroMQ for llm-d / Dynamo-style routers (docs/deploy.md).
    kv_events_endpoint: str = Field(
        "",
        description="ZeroMQ PUB endpoint for KV events in vLLM's wire format, e.g. "
        "tcp://127.0.0.1:5557; tcp://*:5557 binds EVERY interface (plaintext: needs --allow-insecure); "
        "empty = off",
    )
    kv_events_replay_endpoint: str = Field(
        "",
        description="ZeroMQ ROUTER endpoint where subscribers ask for missed batches, e.g. "
        "tcp://127.0.0.1:5558 (empty = no replay)",
    )
    kv_events_topic: str = Field(
        "kv-events", description="ZeroMQ topic of this pool's KV events (give each pool its own)"
    )
    kv_events_encoding: Literal["map", "array"] = Field(
        "map", description="events as tagged maps (vLLM since PR #42892) or positional arrays (older vLLM)"
    )
    kv_events_buffer_steps: int = Field(10_000, ge=1, description="published batches kept for replay")

    @model_validator(mode="after")
    def _check_geometry(self) -> BlockManagerSettings:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        self._pool_from_memory("kv_cache_memory", "num_gpu_blocks", 1)
        self._pool_from_memory("kv_swap_memory", "num_cpu_blocks", 0)
        from pagedkv.block_manager_svc.core.kv_groups import parse_kv_groups

        parse_kv_groups(self.kv_groups)  # raises naming the bad group
        if (self.kv_events_endpoint or self.kv_events_replay_endpoint) and not self.enable_kv_events:
            raise ValueError("kv_events_endpoint needs enable_kv_events (KV events are off)")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        from pagedkv.block_manager_svc.kv_events_zmq import check_endpoint

        for endpoint in (self.kv_events_endpoint, self.kv_events_replay_endpoint):
            if endpoint:
                check_endpoint(endpoint, self.allow_insecure)
        return self

    def _pool_from_memory(self, budget_field: str, blocks_field: str, least: int) -> None:
        """A pool counted in GiB: its blocks are the budget over the bytes per block, which must then
        be given (it is the model's: ``pagedkv up`` computes it, docs/policies.md says how)."""
        gib = getattr(self, budget_field)
        if not gib:
            return
        flag, blocks_flag = budget_field.replace("_", "-"), blocks_field.replace("_", "-")
        if blocks_field in self.model_fields_set:
            raise ValueError(f"give --{flag} or --{blocks_flag}, not both")
        if "kv_bytes_per_block" not in self.model_fields_set:
            raise ValueError(
                f"--{flag} needs --kv-bytes-per-block (the cache's bytes per block for this model and "
                "--kv-cache-dtype; pagedkv up computes it)"
            )
        n = blocks_for_memory(memory_bytes(gib), self.kv_bytes_per_block)
        if not least <= n <= 2**31 - 1:
            raise ValueError(
                f"--{flag} {gib} GiB holds {n} blocks of {self.kv_bytes_per_block} bytes; "
                f"it must hold {least} to 2**31-1"
            )
        setattr(self, blocks_field, n)


DESCRIPTION = (
    "Run the block manager gRPC service. Every flag can also be set by the environment variable "
    "PAGEDKV_<FLAG_NAME> (e.g. PAGEDKV_NUM_GPU_BLOCKS=8192)."
)


def build_parser() -> argparse.ArgumentParser:
    return settings_cli.build_parser(BlockManagerSettings, "pagedkv block-manager", DESCRIPTION)


def load_settings(argv: Sequence[str] | None = None) -> BlockManagerSettings:
    """Settings from flags over env vars; exits with a readable error on bad values."""
    return settings_cli.load_settings(BlockManagerSettings, argv, "pagedkv block-manager", DESCRIPTION)
