"""Who is preempted first: lowest priority, then latest arrival.

A heap of (priority, -arrival, seq_id) over running sequences with lazy
deletion: pushing at admission, swap-in or fork is O(log n); dropping a
sequence (free, preemption) only forgets its key, and dead entries are skipped
when met and compacted away when they outnumber live ones. Listing the next k
candidates pops them and pushes them back: O(k log n), never a scan.

Fork groups (sequences that share blocks through Fork) are preempted
together: a group id is set at fork (the id of the group's first sequence)
and `groups` maps it to its members, kept only for groups of two or more.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator


class VictimQueue:
    __slots__ = ("_heap", "_live", "_tick")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, str]] = []  # (priority, -arrival, token, seq_id)
        self._live: dict[str, int] = {}  # seq_id -> token of its live entry
        self._tick = 0

    def push(self, seq_id: str, priority: int, arrival: int) -> None:
        self._tick += 1
        self._live[seq_id] = self._tick
        heapq.heappush(self._heap, (priority, -arrival, self._tick, seq_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(heap)
            self._heap = heap

    def discard(self, seq_id: str) -> None:
        self._live.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def candidates(self, accept: Callable[[str], bool]) -> Iterator[str]:
        """Live sequences in preemption order for which `accept` holds.

        Walks the heap as a tree (a side heap of frontier positions) instead
        of popping it, so planning never changes the heap, not even its
        layout: a rejected call leaves the state byte for byte as it was,
        which is what journal replay relies on. O(k log k) for k entries seen.
        The caller must exhaust or close the iterator before mutating."""
        heap, live = self._heap, self._live
        if not heap:
            return
        frontier: list[tuple[tuple[int, int, int, str], int]] = [(heap[0], 0)]
        n = len(heap)
        while frontier:
            entry, i = heapq.heappop(frontier)
            for c in (2 * i + 1, 2 * i + 2):
                if c < n:
                    heapq.heappush(frontier, (heap[c], c))
            if live.get(entry[3]) != entry[2]:
                continue  # dead: freed, preempted, or re-pushed since
            if accept(entry[3]):
                yield entry[3]
