"""Journal cost per Append under each fsync policy (``faults.py fsync-cost``)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from typing import Any

import grpc

from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def run_fsync_cost(ops: int = 2000, threads: int = 8) -> list[dict[str, Any]]:
    from pagedkv.block_manager_svc.server import start_server
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    rows = []
    for label, extra in (
        ("memory (no --state-dir)", {}),
        ("memory + request_id", {"_rid": True}),
        ("--fsync off", {"fsync": "off"}),
        ("--fsync batch (5 ms)", {"fsync": "batch"}),
        ("--fsync always", {"fsync": "always"}),
    ):
        use_rid = bool(extra.pop("_rid", False))
        tmp = tempfile.mkdtemp(prefix="pagedkv-fsync-")
        kw: dict[str, Any] = {"port": 0, "num_gpu_blocks": 65536, "block_size": 16, "log_level": "warning"}
        if extra:
            kw.update(state_dir=tmp, snapshot_every_ops=0, snapshot_interval_s=0, **extra)
            use_rid = True
        running = start_server(BlockManagerSettings(**kw))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                stub = pb_grpc.BlockManagerStub(ch)
                for t in range(threads):
                    stub.Allocate(pb.AllocateRequest(seq_id=f"s{t}", num_tokens=1))
                lat: list[float] = []

                def one(t: int, n: int, out: list[float], stub: Any = stub, use_rid: bool = use_rid) -> None:
                    for i in range(n):
                        rid = f"{t}-{i}" if use_rid else ""
                        t0 = time.perf_counter()
                        stub.Append(pb.AppendRequest(seq_id=f"s{t}", num_tokens=1, request_id=rid))
                        out.append(time.perf_counter() - t0)

                one(0, ops // 4, lat)  # serial: latency of one call in flight
                lat.sort()
                outs: list[list[float]] = [[] for _ in range(threads)]
                ts = [threading.Thread(target=one, args=(t, ops // threads, outs[t])) for t in range(threads)]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                wall = time.perf_counter() - t0
                j = running.servicer.reliable.journal
                rows.append(
                    {
                        "mode": label,
                        "p50_us_1": lat[len(lat) // 2] * 1e6,
                        "p99_us_1": lat[int(len(lat) * 0.99)] * 1e6,
                        "calls_s_concurrent": (ops // threads) * threads / wall,
                        "fsyncs": j.num_fsyncs if j else 0,
                        "bytes_per_op": (j.bytes_written / max(j.last_seq, 1)) if j else 0,
                    }
                )
        finally:
            running.stop(0)
            shutil.rmtree(tmp, ignore_errors=True)
    return rows
