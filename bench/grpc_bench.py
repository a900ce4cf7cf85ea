"""The block manager over gRPC on loopback: what a call costs next to an empty one.

The server runs in its own process (``python -m pagedkv.cli block-manager`` on a
free loopback port, ready when gRPC health says SERVING); this process is the
client. Measured side by side, in interleaved rounds (so a noisy neighbour on
a shared host hits every row alike):

* ``Check``      grpc.health.v1 Check: an empty RPC, the floor
* ``GetStats``   an echo-like read of the block manager (takes its lock)
* ``Append``     unary Append of one token, round robin over pre-allocated sequences
* ``Step/packed``  one Step appending a token to 256 sequences as packed arrays
* ``Step/sub``     the same 256 appends as AppendRequest sub-messages
* ``Step/iteration``  the Step the engine really sends each iteration:
  256 running sequences each appending its sampled token WITH its id, 16
  commits (what the last worker step completed: a block boundary each), 4
  frees (finished requests) and 4 allocations (new 64-token prompts with
  their ids, this engine's lease), in the manager's order

each with one call in flight (sync stub, back to back) and with N in flight
(grpc.aio, N tasks on one channel). Targets: unary Append at >= 80 % of the
floor's calls/s with one call in flight and >= 100 % with N in flight; the
256-sequence packed Step p50 under 2 ms and the engine's iteration Step p50 at
most 1.3 ms (one call in flight).

    python -m bench.grpc_bench            # about 30-40 s
    python -m bench.grpc_bench --quick    # a few seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.healthcheck import wait_healthy
from pagedkv.ports import free_port
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent

STEP_SEQS = 256
APPEND_SEQS = 256
FLOOR = "Check"
ROWS = ("Check", "GetStats", "Append", "Step/packed", "Step/sub", "Step/iteration")
ITER_COMMITS = 16
ITER_FREES = 4  # = allocations per iteration
ITER_PROMPT = 64
ITER_LAG = 256  # an iteration's allocations are freed this many calls later (> calls in flight)
LEASE = "bench-engine"
# Targets: unary Append calls/s as a share of the floor's, at 1 and at N in flight;
# the engine's iteration Step p50 at 1 in flight.
APPEND_TARGET_1 = 0.8
APPEND_TARGET_N = 1.0
ITERATION_P50_MS = 1.3
LABELS = {
    "Check": "Check (health, empty RPC: floor)",
    "GetStats": "GetStats (echo-like read)",
    "Append": "Append (unary, 1 token)",
    "Step/packed": f"Step {STEP_SEQS} seqs, packed arrays",
    "Step/sub": f"Step {STEP_SEQS} seqs, sub-messages",
    "Step/iteration": f"Step engine iteration ({STEP_SEQS}+c/f/a)",
}


def start_server(num_gpu_blocks: int, timeout_s: float = 30.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start the block manager in a child process on a free loopback port; wait for SERVING."""
    last_err = ""
    for _ in range(3):  # the port picked can be taken in between: try another one
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "block-manager",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-gpu-blocks",
            str(num_gpu_blocks),
            "--log-level",
            "warning",
        ]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        )
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        target = f"127.0.0.1:{port}"
        try:
            wait_healthy(target, "", timeout_s, proc=proc, interval_s=0.05, name="block manager")
            return proc, target
        except (RuntimeError, TimeoutError):
            pass
        if proc.poll() is None:
            proc.kill()
        last_err = (proc.communicate()[1] or b"").decode(errors="replace")[-2000:]
    raise RuntimeError(f"block manager did not become healthy:\n{last_err}")


@dataclass
class Cell:
    latencies_ns: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies_ns) / self.seconds if self.seconds else 0.0

    def pct_ms(self, p: float) -> float:
        if not self.latencies_ns:
            return 0.0
        ordered = sorted(self.latencies_ns)
        return ordered[min(int(p / 100 * len(ordered)), len(ordered) - 1)] / 1e6


