"""pagedkv/machine.py reads the cgroup, /proc and /sys files a container or a host has."""

from __future__ import annotations

import os
import pathlib

from pagedkv import machine


def test_cgroup_v2_quota(tmp_path: pathlib.Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: pathlib.Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None
    assert machine.cgroup_cpu_quota(tmp_path / "absent") is None


def test_cgroup_memory_room(tmp_path: pathlib.Path) -> None:
    (tmp_path / "memory.max").write_text(f"{4 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 30}\n")
    assert machine.cgroup_memory_room(tmp_path) == 3 << 30
    (tmp_path / "memory.max").write_text("max\n")
    assert machine.cgroup_memory_room(tmp_path) is None


def test_meminfo_and_numa_nodes(tmp_path: pathlib.Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert machine.mem_available(meminfo) == 20000000 * 1024
    nodes = tmp_path / "node"
    for i, cpus in enumerate(["0-3,8-11", "4-7,12-15", ""]):
        (nodes / f"node{i}").mkdir(parents=True)
        (nodes / f"node{i}" / "cpulist").write_text(cpus + "\n")
    assert machine.numa_nodes(nodes) == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    assert machine.numa_nodes(tmp_path / "none") == ()


def test_this_machine_is_what_this_process_may_use() -> None:
    m = machine.this_machine(with_gpus=False)
    assert set(m.cpus) == os.sched_getaffinity(0)
    assert m.memory_available > 0
    assert "CPUs" in m.describe()
