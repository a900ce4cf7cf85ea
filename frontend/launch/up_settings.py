"""``pagedkv up``'s settings: its own, defined once here, and what it passes on to each role.

``UpSettings`` defines the settings that are ``up``'s own (the stack's shape, ports, logs, security,
restarts); each is a flag, a ``PAGEDKV_*`` variable and a key of a settings file's ``[up]`` section
(pagedkv/settings_cli.py, pagedkv/settings_file.py). Where the in-process stack has the same value,
the default is ``StackConfig``'s (frontend/launch/config.py), so the two ways of running a stack
agree; a default only ``up`` has (a swap pool, the journal's fsync, the frontend's port) is a named
constant of pagedkv/defaults.py.

The settings of the roles are theirs: ``SERVE_FLAGS`` are `pagedkv serve` settings that ``up`` also
takes as flags (planning reads ``--max-num-seqs``), and a settings file's ``[serve]``,
``[block-manager]``, ``[cache-host]`` and ``[worker]`` sections may set any other setting of that role,
which ``up`` passes on to each process of it, except those in ``SET_BY_UP``: the addresses, the pool's
geometry, the model and the security that ``up`` gives every role itself (from ``[up]``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedkv import defaults, settings_file
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.supervisor import RestartPolicy
from pagedkv.kv_capacity import KvCacheDtype
from pagedkv.settings_cli import env_values
from pagedkv.settings_file import SECTIONS, SettingsFileError, did_you_mean, field_name, flag_key, is_secret
from pagedkv.settings_roles import settings_class
from pagedkv.weight_formats import WeightFormat

_STACK = StackConfig()


class UpSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDKV_", extra="forbid")

    model: str | None = Field(
        None, description="Hugging Face model directory or GGUF file (unset: the built-in tiny model)"
    )
    speculative_model: str | None = Field(
        None,
        description="speculative decoding with a draft model (Hugging Face directory or GGUF file sharing "
        "the model's vocabulary): the workers run it beside the model, its KV in the same blocks, and "
        "the frontend asks it for --num-speculative-tokens proposals per pass (docs/speculative.md)",
    )
    host: str = Field(_STACK.host, description="address every service binds to")
    serve_port: int = Field(
        defaults.SERVE_PORT,
        ge=0,
        le=65535,
        description="port of the OpenAI-compatible frontend, `pagedkv serve`",
    )
    serve: bool = Field(True, description="start the frontend; --no-serve: the gRPC services only")
    block_manager_port: int = Field(
        _STACK.block_manager_port, ge=0, le=65535, description="block manager port"
    )
    cache_host_port: int = Field(_STACK.cache_host_port, ge=0, le=65535, description="cache host port")
    worker_port: int = Field(
        _STACK.worker_port, ge=0, le=65535, description="first worker's port; the others follow it"
    )
    # What `up` plans from this machine and the model unless set (pagedkv/plan.py).
    num_workers: int | None = Field(
        None,
        ge=1,
        description="compute workers (unset: planned, one per NUMA node; more than the cores is "
        "planned down)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="compute threads per worker (unset: planned, one per core it owns)"
    )
    pin_workers: bool = Field(
        True,
        description="give each CPU worker its own cores and as many threads; --no-pin-workers: unpinned",
    )
    num_gpu_blocks: int | None = Field(
        None, ge=1, description="KV blocks, instead of a byte budget (unset: planned from free memory)"
    )
    kv_cache_memory: float | None = Field(
        None, gt=0, description="GiB of KV cache: as many blocks as fit (unset: planned from free memory)"
    )
    num_cpu_blocks: int = Field(
        defaults.UP_NUM_CPU_BLOCKS,
        ge=0,
        description="blocks of the CPU swap pool (0 = none: preemption recomputes)",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        _STACK.kv_cache_dtype,  # type: ignore[arg-type]
        description="KV cache dtype: auto (the model's), int8 or fp8_e4m3 (8-bit, per-token scales)",
    )
    block_size: int = Field(
        _STACK.block_size, ge=1, le=4096, description="tokens per KV block (a power of two)"
    )
    kv_groups: str = Field(
        _STACK.kv_groups,
        description="the block manager's KV-cache groups: auto = the model's (Gemma 3: a table for "
        "its global layers and one per run of window layers, holding only the window), full = one "
        "table for every layer, or a spec like full,window:512x5",
    )
    device: str = Field(
        _STACK.device,
        description="where the workers compute: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        _STACK.dtype,  # type: ignore[arg-type]
        description="cache/model dtype; auto = float32 on CPU, bfloat16 on CUDA",
    )
    weight_format: WeightFormat = Field(
        _STACK.weight_format,  # type: ignore[arg-type]
        description="how the cache host and workers hold the weights: auto = a GGUF file's own "
        "quantization on CPU, fp32 | bf16 dense, int8 | int4 a Hugging Face directory quantized at load",
    )
    roles: str = Field(
        "",
        description="worker roles, one for all or one per worker, e.g. prefill,decode (empty: all mixed)",
    )
    preload_runtime: bool = Field(
        True, description="start CPU workers with tcmalloc / Intel OpenMP preloaded when present"
    )
    log_format: Literal["console", "json"] = Field(
        _STACK.log_format,  # type: ignore[arg-type]
        description="every service's log: key=value or JSON lines",
    )
    log_dir: str | None = Field(None, description="write each service's log to DIR/<name>.log")
    ready_file: str | None = Field(
        None,
        description="once every service is SERVING, write this file (JSON: each service's name, address "
        "and pid, the OpenAI base URL); removed when up stops (frontend/launch/ready.py)",
    )
    ready_timeout_s: float = Field(
        _STACK.ready_timeout_s, gt=0, description="seconds the stack has to be SERVING"
    )
    tls_dir: str | None = Field(
        None,
        description="mutual TLS everywhere with DIR/{ca,server,client}.pem and .key "
        "(tools/make_certs.sh DIR)",
    )
    auth_tokens_file: str | None = Field(
        None,
        description="bearer tokens (docs/security.md) required by the block manager, cache host and workers",
    )
    allow_insecure: bool = Field(
        False,
        description="allow --auth-tokens-file without --tls-dir (tokens in plaintext: trusted networks only)",
    )
    state_dir: str | None = Field(
        None,
        description="the block manager's journal and snapshots, kept after the stack stops (unset: a "
        "temporary directory, removed when the stack stops)",
    )
    fsync: Literal["always", "batch", "off"] = Field(
        defaults.UP_FSYNC,  # type: ignore[arg-type]
        description="the block manager's journal fsync (docs/reliability.md): off is enough on one host, "
        "where a journal write survives a SIGKILL of the block manager and a power loss takes the KV "
        "with it",
    )
    max_restarts_per_minute: int = Field(
        RestartPolicy().max_restarts_per_minute,
        ge=0,
        description="restart a service that exits at most this often a minute, then stop the stack "
        "(0 = stop the stack when any service exits)",
    )


# `pagedkv serve` settings that `pagedkv up` also takes as flags (the rest of serve's settings:
# a settings file's [serve] section). Secrets only as a file: a flag's value shows in the process list.
SERVE_FLAGS = (
    "model_name",
    "api_key_file",
    "allowed_origins",
    "max_waiting",
    "max_num_seqs",
    "max_batch_tokens",
    "decode_steps",
    "speculative",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "speculative_max_num_seqs",
    "timeout_s",
    "block_manager_outage_s",
    "block_manager_timeout_s",
    "tool_call_parser",
    "step_transport",
)

# The settings `pagedkv up --help` shows (the rest: `--help-all` and docs/settings.md), by dest.
HELP = (
    "model",
    "host",
    "serve_port",
    "serve_api_key_file",
    "serve_model_name",
    "num_workers",
    "kv_cache_memory",
    "num_gpu_blocks",
    "serve_max_num_seqs",
    "weight_format",
    "kv_cache_dtype",
    "device",
    "log_format",
    "state_dir",
)

# Forwarded settings whose default `up` plans instead (pagedkv/plan.py), as its help says it.
PLANNED = {"serve_max_num_seqs": "planned from the machine"}

_SERVER = (
    "host",
    "port",
    "log_format",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "auth_tokens_file",
    "allow_insecure",
)
_DIAL = ("block_manager", "tls_ca", "tls_client_cert", "tls_client_key", "token_file")
_MODEL = ("model", "speculative_model", "device", "dtype", "weight_format", "kv_cache_dtype", "seed")

# Settings of each role that `up` sets on its command line itself, from [up] (tests check this
# against the command lines frontend/launch/processes.py's plan() writes).
SET_BY_UP: dict[str, frozenset[str]] = {
    "block-manager": frozenset(
        (
            *_SERVER,
            "num_gpu_blocks",
            "num_cpu_blocks",
            "block_size",
            "kv_cache_dtype",
            "kv_cache_memory",
            "kv_bytes_per_block",
            "kv_groups",
            "state_dir",
            "fsync",
        )
    ),  # fmt: skip
    "cache-host": frozenset((*_SERVER, *_DIAL, *_MODEL, "shm_prefix")),
    "worker": frozenset((*_SERVER, *_DIAL, *_MODEL, "cache_host", "role", "cpu_affinity", "num_threads")),
    "serve": frozenset((*_SERVER, *_DIAL, "workers", "model", "speculative_model", "kv_cache_dtype")),
}


def layered_values(path: str | None) -> dict[str, object]:
    """``pagedkv up``'s values by argparse dest, before its flags: each setting's default, under its
    ``PAGEDKV_*`` variable, under the settings file at ``path`` (when given). ``role_settings``: the
    file's other settings of each role, by section, which ``up`` passes on to those processes.
    SettingsFileError / ValueError (a bad variable) say what is wrong where."""
    from pagedkv.frontend.serve.settings import ServeSettings

    fields = UpSettings.model_fields
    out: dict[str, object] = {n: f.get_default(call_default_factory=True) for n, f in fields.items()}
    out |= {f"serve_{n}": None for n in SERVE_FLAGS}
    out |= env_values(UpSettings, UpSettings.model_fields)
    out |= {f"serve_{n}": v for n, v in env_values(ServeSettings, SERVE_FLAGS).items()}
    roles: dict[str, dict[str, object]] = {s: {} for s in SECTIONS if s != "up"}
    out["role_settings"] = roles
    if path is None:
        return out
    data = settings_file.read(path)
    up = data.get("up", {})
    serve_keys = {k: v for k, v in up.items() if field_name(k) in SERVE_FLAGS}
    own = {k: v for k, v in up.items() if k not in serve_keys}
    for key in own:
        if field_name(key) not in fields:
            known = [flag_key(n) for n in (*fields, *SERVE_FLAGS)]
            hint = did_you_mean(flag_key(field_name(key)), known)
            raise SettingsFileError(path, f"unknown setting{hint} (docs/settings.md)", "up", key)
    out |= settings_file.section_values(UpSettings, path, "up", own)
    from_up = settings_file.section_values(ServeSettings, path, "up", serve_keys)
    out |= {f"serve_{n}": v for n, v in from_up.items()}
    for section in roles:
        table = data.get(section, {})
        values = settings_file.section_values(settings_class(section), path, section, table)
        keys = {field_name(k): k for k in table}
        for name, value in values.items():
            key = keys[name]
            if section == "serve" and name in SERVE_FLAGS:
                if name in from_up:
                    raise SettingsFileError(path, "also set in [up]: set it once", section, key)
                out[f"serve_{name}"] = value
            elif name in SET_BY_UP[section]:
                instead = f": set [up] {flag_key(name)}" if name in UpSettings.model_fields else ""
                raise SettingsFileError(
                    path, f"pagedkv up sets this for every {section} itself{instead}", section, key
                )
            elif is_secret(settings_class(section).model_fields[name]):
                raise SettingsFileError(
                    path, f"a secret is not passed on a command line (the process list shows it): set "
                    f"PAGEDKV_{name.upper()} or its file setting", section, key,
                )  # fmt: skip
            else:
                roles[section][name] = value
    return out
