"""Recovery time vs journal size, in-process (``faults.py recovery``)."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedkv.v1 import block_manager_pb2 as pb


def run_recovery(sizes: tuple[int, ...] = (1000, 10000, 50000)) -> list[dict[str, Any]]:
    from pagedkv.block_manager_svc import records
    from pagedkv.block_manager_svc.core import CoreError  # noqa: F401
    from pagedkv.block_manager_svc.journal import Journal
    from pagedkv.block_manager_svc.server import build_core
    from pagedkv.block_manager_svc.servicer import BlockManagerServicer
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    rows = []
    for n in sizes:
        tmp = Path(tempfile.mkdtemp(prefix="pagedkv-recovery-"))
        settings = BlockManagerSettings(
            num_gpu_blocks=65536,
            block_size=16,
            state_dir=str(tmp),
            fsync="off",
            snapshot_every_ops=0,
            snapshot_interval_s=0,
        )
        s = BlockManagerServicer(build_core(settings))
        s.reliable.state_dir = tmp
        s.reliable.journal = Journal(tmp, 1, "off")
        ctx = _Ctx()
        rng = random.Random(n)
        live: list[str] = []
        for i in range(n):
            try:
                if len(live) < 256 and (not live or rng.random() < 0.1):
                    live.append(f"s{i}")
                    s.Allocate(
                        pb.AllocateRequest(
                            seq_id=live[-1], num_tokens=rng.randint(16, 1024), request_id=f"r{i}"
                        ),
                        ctx,
                    )
                elif rng.random() < 0.03:
                    s.Free(pb.FreeRequest(seq_id=live.pop(rng.randrange(len(live))), request_id=f"r{i}"), ctx)
                else:
                    r = s.Step(pb.StepRequest(append_seq_ids=live, request_id=f"r{i}"), ctx)
                    gone = {p.seq_id for p in getattr(r, "preempted", ())}
                    live = [x for x in live if x not in gone]
            except RuntimeError:  # pool full (Allocate) or already preempted (Free): refused, not journaled
                live = [x for x in live if x in s._core.seqs]
        size = s.reliable.journal.bytes_written
        s.reliable.journal.close()
        t0 = time.perf_counter()
        s2 = BlockManagerServicer(build_core(settings))
        rep = s2.reliable.recover(tmp)
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        payload_len = len(records.encode(s2.reliable._state()))  # what snapshot_now does under the lock
        snap_s = time.perf_counter() - t0
        rows.append(
            {
                "records": n,
                "journal_mib": size / 2**20,
                "recovery_s": dt,
                "replayed": rep.replayed,
                "us_per_record": dt / n * 1e6,
                "snapshot_mib": payload_len / 2**20,
                "snapshot_export_s": snap_s,
            }
        )
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


class _Ctx:
    def time_remaining(self) -> None:
        return None

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")
