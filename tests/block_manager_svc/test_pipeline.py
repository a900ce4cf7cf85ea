"""The servicer's pipeline in process (block_manager_svc/servicer.py): the tenancy stage
rewrites into the caller's namespace and passes the tenant on as data, the core stage applies
and drains the call's KV events to the hub with that tenant; replies and errors map back."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.auth import Tenant, current_tenant
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.tenants import TenantLedger
from pagedkv.block_manager_svc.events import EventHub
from pagedkv.block_manager_svc.servicer import BlockManagerServicer
from pagedkv.block_manager_svc.tenancy import NO_TENANCY, TenantScope
from pagedkv.v1 import block_manager_pb2 as pb


class Aborted(Exception):
    pass


class Ctx:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple:
        return ()


def _servicer(tenancy: object) -> BlockManagerServicer:
    core = BlockManager(CoreConfig(num_gpu_blocks=16, block_size=4, preemption_mode="off"))
    sv = BlockManagerServicer(core, tenancy=tenancy)  # type: ignore[arg-type]
    if tenancy is not NO_TENANCY:
        core.enable_tenancy(TenantLedger())
    sv.events_hub = EventHub(sv._lock, tenancy=tenancy is not NO_TENANCY)
    sv.events_hub.attach(core)
    return sv


def test_without_tenancy_requests_pass_through_unchanged() -> None:
    sv = _servicer(NO_TENANCY)
    r = sv.Allocate(pb.AllocateRequest(seq_id="s", num_tokens=8, token_ids=list(range(8))), Ctx())
    assert list(r.block_ids) == sv._core.seqs["s"].block_ids and sv._core.seqs["s"].tenant == ""


def test_the_tenant_is_data_from_the_edge_to_the_core_and_the_events() -> None:
    sv = _servicer(TenantScope())
    token = current_tenant.set(Tenant("alice"))
    try:
        ctx = Ctx()
        sv.Allocate(pb.AllocateRequest(seq_id="s", num_tokens=8, token_ids=list(range(8))), ctx)
        seq = sv._core.seqs["alice\x1fs"]  # the namespace keys the sequence; the tenant is a field
        assert seq.tenant == "alice"
        sv.Commit(pb.CommitRequest(seq_id="s", num_computed_tokens=8), ctx)
        h = sv._core.pool.block_hash[seq.block_ids[0]]
        assert h is not None and sv.events_hub.owner[h] == "alice"  # type: ignore[union-attr]
        with pytest.raises(Aborted) as e:
            sv.Free(pb.FreeRequest(seq_id="nope"), ctx)
        assert e.value.args == (grpc.StatusCode.NOT_FOUND, "sequence 'nope' does not exist")
        r = sv.Step(pb.StepRequest(free_seq_ids=["nope"], alloc_seq_ids=["t"], alloc_num_tokens=[4]), ctx)
        assert [(x.seq_id, x.message) for x in r.errors] == [("nope", "sequence 'nope' does not exist")]
        assert sv._core.seqs["alice\x1ft"].tenant == "alice"
    finally:
        current_tenant.reset(token)


def test_reset_prefix_cache_is_for_admins_only() -> None:
    sv = _servicer(TenantScope())
    token = current_tenant.set(Tenant("bob"))
    try:
        with pytest.raises(Aborted) as e:
            sv.ResetPrefixCache(pb.ResetPrefixCacheRequest(), Ctx())
        assert e.value.args[0] == grpc.StatusCode.PERMISSION_DENIED
    finally:
        current_tenant.reset(token)
