"""What this machine lets the stack use: CPUs, CPU quota, NUMA nodes, memory, shared memory, GPUs.

The one place that reads the machine (``/proc``, ``/sys``, the cgroup files, ``nvidia-smi``); the
decisions made from it are ``pagedkv/plan.py``'s, a pure function of the ``Machine`` returned here,
so that they are tested on described machines (1 to 64 cores, two NUMA nodes, a container's quota)
without running on them. Nothing here imports torch.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from dataclasses import dataclass

from pagedkv.cpu_list import format_cpus, parse_cpus

SYS_NODES = pathlib.Path("/sys/devices/system/node")
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
MEMINFO = pathlib.Path("/proc/meminfo")
SHM_DIR = pathlib.Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class Machine:
    """The resources a stack started here may use."""

    cpus: tuple[int, ...]
    """The CPUs in this process's affinity mask (``taskset``, a container's cpuset), ascending."""
    cpu_quota: float | None = None
    """The cgroup CPU quota in CPUs (``cpu.max``: quota / period, e.g. 1.5); None = no quota."""
    numa_nodes: tuple[tuple[int, ...], ...] = ()
    """The CPUs of each NUMA node (every CPU of the host, in or out of the mask); () = one node."""
    memory_available: int = 0
    """Bytes the stack may still take: MemAvailable, or less when a cgroup memory limit is lower."""
    shm_available: int | None = None
    """Bytes free in /dev/shm, where a CPU stack's KV cache and weights live; None = unknown."""
    gpus: tuple[int, ...] = ()
    """Bytes of memory of each GPU this process sees (an empty tuple: no GPU)."""

    def describe(self) -> str:
        quota = f", quota {self.cpu_quota:g} CPUs" if self.cpu_quota is not None else ""
        nodes = f", {len(self.numa_nodes)} NUMA nodes" if len(self.numa_nodes) > 1 else ""
        gpus = f", {len(self.gpus)} GPU(s)" if self.gpus else ""
        return (
            f"CPUs {format_cpus(self.cpus)} ({len(self.cpus)}{quota}{nodes}), "
            f"{self.memory_available / (1 << 30):.1f} GiB memory available{gpus}"
        )


def cgroup_cpu_quota(root: pathlib.Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``) quota allows; None = unlimited."""
    v2 = root / "cpu.max"
    try:
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or "100000")
        v1_quota, v1_period = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if v1_quota.is_file() and v1_period.is_file():
            q = int(v1_quota.read_text())
            return None if q <= 0 else q / int(v1_period.read_text())
    except (OSError, ValueError):
        return None
    return None


def cgroup_memory_room(root: pathlib.Path = CGROUP_ROOT) -> int | None:
    """Bytes the cgroup's memory limit (``memory.max`` less ``memory.current``) still allows; None
    when there is no limit."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def mem_available(meminfo: pathlib.Path = MEMINFO) -> int:
    """The kernel's MemAvailable in bytes (0 when it cannot be read)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def numa_nodes(sys_nodes: pathlib.Path = SYS_NODES) -> tuple[tuple[int, ...], ...]:
    """Each NUMA node's CPUs, nodes without CPUs left out; () when the kernel does not say."""
    nodes = []
    try:
        for node in sorted(sys_nodes.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            text = (node / "cpulist").read_text().strip()
            if text:
                nodes.append(tuple(sorted(parse_cpus(text))))
    except (OSError, ValueError):
        return ()
    return tuple(nodes)


def gpu_memory() -> tuple[int, ...]:
    """Each visible NVIDIA GPU's total memory in bytes, from ``nvidia-smi`` (no CUDA context made,
    no torch); () without a driver. ``CUDA_VISIBLE_DEVICES`` is honoured by nvidia-smi itself."""
    if not pathlib.Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return tuple(int(line.strip()) << 20 for line in out.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return ()


def shm_free(shm_dir: pathlib.Path = SHM_DIR) -> int | None:
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def this_machine(with_gpus: bool = True) -> Machine:
    """The machine this process runs on, as far as it may use it."""
    available = mem_available()
    room = cgroup_memory_room()
    if room is not None:
        available = min(available, room) if available else room
    return Machine(
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        cpu_quota=cgroup_cpu_quota(),
        numa_nodes=numa_nodes(),
        memory_available=available,
        shm_available=shm_free(),
        gpus=gpu_memory() if with_gpus else (),
    )
