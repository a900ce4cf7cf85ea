"""pagedkv/plan.py: the stack's plan on described machines (none of which the suite runs on)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.cpu_list import format_cpus, parse_cpus
from pagedkv.machine import Machine
from pagedkv.plan import (
    GIB,
    KV_MEMORY_FRACTION,
    MAX_SEQS_CPU,
    MIN_KV_BLOCKS,
    RESERVE_CORE_FROM,
    Asked,
    ModelSize,
    PlanError,
    plan_stack,
)

# SmolLM2-135M as a Q4_1 GGUF: 94 MiB of weights, 30 layers x 3 KV heads x 64 dims in fp32.
SMOL = ModelSize(weight_bytes=94 << 20, kv_bytes_per_block=30 * 2 * 16 * 3 * 64 * 4, max_model_len=8192)


def machine(cores: int, **kw: object) -> Machine:
    return Machine(cpus=tuple(range(cores)), memory_available=kw.pop("memory", 16 * GIB), **kw)  # type: ignore[arg-type]


def assert_no_oversubscription(plan, m: Machine) -> None:  # noqa: ANN001
    pinned = [set(w.cpus) for w in plan.workers]
    for i, a in enumerate(pinned):
        assert a <= set(m.cpus)
        assert len(a) == plan.workers[i].threads
        for b in pinned[i + 1 :]:
            assert not a & b, "workers share a core"
    assert sum(w.threads for w in plan.workers) <= plan.compute_cores <= len(m.cpus)


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_small_machines_run_one_worker_over_every_core(cores: int) -> None:
    m = machine(cores)
    plan = plan_stack(m, SMOL)
    assert plan.device == "cpu"
    assert [w.cpus for w in plan.workers] == [tuple(range(cores))]
    assert [w.threads for w in plan.workers] == [cores]
    assert_no_oversubscription(plan, m)


@pytest.mark.parametrize("cores", [16, 64])
def test_larger_machines_leave_the_control_plane_a_core(cores: int) -> None:
    m = machine(cores)
    plan = plan_stack(m, SMOL)
    assert plan.num_workers == 1
    assert plan.workers[0].threads == cores - 1
    assert cores - 1 not in plan.workers[0].cpus
    assert_no_oversubscription(plan, m)
    assert any("one core left" in r for r in plan.reasons)
    # Below the threshold nothing is held back.
    assert plan_stack(machine(RESERVE_CORE_FROM - 1), SMOL).workers[0].threads == RESERVE_CORE_FROM - 1


def test_two_numa_nodes_get_a_worker_each_on_its_own_cores() -> None:
    m = machine(16, numa_nodes=(tuple(range(8)), tuple(range(8, 16))))
    plan = plan_stack(m, SMOL)
    assert plan.num_workers == 2
    assert set(plan.workers[0].cpus) <= set(range(8))
    assert set(plan.workers[1].cpus) <= set(range(8, 16))
    assert_no_oversubscription(plan, m)
    assert plan.max_num_seqs == 2 * MAX_SEQS_CPU


def test_the_affinity_mask_is_respected() -> None:
    m = Machine(cpus=(2, 3, 6, 7), memory_available=8 * GIB, numa_nodes=(tuple(range(4)), tuple(range(4, 8))))
    plan = plan_stack(m, SMOL)
    assert [w.cpus for w in plan.workers] == [(2, 3), (6, 7)]
    assert_no_oversubscription(plan, m)


def test_a_fractional_container_quota_caps_the_threads() -> None:
    m = machine(64, cpu_quota=1.5)
    plan = plan_stack(m, SMOL)
    assert [w.threads for w in plan.workers] == [1]
    assert plan.compute_cores == 1
    assert any("quota" in r for r in plan.reasons)
    # A quota under one CPU still computes on one thread.
    assert plan_stack(machine(4, cpu_quota=0.5), SMOL).workers[0].threads == 1
    assert plan_stack(machine(8, cpu_quota=4.0), SMOL).workers[0].threads == 4


def test_oversubscription_is_planned_down_with_a_warning() -> None:
    m = machine(2)
    plan = plan_stack(m, SMOL, Asked(num_workers=4))
    assert plan.num_workers == 2
    assert [w.threads for w in plan.workers] == [1, 1]
    assert any("--num-workers 4" in w for w in plan.warnings)
    assert_no_oversubscription(plan, m)
    plan = plan_stack(m, SMOL, Asked(num_threads=8))
    assert plan.workers[0].threads == 2
    assert any("--num-threads 8" in w for w in plan.warnings)


def test_hand_settings_are_kept() -> None:
    m = machine(4)
    plan = plan_stack(m, SMOL, Asked(num_workers=2, num_threads=1, max_num_seqs=7, num_gpu_blocks=300))
    assert [w.cpus for w in plan.workers] == [(0,), (2,)]
    assert plan.max_num_seqs == 7
    assert plan.num_gpu_blocks == 300
    assert not plan.warnings
    plan = plan_stack(m, SMOL, Asked(kv_cache_memory_gib=1.0))
    assert plan.num_gpu_blocks == GIB // SMOL.kv_bytes_per_block
    unpinned = plan_stack(m, SMOL, Asked(num_workers=2, pin=False))
    assert [w.cpus for w in unpinned.workers] == [(), ()]
    assert [w.threads for w in unpinned.workers] == [2, 2]


def test_the_kv_budget_follows_memory_and_the_model() -> None:
    small = plan_stack(machine(2, memory=4 * GIB), SMOL)
    big = plan_stack(machine(2, memory=16 * GIB), SMOL)
    assert small.kv_cache_bytes < big.kv_cache_bytes
    assert big.kv_cache_bytes < 16 * GIB
    assert small.kv_cache_bytes == small.num_gpu_blocks * SMOL.kv_bytes_per_block
    # A tiny model's cache is bounded by what every sequence at full length could use, not memory.
    tiny = ModelSize(weight_bytes=1 << 20, kv_bytes_per_block=4096, max_model_len=2048)
    plan = plan_stack(machine(2, memory=16 * GIB), tiny)
    assert plan.num_gpu_blocks == plan.max_num_seqs * 2048 // 16
    # /dev/shm, where a CPU cache lives, bounds it too.
    shm = plan_stack(machine(2, memory=16 * GIB, shm_available=1 * GIB), SMOL)
    assert shm.kv_cache_bytes < 1 * GIB - SMOL.weight_bytes


def test_a_draft_model_costs_each_worker_its_weights() -> None:
    """--speculative-model: every worker loads the draft itself, so the KV budget is what is left
    after one copy per worker (two NUMA nodes: two workers)."""
    from dataclasses import replace

    nodes = machine(8, memory=4 * GIB, numa_nodes=((0, 1, 2, 3), (4, 5, 6, 7)))
    plain = plan_stack(nodes, SMOL)
    drafted = plan_stack(nodes, replace(SMOL, draft_weight_bytes=200 << 20))
    assert len(drafted.workers) == 2
    lost = (plain.num_gpu_blocks - drafted.num_gpu_blocks) * SMOL.kv_bytes_per_block
    assert abs(lost - 2 * (200 << 20) * KV_MEMORY_FRACTION) <= SMOL.kv_bytes_per_block


def test_low_memory_plans_fewer_sequences_or_refuses() -> None:
    low = plan_stack(machine(2, memory=2 * GIB + (200 << 20)), SMOL)
    assert low.max_num_seqs < MAX_SEQS_CPU
    assert low.max_num_seqs * 256 <= low.num_gpu_blocks * 16
    with pytest.raises(PlanError, match="too little memory"):
        plan_stack(machine(2, memory=1 * GIB), SMOL)


def test_a_gpu_host_runs_one_worker_on_the_gpu() -> None:
    m = machine(16, gpus=(80 * GIB,))
    plan = plan_stack(m, SMOL)
    assert plan.device == "cuda"
    assert plan.num_workers == 1
    assert plan.kv_cache_bytes <= 0.9 * 80 * GIB - SMOL.weight_bytes
    with pytest.raises(PlanError, match="no GPU"):
        plan_stack(machine(2), SMOL, Asked(device="cuda"))
    assert plan_stack(m, SMOL, Asked(device="cpu")).device == "cpu"


@given(
    cores=st.integers(1, 96),
    nodes=st.integers(1, 4),
    quota=st.one_of(st.none(), st.floats(0.1, 128)),
    workers=st.one_of(st.none(), st.integers(1, 128)),
    threads=st.one_of(st.none(), st.integers(1, 128)),
)
def test_never_more_compute_threads_than_cores(
    cores: int, nodes: int, quota: float | None, workers: int | None, threads: int | None
) -> None:
    per = max(1, cores // nodes)
    starts = [i * per for i in range(nodes) if i * per < cores]
    node_cpus = tuple(tuple(range(a, min(cores, a + per))) for a in starts)
    m = machine(cores, numa_nodes=node_cpus, cpu_quota=quota, memory=256 * GIB)
    plan = plan_stack(m, SMOL, Asked(num_workers=workers, num_threads=threads))
    assert plan.num_workers >= 1
    assert all(w.threads >= 1 for w in plan.workers)
    assert_no_oversubscription(plan, m)
    if quota is not None:
        assert sum(w.threads for w in plan.workers) <= max(1, int(quota + 1e-9))


def test_cpu_lists_round_trip() -> None:
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert parse_cpus(format_cpus({3, 9, 10, 11})) == {3, 9, 10, 11}
    assert MIN_KV_BLOCKS > 0


def test_plan_lines_say_each_roles_share() -> None:
    lines = plan_stack(machine(2), SMOL).lines()
    assert lines[0].startswith("worker-0")
    assert "cores 0-1 (pinned)" in lines[0] and "2 compute threads" in lines[0]
    assert "KV cache" in lines[1] and "blocks" in lines[1] and "MiB" in lines[1]
    assert "sequences at once" in lines[2]
