"""Tenant identity as data (core/tenants.py): the tenant passed at admission is
kept on the sequence, charged through the ledger, and is an extra key of the
prefix hash; the null ledger charges nothing."""

from __future__ import annotations

import pytest

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, ResourceExhausted, StepBatch
from pagedkv.block_manager_svc.core.invariants import check_invariants
from pagedkv.block_manager_svc.core.prefix_cache import ROOT_HASH, root_hash
from pagedkv.block_manager_svc.core.tenants import NULL_LEDGER, Quota, TenantLedger


def core(**kw: object) -> BlockManager:
    cfg = dict(num_gpu_blocks=32, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    cfg.update(kw)
    return BlockManager(CoreConfig(**cfg))  # type: ignore[arg-type]


def test_the_tenant_and_the_salt_are_separate_hash_keys() -> None:
    keys = [
        root_hash(),
        root_hash(b"s"),
        root_hash(b"", b"t"),
        root_hash(b"s", b"t"),
        root_hash(b"", b"ts"),
        root_hash(b"t", b"s"),
        root_hash(b"\x00\x01ts"),
    ]
    assert len(set(keys)) == len(keys) and keys[0] == ROOT_HASH


def test_prefix_hits_stay_inside_one_tenant_and_salt() -> None:
    bm = core()
    prompt = list(range(9))
    bm.allocate("a1", 9, prompt, tenant="a")
    bm.commit("a1", 9)
    assert bm.allocate("b1", 9, prompt, tenant="b").num_cached_tokens == 0
    assert bm.allocate("a2", 9, prompt, tenant="a", salt="s").num_cached_tokens == 0
    assert bm.allocate("a3", 9, prompt, tenant="a").num_cached_tokens == 8
    assert bm.allocate("u1", 9, prompt).num_cached_tokens == 0  # no tenant is its own space too
    check_invariants(bm)


def test_the_sequence_keeps_its_tenant_and_forks_inherit_it() -> None:
    bm = core()
    ledger = TenantLedger(quotas={"a": Quota(max_sequences=2)})
    bm.enable_tenancy(ledger)
    bm.allocate("x", 5, tenant="a")
    bm.fork("x", "y")
    assert bm.seqs["y"].tenant == "a" and ledger.of("a").sequences == 2 and ledger.of("a").gpu_blocks == 2
    with pytest.raises(ResourceExhausted, match="tenant 'a' quota max_sequences=2 exceeded"):
        bm.fork("x", "z")
    with pytest.raises(ResourceExhausted, match="max_sequences"):
        bm.allocate("w", 1, tenant="a")
    assert "w" not in bm.seqs and "z" not in bm.seqs and ledger.of("a").sequences == 2
    bm.step(StepBatch(alloc_seq_ids=["s1"], alloc_num_tokens=[4], tenant="b"))
    assert bm.seqs["s1"].tenant == "b" and ledger.of("b").gpu_blocks == 1
    bm.free("x")
    bm.free("y")
    assert ledger.of("a").sequences == 0 and ledger.of("a").gpu_blocks == 0
    check_invariants(bm)


def test_preemption_never_crosses_tenants() -> None:
    for tenancy in (False, True):
        bm = core(num_gpu_blocks=4, num_cpu_blocks=4)
        if tenancy:
            bm.enable_tenancy(TenantLedger())
        bm.allocate("b", 8, tenant="b")  # 2 blocks
        bm.allocate("a", 8, tenant="a")  # 2 blocks, arrived later: ranks below b; the pool is full
        if tenancy:
            with pytest.raises(ResourceExhausted):
                bm.append("b", 1)  # a's sequence is not b's to preempt
            assert set(bm.seqs) == {"a", "b"}
        else:
            r = bm.append("b", 1)  # one tenant: a is the victim
            assert [p.seq_id for p in r.preempted] == ["a"] and "a" in bm.swapped
        check_invariants(bm)


def test_the_null_ledger_is_the_default_and_charges_nothing() -> None:
    bm = core()
    assert bm.ledger is NULL_LEDGER and bm.tenants is None
    bm.allocate("x", 8, tenant="a")
    bm.preempt("x", "swap")
    bm.swap_in("x")
    bm.free("x")
    check_invariants(bm)
