"""Crash scenario: SIGKILL the block manager under load from model clients, restart it on the same
state dir, and check that no acknowledged op was lost (``faults.py crash``)."""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.fault_scenarios.processes import FAULTS, ROOT, ServerProcess, free_port, policy_flags
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def run_crash(
    kills: int = 20,
    clients: int = 3,
    fsync: str = "always",
    gap_s: tuple[float, float] = (0.15, 0.5),
    num_gpu_blocks: int = 512,
    block_size: int = 16,
    seed: int = 0,
    workdir: Path | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="pagedkv-crash-"))
    state = tmp / "state"
    port = free_port()
    server = ServerProcess(
        port,
        [
            "--state-dir",
            str(state),
            "--fsync",
            fsync,
            "--num-gpu-blocks",
            str(num_gpu_blocks),
            "--block-size",
            str(block_size),
            "--snapshot-every-ops",
            "2000",
            *policy_flags(),
        ],
        tmp / "server.log",
    )
    server.start()
    stop = tmp / "stop"
    procs = []
    for i in range(clients):
        procs.append(
            subprocess.Popen(
                [
                    *FAULTS,
                    "client",
                    "--port",
                    str(port),
                    "--name",
                    f"c{i}",
                    "--block-size",
                    str(block_size),
                    "--seed",
                    str(seed * 100 + i),
                    "--stop-file",
                    str(stop),
                    "--out",
                    str(tmp / f"c{i}.json"),
                    "--free-all",
                ],
                cwd=ROOT,
            )
        )
    restart_s = []
    t_start = time.perf_counter()
    try:
        time.sleep(0.5)
        for _ in range(kills):
            time.sleep(rng.uniform(*gap_s))
            server.kill()
            restart_s.append(server.start())
            for pr in procs:
                if pr.poll() is not None:
                    raise RuntimeError(f"a client exited early with {pr.returncode}")
        time.sleep(0.3)
    finally:
        stop.touch()
        for pr in procs:
            try:
                pr.wait(90)
            except subprocess.TimeoutExpired:
                pr.kill()
    results = [json.loads((tmp / f"c{i}.json").read_text()) for i in range(clients)]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stats = pb_grpc.BlockManagerStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
    server.stop()
    recs = server.recoveries()
    wall = time.perf_counter() - t_start
    replay = [(r.get("replayed", 0), r.get("journal_bytes", 0), r.get("seconds", 0.0)) for r in recs[1:]]
    return {
        "fsync": fsync,
        "kills": kills,
        "restarts_ok": len(restart_s),
        "acked_ops": sum(r["acked"] for r in results),
        "rejected_ops": sum(r["rejected"] for r in results),
        "calls_hit_by_kill": sum(r["retried_calls"] for r in results),
        "verifications": sum(r["verifications"] for r in results),
        "lost_or_mismatched": sum(r["num_problems"] for r in results),
        "problems": [p for r in results for p in r["problems"]][:10],
        "final_free": stats.num_free_blocks + stats.num_cached_blocks,
        "final_used": stats.num_used_blocks,
        "final_sequences": stats.num_sequences,
        "total_blocks": stats.num_gpu_blocks,
        "restart_s_median": sorted(restart_s)[len(restart_s) // 2] if restart_s else 0.0,
        "restart_s_max": max(restart_s, default=0.0),
        "replay_records_max": max((r[0] for r in replay), default=0),
        "replay_bytes_max": max((r[1] for r in replay), default=0),
        "replay_s_max": max((r[2] for r in replay), default=0.0),
        "replay": replay,
        "wall_s": wall,
    }
