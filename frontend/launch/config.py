"""What a whole stack is: one description for both ways of running it.

``pagedkv up`` (``frontend/launch/processes.py``) runs each role as a local process; the in-process stack
(``frontend/launch/local_stack.py``: ``generate --local``, ``demo --local``, the tests) runs every role in
one process. Both describe the same thing (the model, the pool, the workers and their roles, the
device), so they take this one dataclass, and each default is written once (``pagedkv/defaults.py``).

The fields under "processes only" say how to launch and watch separate processes (ports, logs,
security, restarts); the in-process stack binds ephemeral loopback ports and ignores them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv import defaults
from pagedkv.frontend.launch.supervisor import RestartPolicy
from pagedkv.plan import WorkerPlan


@dataclass(slots=True)
class StackConfig:
    # --- The stack itself (both ways of running it) ---
    model: str | None = None  # Hugging Face directory or GGUF file; None = the built-in tiny model
    num_gpu_blocks: int = defaults.LOCAL_NUM_GPU_BLOCKS
    num_cpu_blocks: int = defaults.NUM_CPU_BLOCKS
    block_size: int = defaults.BLOCK_SIZE
    num_workers: int = 1
    device: str = "auto"
    dtype: str = "auto"
    # How the weights are held: auto | fp32 | bf16 | int8 | int4 (worker_svc/model/weight_format.py).
    weight_format: str = "auto"
    kernel_backend: str | None = None  # the workers' --kernel-backend (None = theirs: auto)
    seed: int = 0  # the built-in default model's random weights
    # Speculative decoding's draft model (Hugging Face directory or GGUF file sharing the model's
    # vocabulary): its KV lives beside the model's in the same blocks (docs/speculative.md).
    speculative_model: str | None = None
    # Worker i's --role (prefill | decode | mixed); one role applies to every worker (processes);
    # empty = all mixed (docs/worker.md "Roles", frontend/engine/dispatch.py).
    roles: tuple[str, ...] = ()
    # The KV cache's dtype ("auto" = the model's, "int8", "fp8_e4m3") and its budget in GiB: with a
    # budget the pool holds as many blocks as fit (the bytes per block from the model and the dtype,
    # pagedkv/kv_capacity.py) and num_gpu_blocks is not used; 0 = num_gpu_blocks counts it.
    kv_cache_dtype: str = "auto"
    kv_cache_memory: float = 0.0
    # The block manager's --kv-groups: "auto" = the model's own layer groups (Gemma 3: a table for
    # its global layers, one for each run of window layers, which hold only their window's
    # blocks; worker_svc/model/kv_layout.py), "full" = one table for every layer, or a spec.
    kv_groups: str = "auto"
    # More block manager settings by field name, e.g. {"preemption_mode": "swap"} (flags for processes).
    block_manager_overrides: dict[str, object] = field(default_factory=dict)

    # --- Processes only (`pagedkv up`, frontend/launch/processes.py) ---
    host: str = defaults.HOST
    block_manager_port: int = defaults.BLOCK_MANAGER_PORT
    cache_host_port: int = defaults.CACHE_HOST_PORT
    worker_port: int = defaults.WORKER_PORT
    log_format: str = "console"
    log_dir: str | None = None
    shm_prefix: str = field(default_factory=lambda: f"pagedkv-up-{os.getpid()}")
    ready_timeout_s: float = 180.0
    # Give each worker its own share of this machine's CPUs (--cpu-affinity, --num-threads).
    pin_workers: bool = False
    # Each worker's cores and threads as planned (pagedkv/plan.py; `pagedkv up` fills it in): when
    # given, one entry per worker, and it replaces pin_workers' even split.
    placement: tuple[WorkerPlan, ...] = ()
    worker_args: tuple[str, ...] = ()  # more flags for every worker (e.g. --num-threads 1)
    # The cache host loads the weights once for every worker (else each loads its own).
    share_weights: bool = True
    cache_host_args: tuple[str, ...] = ()  # more flags for the cache host
    tls_dir: str | None = None  # ca.pem, server.pem/.key, client.pem/.key (tools/make_certs.sh DIR)
    auth_tokens_file: str | None = None  # bearer tokens of the stack's clients
    allow_insecure: bool = False  # tokens without --tls-dir: sent in plaintext between the roles
    # `pagedkv serve` on this port after the workers (None = no frontend; `pagedkv up`: SERVE_PORT).
    serve_port: int | None = None
    # More `pagedkv serve` flags (served name, API key file, limits: `pagedkv up`'s frontend group).
    serve_args: tuple[str, ...] = ()
    # CPU workers start with tcmalloc and Intel OpenMP preloaded when present (pagedkv/cpu_runtime.py).
    preload_runtime: bool = True
    # The block manager's --state-dir (kept); None = a temporary one, removed when the stack stops.
    state_dir: str | None = None
    # The block manager's journal --fsync. "off" by default here: every role is a process on this one
    # host, a journal record the OS holds survives a SIGKILL of the block manager (what a restart
    # recovers from), and a power loss takes the cache host's KV and every request with it, so an
    # fsync per mutation (a disk write on every engine step) would protect nothing.
    fsync: str = defaults.UP_FSYNC
    restart: RestartPolicy = field(default_factory=RestartPolicy)


def override_flags(overrides: dict[str, object]) -> list[str]:
    """``block_manager_overrides`` as `pagedkv block-manager` flags (``--[no-]name`` for booleans)."""
    flags: list[str] = []
    for name, value in overrides.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def worker_roles(roles: Sequence[str], num_workers: int) -> list[str]:
    """--roles prefill,decode -> one role per worker (one role for all; none = mixed)."""
    for r in roles:
        if r not in ("mixed", "prefill", "decode"):
            raise ValueError(f"unknown worker role {r!r}: use mixed, prefill or decode")
    if not roles:
        return ["mixed"] * num_workers
    if len(roles) == 1:
        return list(roles) * num_workers
    if len(roles) != num_workers:
        raise ValueError(
            f"--roles names {len(roles)} roles for {num_workers} workers: give one, or one per worker"
        )
    return list(roles)
