"""heap.release_free_memory: freed heap pages go back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import ctypes.util

import pytest

from pagedkv.worker_svc import heap


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to ask")
def test_freed_blocks_between_live_ones_are_returned() -> None:
    # 64 KiB blocks (heap memory, below glibc's mmap threshold), touched; every other one freed:
    # the holes cannot be returned by shrinking the heap's top, only by trimming.
    blocks = [bytearray(b"x" * 65536) for _ in range(2048)]  # 128 MiB
    keep = blocks[::2]
    del blocks
    after_free = _rss_kib()
    assert heap.release_free_memory()
    after_trim = _rss_kib()
    assert after_trim < after_free - 32 * 1024, (after_free, after_trim)
    assert len(keep) == 1024
