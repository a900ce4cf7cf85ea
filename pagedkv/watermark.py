"""The admission watermark: blocks that Allocate and SwapIn leave free, so that admitting new work
does not at once force preemption of the sequences already running (docs/policies.md).

One module because two sides do this arithmetic: the block manager decides admissions with it, and
the engine (frontend/engine) plans them with it from the manager's GetConfig, so that it sends only
Allocates the manager can accept and refuses up front a prompt that could never be admitted. Pure
arithmetic: no I/O, importable by the core.
"""

from __future__ import annotations


def watermark_blocks(fraction: float, num_gpu_blocks: int) -> int:
    """The ``watermark_fraction`` setting in whole blocks: rounded down, and always leaving at least
    one block to admit into."""
    return min(int(fraction * num_gpu_blocks), num_gpu_blocks - 1)


def admission_room(available: int, watermark: int) -> int:
    """Blocks an admission may take out of ``available`` free (or evictable) ones; negative when the
    pool is already below the watermark."""
    return available - watermark
