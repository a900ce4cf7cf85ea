"""Which CPUs a worker runs on and how many compute threads it uses.

Why: two workers on one small machine (a CI runner with a few cores, or a NUMA node) that each let
torch spawn a thread per core fight over every core, and each step waits for the slowest thread.
Pinning each worker to its own cores (``--cpu-affinity``) with as many torch threads as it has
cores (``--num-threads``, default) lets them compute side by side, the CPU form of the GPU's MPS
SM shares. ``pagedkv up`` plans both for every worker (``pagedkv/plan.py``); a worker started by
hand, in compose or in Kubernetes plans its own thread count from its mask and CPU quota.
"""

from __future__ import annotations

import os

import torch

from pagedkv.cpu_list import parse_cpus
from pagedkv.machine import Machine, cgroup_cpu_quota
from pagedkv.plan import compute_cpus


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
    # Unset: one thread per core it may compute on, the mask cut to a container's CPU quota (the
    # plan's rule, pagedkv/plan.py), so a pod given 1.5 CPUs of a 64-CPU node runs 1, not 64.
    threads = num_threads or len(compute_cpus(Machine(cpus=tuple(cpus), cpu_quota=cgroup_cpu_quota())))
    torch.set_num_threads(threads)
    return cpus, threads
