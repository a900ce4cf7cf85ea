"""The CPU swap pool: host-memory blocks that hold swapped-out sequences.

Only bookkeeping: which CPU block ids are free and how many swapped sequences
reference each (a fork group swapped together shares its common blocks here
just as it did on the GPU). No prefix index: swapped content is private to its
sequences. O(1) per block touched.
"""

from __future__ import annotations


class CpuPool:
    __slots__ = ("num_blocks", "ref_counts", "free_list")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.free_list: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def take_one(self) -> int:
        """A CPU block with one reference; the caller has checked `num_free`."""
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop a reference; True when the block went back to the free list."""
        ref = self.ref_counts[block] - 1
        self.ref_counts[block] = ref
        if ref:
            return False
        self.free_list.append(block)
        return True
