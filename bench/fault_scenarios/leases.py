"""Lease scenario: clients SIGKILLed without Free; their sequences come back within TTL + one
sweep (``faults.py leases``; the ``vanish`` subcommand is one such client)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import grpc

from bench.fault_scenarios.processes import FAULTS, ROOT
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def vanishing_client(port: int, lease: str, n: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        for i in range(n):
            stub.Allocate(pb.AllocateRequest(seq_id=f"{lease}-{i}", num_tokens=40, lease_id=lease))
        stub.Fork(pb.ForkRequest(parent_seq_id=f"{lease}-0", child_seq_id=f"{lease}-child"))
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:  # renew until killed
            stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease))
            time.sleep(0.1)


def run_leases(ttl_s: float = 1.0, sweep_s: float = 0.2, clients: int = 2, seqs: int = 5) -> dict[str, Any]:
    from pagedkv.block_manager_svc.server import start_server
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    running = start_server(
        BlockManagerSettings(
            port=0,
            num_gpu_blocks=256,
            block_size=16,
            lease_ttl_s=ttl_s,
            lease_sweep_interval_s=sweep_s,
            log_level="warning",
        )
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stub.Allocate(pb.AllocateRequest(seq_id="unleased", num_tokens=40))
            procs = [
                subprocess.Popen(
                    [
                        *FAULTS,
                        "vanish",
                        "--port",
                        str(running.port),
                        "--lease",
                        f"L{i}",
                        "--n",
                        str(seqs),
                    ],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in range(clients)
            ]
            for pr in procs:
                assert pr.stdout is not None and pr.stdout.readline().strip() == "ready"
            time.sleep(ttl_s * 1.5)  # renewals keep them alive past one TTL
            alive = stub.GetStats(pb.GetStatsRequest())
            for pr in procs:
                pr.send_signal(signal.SIGKILL)
                pr.wait()
            t_kill = time.monotonic()
            while True:
                s = stub.GetStats(pb.GetStatsRequest())
                if s.num_sequences == 1:
                    break
                if time.monotonic() - t_kill > ttl_s + sweep_s + 5:
                    break
                time.sleep(0.02)
            reclaim = time.monotonic() - t_kill
            return {
                "ttl_s": ttl_s,
                "sweep_s": sweep_s,
                "sequences_while_alive": alive.num_sequences,
                "sequences_after": s.num_sequences,
                "used_blocks_after": s.num_used_blocks,
                "leases_expired": s.num_leases_expired,
                "sequences_expired": s.num_lease_expired_sequences,
                "reclaim_s": reclaim,
                "within_bound": reclaim <= ttl_s + sweep_s + 0.25,
            }
    finally:
        running.stop(0)
