"""The admission watermark: blocks that Allocate and SwapIn leave free, so that admitting new work
does not at once force preemption of the sequences already running (docs/policies.md).

One module because two sides do this arithmetic: the block manager decides admissions with it, and
the engine (frontend/engine) plans them with it from the manager's GetConfig, so that it sends only
Allocates the manager can accept and refuses up front a prompt that could never be admitted
(``never_admitted``, the one place that question is decided). Pure arithmetic: no I/O, importable by
the core.
"""

from __future__ import annotations

from pagedkv.kv_capacity import blocks_for_tokens


def watermark_blocks(fraction: float, num_gpu_blocks: int) -> int:
    """The ``watermark_fraction`` setting in whole blocks: rounded down, and always leaving at least
    one block to admit into."""
    return min(int(fraction * num_gpu_blocks), num_gpu_blocks - 1)


def admission_room(available: int, watermark: int) -> int:
    """Blocks an admission may take out of ``available`` free (or evictable) ones; negative when the
    pool is already below the watermark."""
    return available - watermark


def never_admitted(
    num_tokens: int, block_size: int, num_gpu_blocks: int, watermark: int, num_kv_groups: int = 1
) -> str | None:
    """Why a sequence of ``num_tokens`` tokens can never be admitted into a pool of ``num_gpu_blocks``
    blocks with ``watermark`` of them held back, or None when it can be once the pool has room.

    Admission leaves the watermark's blocks free, so even into an otherwise empty pool a sequence may
    take at most ``admission_room(num_gpu_blocks, watermark)`` blocks; one that needs more would wait
    for room that never comes (each Allocate answered RESOURCE_EXHAUSTED). Prefix-cache hits do not
    lower the bound: a block another sequence holds is not free either. The reason names the
    tokens, the blocks they need and the pool, in one format for every caller (which names the
    request). With several KV-cache groups an Allocate takes the prompt's blocks in each of the
    ``num_kv_groups`` groups (a window group's shrink only as its commits come)."""
    need = blocks_for_tokens(num_tokens, block_size) * num_kv_groups
    room = admission_room(num_gpu_blocks, watermark)
    if need <= room:
        return None
    return (
        f"{num_tokens} tokens need {need} blocks of {block_size}"
        f"{f' over {num_kv_groups} KV-cache groups' if num_kv_groups > 1 else ''}, more than the {room} an "
        f"admission may take (the pool has {num_gpu_blocks} blocks, {watermark} held back by the "
        "watermark): they can never be admitted"
    )
