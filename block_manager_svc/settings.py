"""The block manager's configuration: one object, from env vars and CLI flags.

Precedence: command-line flag > environment variable (PAGEDKV_<NAME>) >
default. Defaults are safe: listen on loopback only.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class BlockManagerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDKV_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (127.0.0.1 = this machine only)")
    port: int = Field(50051, ge=0, le=65535, description="port to listen on (0 = pick a free one)")
    num_gpu_blocks: int = Field(4096, ge=1, le=2**31 - 1, description="blocks in the GPU pool")
    block_size: int = Field(16, ge=1, le=4096, description="tokens per block")
    num_cpu_blocks: int = Field(0, ge=0, le=2**31 - 1, description="blocks in the CPU swap pool (0 = none)")
    eviction_policy: Literal["lru"] = Field("lru", description="prefix-cache eviction order")
    enable_prefix_caching: bool = Field(True, description="look up and register prompt blocks by content hash")
    max_workers: int = Field(4, ge=1, le=256, description="gRPC server threads")
    max_concurrent_rpcs: int = Field(
        256, ge=1, description="RPCs in flight before new ones get RESOURCE_EXHAUSTED"
    )
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request/response")
    enable_reflection: bool = Field(True, description="serve gRPC server reflection")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log threshold")
    log_format: Literal["console", "json"] = Field("console", description="key=value or JSON lines")
    grace_period_s: float = Field(5.0, ge=0, description="seconds in-flight RPCs get on SIGTERM")

    @model_validator(mode="after")
    def _check_geometry(self) -> BlockManagerSettings:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        return self


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv block-manager",
        description="Run the block manager gRPC service. Every flag can also be set by the "
        "environment variable PAGEDKV_<FLAG_NAME> (e.g. PAGEDKV_NUM_GPU_BLOCKS=8192).",
    )
    for name, field in BlockManagerSettings.model_fields.items():
        env = f"PAGEDKV_{name.upper()}"
        help_ = f"{field.description} [env {env}, default {field.default!r}]"
        if field.annotation is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_)
        elif getattr(field.annotation, "__origin__", None) is Literal:
            parser.add_argument(_flag(name), dest=name, choices=field.annotation.__args__,
                                default=None, help=help_)
        else:
            parser.add_argument(_flag(name), dest=name, type=field.annotation, default=None, help=help_)
    return parser


def load_settings(argv: Sequence[str] | None = None) -> BlockManagerSettings:
    """Settings from flags over env vars; exits with a readable error on bad values."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return BlockManagerSettings(**overrides)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in e.errors()
        )
        parser.error(problems)
        raise  # unreachable: parser.error exits
