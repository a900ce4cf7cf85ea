"""Every default that more than one role or command shares, written once.

Why one module: the block manager, the cache host, the workers, ``pagedkv serve``, ``pagedkv up``,
the in-process stack, ``generate`` and ``demo`` all describe the same pool and the same ports; when
each wrote its own literal they drifted (six different ``num_gpu_blocks`` defaults). The settings
objects (``block_manager_svc/settings.py``, ``worker_svc/settings.py``,
``frontend/serve/settings.py``) and the commands' parsers read their defaults from here.

A command that legitimately wants a smaller pool than a deployed service (a laptop demo, a test
stack) gets a named constant below saying why, never a literal of its own. This module imports
nothing of the project, so the pure core and every role can use it.
"""

from __future__ import annotations

from typing import Final

# --- Pool geometry -------------------------------------------------------------------------------
BLOCK_SIZE = 16
"""Tokens per KV block, every role (the block manager's geometry is the truth; others check it)."""

NUM_GPU_BLOCKS = 4096
"""Blocks in the device KV cache of a deployed block manager, cache host and worker."""

NUM_CPU_BLOCKS = 0
"""Blocks in the host swap pool of a deployed service (0 = none: preemption recomputes)."""

UP_NUM_CPU_BLOCKS = 256
"""``pagedkv up``: a small swap pool, so preemption can swap on a local stack."""

UP_FSYNC = "off"
"""``pagedkv up``: the block manager's journal fsync. Every role runs on one host there: a record the OS
holds survives a SIGKILL of the block manager, and a power loss takes the KV with it (the block
manager's own default, for a state dir that may outlive the cache hosts, is ``always``)."""

LOCAL_NUM_GPU_BLOCKS = 512
"""The in-process stack (``pagedkv.frontend.launch.local_stack``, ``pagedkv generate --local``, tests):
one process holds every role, so a smaller cache."""

DEMO_NUM_GPU_BLOCKS = 256
"""``pagedkv demo``: small enough that its workload fills the pool, so the demo shows prefix-cache
eviction and preemption, not only hits."""

DEMO_NUM_CPU_BLOCKS = UP_NUM_CPU_BLOCKS
"""``pagedkv demo`` as processes: the same swap pool as ``pagedkv up``."""

# --- Memory policies (docs/policies.md) ----------------------------------------------------------
EVICTION_POLICY: Final = "lru-size"
"""Prefix-cache eviction order: GDSF over recency, hits, run size and miss cost (``lru`` is vLLM's)."""

PREEMPTION_MODE: Final = "auto"
"""When a running sequence cannot grow: preempt lower-ranked ones by the swap-or-recompute cost model
(the service's and the core's default alike)."""

WATERMARK_FRACTION = 0.01
"""Share of GPU blocks Allocate and SwapIn leave free (``pagedkv.watermark`` turns it into blocks)."""

# --- Limits both the frontend and the workers enforce -------------------------------------------
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position a worker returns and a request may ask for: OpenAI's limit for
``top_logprobs`` (and vLLM's default ``max_logprobs``)."""

MAX_DECODE_STEPS = 64
"""Most decode steps one worker call runs (multi-step decode, ``--decode-steps``): bounds a call's
latency, and the tokens a request aborted meanwhile may cost."""

DECODE_STEPS = 4
"""Decode steps per worker call while no request waits (``pagedkv serve --decode-steps``)."""

# --- Ports and addresses -------------------------------------------------------------------------
HOST = "127.0.0.1"
"""Every server binds loopback unless told otherwise (security by default)."""

BLOCK_MANAGER_PORT = 50051
CACHE_HOST_PORT = 50052
WORKER_PORT = 50053
"""The first worker's port; ``pagedkv up`` gives worker i ``WORKER_PORT + i``."""

SERVE_PORT = 8000
"""``pagedkv serve``'s HTTP port (the OpenAI-compatible API)."""

BLOCK_MANAGER_ADDRESS = f"{HOST}:{BLOCK_MANAGER_PORT}"
CACHE_HOST_ADDRESS = f"{HOST}:{CACHE_HOST_PORT}"
WORKER_ADDRESS = f"{HOST}:{WORKER_PORT}"
SERVE_URL = f"http://{HOST}:{SERVE_PORT}"


def worker_addresses(num_workers: int) -> str:
    """The comma-separated addresses of the workers ``pagedkv up`` starts on one host."""
    return ",".join(f"{HOST}:{WORKER_PORT + i}" for i in range(num_workers))
