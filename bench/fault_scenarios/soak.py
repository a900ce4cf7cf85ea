"""Soak scenario: bounded load at a fraction of the measured peak for minutes, then check errors,
the pool and the RSS trace (``faults.py soak``)."""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.fault_scenarios.processes import ServerProcess, free_port, policy_flags, rss_kib
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def _soak_worker(
    stub: Any, name: str, stop: threading.Event, rate: float | None, counter: list[int], errors: list[str]
) -> None:
    rng = random.Random(hash(name))
    live: list[str] = []
    n = 0
    interval = 1.0 / rate if rate else 0.0
    nxt = time.perf_counter()
    renew = 0.0
    while not stop.is_set():
        n += 1
        rid = f"{name}-{n}"
        try:
            if time.monotonic() > renew:
                stub.KeepAlive(pb.KeepAliveRequest(lease_id=f"{name}-lease"), timeout=5)
                renew = time.monotonic() + 2.0
            if len(live) < 8 and (not live or rng.random() < 0.3):
                s = f"{name}-s{n}"
                stub.Allocate(
                    pb.AllocateRequest(
                        seq_id=s, num_tokens=rng.randint(1, 64), request_id=rid, lease_id=f"{name}-lease"
                    ),
                    timeout=5,
                )
                live.append(s)
            elif rng.random() < 0.2:
                stub.Free(
                    pb.FreeRequest(seq_id=live.pop(rng.randrange(len(live))), request_id=rid), timeout=5
                )
            else:
                stub.Append(
                    pb.AppendRequest(seq_id=rng.choice(live), num_tokens=1, request_id=rid), timeout=5
                )
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                errors.append(f"{e.code().name}: {e.details()}")
        counter[0] += 1
        if interval:
            nxt += interval
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -1.0:
                # More than a second behind (a long stall): start over rather than burst.
                # Shorter lags are made up, so the achieved rate does not drift below the target.
                nxt = time.perf_counter()
    for s in live:
        stub.Free(pb.FreeRequest(seq_id=s), timeout=5)


def run_soak(
    seconds: float = 600.0,
    fraction: float = 0.75,
    threads: int = 8,
    peak_window_s: float = 3.0,
    fsync: str = "batch",
    samples: int = 10,
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="pagedkv-soak-"))
    port = free_port()
    server = ServerProcess(
        port,
        [
            "--state-dir",
            str(tmp / "state"),
            "--fsync",
            fsync,
            "--num-gpu-blocks",
            "4096",
            "--lease-ttl-s",
            "30",
            "--dedupe-max-entries",
            "20000",
            *policy_flags(),
        ],
        tmp / "server.log",
    )
    server.start()
    assert server.proc is not None
    pid = server.proc.pid
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)

            def phase(
                duration: float,
                rate: float | None,
                tag: str,
                on_sample: Callable[[float], None] | None = None,
            ) -> tuple[int, list[str]]:
                stop = threading.Event()
                counters = [[0] for _ in range(threads)]
                errors: list[str] = []
                ts = [
                    threading.Thread(
                        target=_soak_worker, args=(stub, f"{tag}{i}", stop, rate, counters[i], errors)
                    )
                    for i in range(threads)
                ]
                for t in ts:
                    t.start()
                t_end = time.monotonic() + duration
                step = duration / max(samples, 1)
                while time.monotonic() < t_end:
                    time.sleep(min(step, max(t_end - time.monotonic(), 0)))
                    if on_sample:
                        on_sample(time.monotonic() - (t_end - duration))
                stop.set()
                for t in ts:
                    t.join()
                return sum(c[0] for c in counters), errors

            calls, _ = phase(peak_window_s, None, "peak")
            peak = calls / peak_window_s
            target = peak * fraction
            rss_start = rss_kib(pid)
            trace: list[tuple[float, int]] = []
            calls, errors = phase(
                seconds, target / threads, "soak", lambda t: trace.append((round(t, 1), rss_kib(pid)))
            )
            stats = stub.GetStats(pb.GetStatsRequest())
            rss_end = rss_kib(pid)
            return {
                "seconds": seconds,
                "peak_calls_s": peak,
                "target_calls_s": target,
                "achieved_calls_s": calls / seconds,
                "calls": calls,
                "errors": len(errors),
                "error_samples": errors[:3],
                "rss_start_kib": rss_start,
                "rss_end_kib": rss_end,
                "rss_trace": trace,
                "free_after": stats.num_free_blocks + stats.num_cached_blocks,
                "total_blocks": stats.num_gpu_blocks,
                "sequences_after": stats.num_sequences,
                "used_after": stats.num_used_blocks,
            }
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # journal, snapshots and log: nothing left in the temp dir
