"""The stack a user starts, for the benchmarks that compare pagedkv with a peer or with itself.

The benchmarks' rule: a comparison with a peer starts the stack exactly as ``pagedkv up --model
FILE`` does with no flags (``pagedkv.frontend.launch.processes.up_config``: planned from this machine), and
a tuned configuration is an extra row labelled with its ``up`` flags. What a benchmark adds to
``up``'s flags is only where the stack listens and logs (free loopback ports, JSON logs in a
directory of its own) and, outside ``up_config``, a shared-memory prefix of its own (so that one
stack's leak check does not name another's segments): none of it a performance setting.

- ``up_options(model, flags)``: that StackConfig;
- ``label(flags)``: the row's name, ``pagedkv (default)`` or ``pagedkv FLAGS``;
- ``compute_threads`` / ``compute_cpus``: what the plan computes on, the thread count a peer gets;
- ``comparable(opts)``: the config without where it listens and logs, to compare two of them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from pagedkv.cpu_list import format_cpus
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.processes import up_config
from pagedkv.ports import free_port_block

DEFAULT_LABEL = "pagedkv (default)"
"""The row of the stack ``pagedkv up --model FILE`` starts with no flags."""

# Where a stack listens and logs: the fields a benchmark sets besides the flags (not performance).
_WHERE = (
    "block_manager_port",
    "cache_host_port",
    "worker_port",
    "serve_port",
    "log_format",
    "log_dir",
    "shm_prefix",
)


def split_env(flags: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``NAME=VALUE`` items of a row's flags (an environment the stack is started with, e.g.
    ``KMP_BLOCKTIME=200``) apart from its ``up`` flags."""
    env = dict(f.split("=", 1) for f in flags if "=" in f and not f.startswith("-"))
    return env, [f for f in flags if not ("=" in f and not f.startswith("-"))]


def label(flags: Sequence[str]) -> str:
    """The row's name: ``pagedkv (default)`` for no flags, else ``pagedkv`` and the flags."""
    return "pagedkv " + " ".join(flags) if flags else DEFAULT_LABEL


def up_options(
    model: str | None,
    flags: Sequence[str] = (),
    *,
    log_dir: str | None = None,
    shm_prefix: str = "",
) -> StackConfig:
    """``up_config`` of ``pagedkv up [--model MODEL] FLAGS`` on free loopback ports, logging JSON to
    ``log_dir`` (when given), with the shared-memory prefix ``shm_prefix`` (when given)."""
    model_args = ["--model", model] if model else []
    _, flags = split_env(flags)
    # Every worker takes the port after the previous one: plan once to know how many there are.
    workers = up_config([*model_args, *flags]).num_workers
    base = free_port_block(3 + workers)
    where = [
        "--block-manager-port",
        str(base),
        "--cache-host-port",
        str(base + 1),
        "--worker-port",
        str(base + 2),
        "--serve-port",
        str(base + 2 + workers),
        "--log-format",
        "json",
        *(["--log-dir", log_dir] if log_dir else []),
    ]
    opts = up_config([*model_args, *where, *flags])
    return dataclasses.replace(opts, shm_prefix=shm_prefix) if shm_prefix else opts


def compute_threads(opts: StackConfig) -> int:
    """The compute threads of the stack's workers in all: the cores its plan computes on (a peer
    gets as many threads). Without a CPU placement (none planned), this process's CPUs."""
    return sum(w.threads for w in opts.placement) or len(os.sched_getaffinity(0))


def compute_cpus(opts: StackConfig) -> str:
    """The CPUs the stack's workers are pinned to (``0-1``), or "" where they are not pinned."""
    return format_cpus(c for w in opts.placement for c in w.cpus)


def comparable(opts: StackConfig) -> dict[str, Any]:
    """The config as a plain dict without where the stack listens and logs (``_WHERE``): equal for
    two stacks that run the same way."""
    out = dataclasses.asdict(opts)
    for name in _WHERE:
        out.pop(name)
    out["serve_args"] = list(out["serve_args"])
    out["placement"] = [{"cpus": list(w["cpus"]), "threads": w["threads"]} for w in out["placement"]]
    return out


def describe(opts: StackConfig) -> str:
    """Its workers in a few words: ``1 worker x 2 threads on CPUs 0-1 (pinned)``, ``2 workers x 1
    thread unpinned``."""
    each = sorted({w.threads for w in opts.placement})
    threads = "?" if not each else str(each[0]) if len(each) == 1 else ", ".join(map(str, each))
    plural = "" if each == [1] else "s"
    cpus = compute_cpus(opts)
    where = f"on CPUs {cpus} (pinned)" if cpus else "unpinned"
    n = opts.num_workers
    return f"{n} worker{'s' if n != 1 else ''} x {threads} thread{plural} {where}"
