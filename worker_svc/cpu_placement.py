"""Which CPUs a worker runs on and how many compute threads it uses.

Why: two workers on one small machine (this project's 2-core CI box, or a NUMA node) that each let
torch spawn a thread per core fight over every core, and each step waits for the slowest thread.
Pinning each worker to its own cores (``--cpu-affinity``) with as many torch threads as it has
cores (``--num-threads``, default) lets them compute side by side, the CPU form of the GPU's MPS
SM shares.
"""

from __future__ import annotations

import os

import torch


def parse_cpus(spec: str) -> frozenset[int]:
    """'0', '0-3', '0,2,4-5' -> CPU ids. Raises ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in cpu list {spec!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad cpu list item {part!r} in {spec!r}: use N, N-M or a comma list of those")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad cpu range {part!r} in {spec!r}: end before start")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


def apply(cpu_affinity: str, num_threads: int) -> tuple[list[int], int]:
    """Pin this process to ``cpu_affinity`` (if given) and set torch's thread count.

    Returns the CPUs the process may run on and the thread count in effect. A CPU the machine does
    not have is a ValueError (a configuration error), not a silent no-op."""
    if cpu_affinity:
        want = parse_cpus(cpu_affinity)
        allowed = os.sched_getaffinity(0)
        missing = sorted(want - allowed)
        if missing:
            raise ValueError(
                f"--cpu-affinity {cpu_affinity!r}: CPU {missing[0]} is not available (have {sorted(allowed)})"
            )
        os.sched_setaffinity(0, want)
    cpus = sorted(os.sched_getaffinity(0))
    threads = num_threads or len(cpus)
    torch.set_num_threads(threads)
    return cpus, threads