class Workload:
    """The requests of each row, built once; the sequences they use exist on the server."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.append_ids = [f"bench-a-{i}" for i in range(APPEND_SEQS)]
        self.step_ids = [f"bench-s-{i}" for i in range(STEP_SEQS)]
        self.iter_ids = [f"bench-i-{i}" for i in range(STEP_SEQS)]
        stub = pb_grpc.BlockManagerStub(channel)
        for seq in self.append_ids + self.step_ids:
            stub.Allocate(pb.AllocateRequest(seq_id=seq, num_tokens=16), timeout=5)
        for i, seq in enumerate(self.iter_ids):
            stub.Allocate(
                pb.AllocateRequest(
                    seq_id=seq, num_tokens=16, token_ids=[(i + j) % 30_000 for j in range(16)], lease_id=LEASE
                ),
                timeout=5,
            )
        self.iter_n = 0
        self.iter_tokens = [(7 * i) % 30_000 for i in range(STEP_SEQS)]
        self.iter_prefix = list(range(100, 100 + ITER_PROMPT - 16))
        self.appends = [pb.AppendRequest(seq_id=s, num_tokens=1) for s in self.append_ids]
        self.step_packed = pb.StepRequest(append_seq_ids=self.step_ids)
        self.step_sub = pb.StepRequest(
            appends=[pb.AppendRequest(seq_id=s, num_tokens=1) for s in self.step_ids]
        )
        self.n = 0

    def calls(
        self, bm: object, health: object
    ) -> dict[str, Callable[[], tuple[Callable[..., object], object]]]:
        """row -> function returning (stub method, request) for the next call."""
        check, stats = health.Check, bm.GetStats  # type: ignore[attr-defined]
        append, step = bm.Append, bm.Step  # type: ignore[attr-defined]
        check_req, stats_req = health_pb2.HealthCheckRequest(), pb.GetStatsRequest()

        def next_append() -> tuple[Callable[..., object], object]:
            self.n += 1
            return append, self.appends[self.n % APPEND_SEQS]

        def next_iteration() -> tuple[Callable[..., object], object]:
            return step, self.iteration_request()

        return {
            "Check": lambda: (check, check_req),
            "GetStats": lambda: (stats, stats_req),
            "Append": next_append,
            "Step/packed": lambda: (step, self.step_packed),
            "Step/sub": lambda: (step, self.step_sub),
            "Step/iteration": next_iteration,
        }

    def iteration_request(self) -> pb.StepRequest:
        """Iteration n: commit 16 running sequences (rotating) up to what is surely computed,
        free the 4 requests allocated ITER_LAG iterations ago, append a token to all 256, allocate
        4 new ones. Built per call (it is what the engine does), its cost included in the timing."""
        n = self.iter_n
        self.iter_n += 1
        # Every earlier iteration appended one token to each running sequence; ones still in flight
        # may not have applied yet, so commit only what ITER_LAG iterations ago made certain.
        computed = 16 + max(0, n - ITER_LAG)
        first = (n * ITER_COMMITS) % STEP_SEQS
        commit_ids = [self.iter_ids[(first + j) % STEP_SEQS] for j in range(ITER_COMMITS)]
        frees = [f"bench-n-{n - ITER_LAG}-{j}" for j in range(ITER_FREES)] if n >= ITER_LAG else []
        new_ids = [f"bench-n-{n}-{j}" for j in range(ITER_FREES)]
        prompts: list[int] = []
        for j in range(ITER_FREES):
            prompts += self.iter_prefix + [(n * 16 + j + k) % 30_000 for k in range(16)]
        tokens = self.iter_tokens
        for i in range(0, STEP_SEQS, 37):
            tokens[i] = (tokens[i] + n) % 30_000  # sampled tokens change every iteration
        return pb.StepRequest(
            commit_seq_ids=commit_ids,
            commit_num_computed_tokens=[computed] * ITER_COMMITS,
            free_seq_ids=frees,
            append_seq_ids=self.iter_ids,
            append_token_ids=tokens,
            alloc_seq_ids=new_ids,
            alloc_num_tokens=[ITER_PROMPT] * ITER_FREES,
            alloc_token_ids=prompts,
            alloc_lease_ids=[LEASE] * ITER_FREES,
        )


def run_sync(
    channel: grpc.Channel, work: Workload, window_s: float, rounds: int, results: dict[str, Cell]
) -> None:
    calls = work.calls(pb_grpc.BlockManagerStub(channel), health_pb2_grpc.HealthStub(channel))
    for name in ROWS:  # warm up
        end = time.perf_counter() + min(window_s, 0.1)
        while time.perf_counter() < end:
            method, req = calls[name]()
            resp = method(req, timeout=5)
            if name == "Step/iteration" and resp.errors:  # type: ignore[attr-defined]
                raise RuntimeError(f"the iteration Step must apply whole: {resp.errors[0]}")  # type: ignore[attr-defined]
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name in ROWS:
            cell, nxt = results[name], calls[name]
            lat = cell.latencies_ns
            start = clock()
            end = start + int(window_s * 1e9)
            t = start
            while t < end:
                method, req = nxt()
                method(req, timeout=5)
                t2 = clock()
                lat.append(t2 - t)
                t = t2
            cell.seconds += (t - start) / 1e9


async def run_async(
    target: str, work: Workload, window_s: float, rounds: int, in_flight: int, results: dict[str, Cell]
) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        calls = work.calls(pb_grpc.BlockManagerStub(channel), health_pb2_grpc.HealthStub(channel))
        clock = time.perf_counter_ns

        async def window(name: str, seconds: float, lat: list[int] | None) -> float:
            nxt = calls[name]
            end = clock() + int(seconds * 1e9)

            async def task() -> None:
                while clock() < end:
                    method, req = nxt()
                    t = clock()
                    await method(req, timeout=5)
                    if lat is not None:
                        lat.append(clock() - t)

            start = clock()
            await asyncio.gather(*(task() for _ in range(in_flight)))
            return (clock() - start) / 1e9

        for name in ROWS:
            await window(name, min(window_s, 0.1), None)
        for _ in range(rounds):
            for name in ROWS:
                results[name].seconds += await window(name, window_s, results[name].latencies_ns)


def render(table: dict[int, dict[str, Cell]], in_flight: int) -> tuple[str, dict[str, object], bool]:
    lines = [f"{'call':<44}{'in flight':>10}{'calls/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'vs floor':>10}"]
    data: dict[str, object] = {}
    for flight, cells in table.items():
        floor = cells[FLOOR].calls_per_s
        for name in ROWS:
            c = cells[name]
            ratio = c.calls_per_s / floor if floor else 0.0
            lines.append(
                f"{LABELS[name]:<44}{flight:>10}{c.calls_per_s:>10.0f}{c.pct_ms(50):>9.3f}"
                f"{c.pct_ms(99):>9.3f}{ratio:>10.2f}"
            )
            data[f"{name}@{flight}"] = {
                "calls_per_s": round(c.calls_per_s, 1),
                "p50_ms": round(c.pct_ms(50), 4),
                "p99_ms": round(c.pct_ms(99), 4),
                "vs_floor": round(ratio, 3),
                "count": len(c.latencies_ns),
            }
    lines.append("")
    lines.append("targets:")
    all_ok = True

    # Verdicts come from the published (rounded) numbers, so the JSON alone reproduces them.
    def num(row: str, flight: int, key: str) -> float:
        value = data[f"{row}@{flight}"]
        assert isinstance(value, dict)
        return float(value[key])

    for flight in table:
        floor_calls = num(FLOOR, flight, "calls_per_s")
        ratio = num("Append", flight, "calls_per_s") / floor_calls if floor_calls else 0.0
        want = APPEND_TARGET_1 if flight == 1 else APPEND_TARGET_N
        ok = ratio >= want
        all_ok &= ok
        lines.append(
            f"  unary Append calls/s >= {want:.0%} of the floor's, {flight:>2} in flight: {ratio:6.1%}  "
            f"{'ok' if ok else 'MISS'}"
        )
    for name in ("Step/packed", "Step/sub"):
        p50 = num(name, 1, "p50_ms")
        ok = p50 < 2.0
        if name == "Step/packed":
            all_ok &= ok
        lines.append(f"  {LABELS[name]} p50 < 2 ms, 1 in flight: {p50:.3f} ms  {'ok' if ok else 'MISS'}")
    p50 = num("Step/iteration", 1, "p50_ms")
    ok = p50 <= ITERATION_P50_MS
    all_ok &= ok
    lines.append(
        f"  {LABELS['Step/iteration']} p50 <= {ITERATION_P50_MS} ms, 1 in flight: {p50:.3f} ms  "
        f"{'ok' if ok else 'MISS'}"
    )
    packed, sub = table[1]["Step/packed"].pct_ms(50), table[1]["Step/sub"].pct_ms(50)
    if packed:
        lines.append(f"  (sub-messages / packed p50 at 1 in flight: {sub / packed:.2f}x)")
    data["targets_ok"] = all_ok
    return "\n".join(lines), data, all_ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, one round (smoke test)")
    ap.add_argument("--window", type=float, default=None, help="seconds per row per round")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    ap.add_argument("--in-flight", type=int, default=64, help="calls in flight in the concurrent mode")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    window = args.window if args.window is not None else (0.15 if args.quick else 0.8)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    # Every Step grows 256 sequences by a token: room for a few thousand Steps at 16 tokens/block,
    # for each of the two 256-sequence Step rows, plus the iteration row's in-flight allocations.
    expected_steps = int(2 * rounds * window * 4000)
    num_gpu_blocks = min(
        2**31 - 1,
        4 * (APPEND_SEQS + 2 * STEP_SEQS)
        + 2 * STEP_SEQS * (expected_steps // 16 + 2)
        + 2 * ITER_LAG * ITER_FREES * (ITER_PROMPT // 16),
    )
    t0 = time.monotonic()
    proc, target = start_server(num_gpu_blocks)
    try:
        with grpc.insecure_channel(target) as channel:
            work = Workload(channel)
            table: dict[int, dict[str, Cell]] = {
                1: {n: Cell() for n in ROWS},
                args.in_flight: {n: Cell() for n in ROWS},
            }
            run_sync(channel, work, window, rounds, table[1])
        asyncio.run(run_async(target, work, window, rounds, args.in_flight, table[args.in_flight]))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    text, data, ok = render(table, args.in_flight)
    print(
        f"block manager over gRPC on loopback ({target}; server and client in separate processes, "
        f"{os.cpu_count()} CPUs; {rounds} round(s) x {window:.2f} s per row; sync stub at 1 in flight, "
        f"grpc.aio at {args.in_flight})"
    )
    print(text)
    print(f"wall time {time.monotonic() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
