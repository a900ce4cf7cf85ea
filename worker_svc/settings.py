"""Settings of the two worker-side roles: the cache host and the compute worker.

Why pydantic-settings: every value can come from a flag, from the environment (prefix
``PAGEDKV_``, e.g. ``PAGEDKV_NUM_GPU_BLOCKS=2048``) or from its default, validated in one place.
The cache geometry (``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``) uses the same variable
names as the block manager, so one shared setting configures every role of a deployment.

Which fields were given explicitly (flag or env) matters: an explicit geometry value that
disagrees with the block manager or the cache host is a configuration error, while an unset one
is simply taken from them (see ``pagedkv.worker_svc.geometry``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedkv import defaults
from pagedkv.kv_capacity import KvCacheDtype
from pagedkv.weight_formats import WeightFormat

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "float16", "bfloat16"]

LogFormat = Literal["console", "json"]


class _Common(BaseSettings):
    """Fields shared by the cache host and the worker."""

    model_config = SettingsConfigDict(env_prefix="PAGEDKV_", extra="ignore")

    host: str = Field(defaults.HOST, description="address to bind the gRPC server to")
    # Geometry; the same defaults as the block manager's (pagedkv/defaults.py).
    block_size: int = Field(defaults.BLOCK_SIZE, ge=1, description="tokens per KV block")
    num_gpu_blocks: int = Field(defaults.NUM_GPU_BLOCKS, ge=1, description="blocks in the device KV cache")
    num_cpu_blocks: int = Field(
        defaults.NUM_CPU_BLOCKS, ge=0, description="blocks in the host swap pool (0 = none)"
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="KV dtype: auto (the model's), int8 or fp8_e4m3 (8-bit with per-token scales); "
        "must equal the block manager's",
    )
    # Model geometry: from --model (a directory's config.json or a GGUF file's metadata), else the
    # built-in tiny default model.
    model: str | None = Field(
        None, description="Hugging Face model directory (config.json + safetensors) or GGUF file"
    )
    speculative_model: str | None = Field(
        None,
        description="draft model for speculative decoding (docs/speculative.md): a Hugging Face directory "
        "or GGUF file with the model's vocabulary; its KV is kept beside the model's in the same blocks",
    )
    num_layers: int | None = Field(None, ge=1, description="override/check the model's layer count")
    dtype: DType = Field("auto", description="cache/model dtype; auto = float32 on CPU, bfloat16 on CUDA")
    weight_format: WeightFormat = Field(
        "auto",
        description="how the weights are held: auto = a GGUF file's own quantization on CPU float32, "
        "else dense; fp32 | bf16 = dense in that dtype (= --dtype); int8 | int4 = a Hugging Face "
        "directory quantized at load (CPU, float32)",
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    block_manager: str | None = Field(
        None, description="host:port of the block manager to read geometry from"
    )
    connect_timeout_s: float = Field(
        120.0,
        ge=0,
        description="how long to wait for the block manager (and a worker's cache host); 0 = forever",
    )
    log_format: LogFormat = Field("console", description="structlog renderer: console (key=value) or json")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log threshold")
    # TLS of this role's gRPC server (pagedkv/tls.py, docs/security.md); same PAGEDKV_* names as the
    # block manager, so one set of variables secures every role.
    tls_cert: str = Field("", description="server certificate chain (PEM); with tls_key: serve TLS")
    tls_key: str = Field("", description="server private key (PEM)")
    tls_client_ca: str = Field("", description="CA bundle for client certificates: mutual TLS")
    allow_insecure: bool = Field(
        False,
        description="allow plaintext gRPC on a non-loopback address, and "
        "sending --token-file's token without --tls-ca (trusted networks only)",
    )
    # Bearer tokens for this role's API (pagedkv/auth.py's tokens file; health stays open). A worker
    # runs steps on any block table it is given, so whoever may call it can read any KV in the cache:
    # only the frontend should hold a worker token. The cache host's descriptor names the memory.
    auth_tokens_file: str = Field(
        "",
        description="tokens file (SHA-256 hashes) whose tokens may call this role's API; empty = no tokens",
    )
    # How this role dials others (cache host -> block manager; worker -> cache host and block
    # manager): pagedkv/dial.py. Same PAGEDKV_* names as the frontend's commands.
    tls_ca: str = Field(
        "", description="CA bundle (PEM) verifying the servers this role dials: TLS on its connections"
    )
    tls_client_cert: str = Field("", description="client certificate (PEM) this role presents: mutual TLS")
    tls_client_key: str = Field("", description="private key (PEM) of --tls-client-cert")
    token_file: str = Field(
        "", description="file holding the bearer token this role sends (else PAGEDKV_TOKEN)"
    )
    token: SecretStr = Field(
        SecretStr(""),
        description="bearer token this role sends (environment only)",
        json_schema_extra={"flag": False},
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        v = v.strip().lower()
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {v!r}")


class CacheHostSettings(_Common):
    """The cache host: allocates the shared KV cache once and serves its descriptor."""

    port: int = Field(defaults.CACHE_HOST_PORT, ge=0, le=65535, description="gRPC port")
    shm_prefix: str = Field("pagedkv", description="prefix of the POSIX shared-memory segment names")
    # Shared weights (worker_svc/cache/shared_weights.py): loaded once here, mapped by every worker.
    share_weights: bool = Field(
        True, description="load the model's weights once and export them to workers beside the KV cache"
    )
    seed: int = Field(
        0, description="seed of the built-in default model's random weights (with share_weights)"
    )


class WorkerSettings(_Common):
    """A compute worker: attaches to the cache host's memory and serves the Worker API."""

    port: int = Field(defaults.WORKER_PORT, ge=0, le=65535, description="gRPC port")
    cache_host: str = Field(defaults.CACHE_HOST_ADDRESS, description="host:port of the cache host")
    max_workers: int = Field(4, ge=1, description="gRPC server threads")

    @field_validator("cpu_affinity")
    @classmethod
    def _check_cpus(cls, v: str) -> str:
        from pagedkv.cpu_list import parse_cpus

        v = v.strip()
        if v:
            parse_cpus(v)
        return v

    kernel_backend: Literal["auto", "reference", "triton", "cpu"] | None = Field(
        None, description="force the kernel backend (else PAGEDKV_KERNEL_BACKEND / auto)"
    )
    seed: int = Field(0, description="seed of the built-in default model's random weights")
    # Roles and CPU placement (docs/worker.md "Roles").
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="what the engine sends this worker: prefill chunks, decode steps, or both"
    )
    weights: Literal["auto", "shared", "local"] = Field(
        "auto",
        description="auto = map the cache host's shared weights when it exports them, else load; "
        "shared = require them; local = always load a private copy",
    )
    cpu_affinity: str = Field(
        "", description="CPUs this worker may run on, e.g. '0' or '0-1' or '0,2'; empty = inherit"
    )
    num_threads: int = Field(
        0, ge=0, description="torch compute threads; 0 = one per CPU in the affinity set (torch's default)"
    )
    # Cache host loss (docs/worker.md "Cache host loss"): how it is detected and what follows.
    cache_host_check_interval_s: float = Field(
        2.0, ge=0, description="poll the cache host's GetCacheInfo this often; 0 = do not watch it"
    )
    cache_host_failures: int = Field(
        2,
        ge=1,
        description="consecutive unreachable checks (UNAVAILABLE) after which the cache host counts as "
        "gone; a check that times out (a hung host) is not counted",
    )
    cache_lost_exit_after_s: float = Field(
        30.0,
        ge=0,
        description="after a lost cache host, exit with code 3 when no new one was attached within this "
        "grace (0 = stay up, NOT_SERVING)",
    )
    # Decode steps replayed from CUDA graphs (worker_svc/model/cuda_graphs.py; docs/gpu.md).
    cuda_graphs: bool = Field(
        True,
        description="capture decode steps' forward passes in CUDA graphs and replay them (CUDA only; "
        "prefill, mixed and larger steps run eagerly)",
    )
    cuda_graph_max_batch: int = Field(
        128, ge=1, description="largest decode batch captured (sizes 1, 2, 4, 8, 16, 24, ... up to it)"
    )
    cuda_graph_max_context: int = Field(
        8192, ge=1, description="longest context (tokens) a captured decode step serves; longer runs eagerly"
    )
    cache_host_reattach: bool = Field(
        True,
        description="re-attach by itself to a new cache host instance at the same address "
        "(a restarted host); when that fails, exit with code 3 at once",
    )
    # The one-host step channel (worker_svc/step_channel.py; docs/worker.md "Step transport").
    step_channel: bool = Field(
        True,
        description="also take Step through shared memory from clients on this host and user (a Unix "
        "socket in a 0700 directory, no network port; off when --auth-tokens-file is set, as it "
        "checks no token); --no-step-channel: gRPC only",
    )
