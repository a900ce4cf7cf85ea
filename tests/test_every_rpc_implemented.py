"""No RPC of a served service falls through to the generated base class, whose methods only
answer UNIMPLEMENTED (`raise NotImplementedError('Method not implemented!')` in pagedkv/v1)."""

from __future__ import annotations

import pytest

from pagedkv.block_manager_svc.servicer import BlockManagerServicer
from pagedkv.v1 import (
    block_manager_pb2,
    block_manager_pb2_grpc,
    cache_host_pb2,
    cache_host_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pagedkv.worker_svc.cache.host import CacheHostServicer
from pagedkv.worker_svc.servicer import WorkerServicer

CASES = [
    (block_manager_pb2, "BlockManager", block_manager_pb2_grpc.BlockManagerServicer, BlockManagerServicer),
    (worker_pb2, "Worker", worker_pb2_grpc.WorkerServicer, WorkerServicer),
    (cache_host_pb2, "CacheHost", cache_host_pb2_grpc.CacheHostServicer, CacheHostServicer),
]


@pytest.mark.parametrize("module, service, base, served", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_every_rpc_is_implemented(module, service, base, served) -> None:  # type: ignore[no-untyped-def]
    methods = [m.name for m in module.DESCRIPTOR.services_by_name[service].methods]
    assert methods
    missing = [m for m in methods if getattr(served, m) is getattr(base, m)]
    assert not missing, f"{served.__name__} leaves {missing} to the generated UNIMPLEMENTED stub"
