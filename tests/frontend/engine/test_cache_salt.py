"""vLLM's cache_salt through the engine: the scheduler sends each allocation's salt in the Step and
the block manager mixes it into the prompt's first block hash, so requests with different salts
never share prefix-cache blocks (a tenant isolation the manager enforces) and the same salt does.
Scheduler, wire translation and the manager's core, in-process."""

from __future__ import annotations

from pagedkv.frontend.engine import GenerationRequest
from tests.frontend.engine.harness import Driver

PROMPT = list(range(3, 3 + 17))  # four full blocks of 4 and one token


def _cached(drv: Driver, rid: str, salt: str) -> tuple[int, list[int]]:
    """Run a request to its end: (its prompt's tokens found in the prefix cache, its first table)."""
    drv.scheduler.add(GenerationRequest(rid, list(PROMPT), max_tokens=2, cache_salt=salt))
    table: list[int] = []
    for _ in range(100):
        if not drv.scheduler.has_work():
            break
        drv.iterate()
        seq = next((s for s in drv.scheduler.running if s.request.request_id == rid), None)
        if seq is not None and not table:
            table = list(seq.block_table)
    return drv.scheduler.outputs[rid].num_cached_tokens, table


def test_different_salts_share_no_block_and_the_same_salt_does() -> None:
    drv = Driver.make(num_gpu_blocks=32)
    assert _cached(drv, "a1", "tenant-a")[0] == 0
    hit, table_a = _cached(drv, "a2", "tenant-a")
    assert hit == 16  # the same salt: the four full blocks
    miss, table_b = _cached(drv, "b1", "tenant-b")
    assert miss == 0 and not set(table_a[:4]) & set(table_b[:4])  # the prompt's full blocks
    assert _cached(drv, "plain", "")[0] == 0  # no salt: the shared space, which holds none of them
    assert [p.alloc_salts for p in drv.bm.steps if p.allocs][:3] == [["tenant-a"], ["tenant-a"], ["tenant-b"]]
