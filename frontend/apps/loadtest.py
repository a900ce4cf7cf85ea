"""``pagedkv loadtest``: a bounded, ghz-style load generator for the block manager.

ghz (https://ghz.sh) cannot be built on every host, and it cannot keep a pool
consistent (Append/Fork/Free need sequences that exist), so this is a Python
generator with ghz's knobs and ghz-like output, plus what ghz lacks for a
stateful API:

* **Real sequence lifecycles.** Every concurrency slot ("worker") owns its
  sequences, named ``lt-<pid>-<worker>-<n>`` so runs and workers never
  collide; it allocates before it appends/forks/frees, and frees everything
  it allocated at the end, so the pool ends where it started. The run checks
  that through GetStats (sequences and used blocks back to their starting
  values) and exits 1 if not.
* **Pool-aware sizing.** Each worker gets an equal share of the blocks that
  were available at the start (90 %) and bounds its live sequences and their
  lengths so it never runs the pool dry (no RESOURCE_EXHAUSTED by design).
* **Step as a decode batch.** A ``step`` operation is one packed Step RPC for
  the worker's batch of ``--step-size`` sequences, continuous-batching style:
  the ``r`` oldest sequences finish (freed inside the same Step), the rest get
  one token each, and ``r`` new ones are admitted with Allocate calls (counted
  under ``allocate``). ``r`` is the smallest rotation that fits the pool.

Bounded: it always stops by itself, after ``--total`` calls or ``--duration``
seconds. ``--connections N`` runs N processes, one gRPC channel each, so the
client side is not limited by one interpreter's GIL; ``--concurrency`` is the
total number of calls in flight, spread over them.

Point it only at servers you own: it creates and frees sequences there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import queue
import random
import sys
import time
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from pagedkv import defaults
from pagedkv.arith import ceil_div
from pagedkv.dial import TokenError
from pagedkv.frontend.clients.connection import add_connection_args, client_kwargs
from pagedkv.kv_capacity import blocks_for_tokens

OPS = ("allocate", "append", "fork", "free", "step", "table", "stats")
RPC_OF = {
    "allocate": "Allocate",
    "append": "Append",
    "fork": "Fork",
    "free": "Free",
    "step": "Step",
    "table": "GetBlockTable",
    "stats": "GetStats",
}
SCENARIOS: dict[str, str] = {
    # a bit of everything, Append-heavy like decoding without batching
    "mixed": "allocate=1,append=8,fork=1,free=1,step=1",
    # request lifecycles through unary calls only: admit, grow, finish
    "lifecycle": "allocate=1,append=8,free=1",
    # admission churn: the cheapest mutation pair
    "churn": "allocate=1,free=1",
    # batched decoding: packed Steps of --step-size sequences
    "decode": "step=1",
    # beam-search-like: forks and appends on the children
    "fork": "allocate=1,fork=2,append=4,free=3",
    # read-only floor
    "reads": "stats=1",
}
PERCENTILES = (10, 25, 50, 75, 90, 95, 99, 99.9)
AMBIGUOUS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


class LoadTestError(Exception):
    """A configuration or environment problem reported before any load is sent."""


# ----------------------------------------------------------------------------------------------
# Options and the plan each process runs.


def parse_mix(text: str) -> dict[str, float]:
    text = SCENARIOS.get(text, text)
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = part.partition("=")
        name = name.strip().lower()
        if name not in OPS:
            raise argparse.ArgumentTypeError(f"unknown call {name!r} in mix (known: {', '.join(OPS)})")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad weight {weight!r} for {name}") from None
        if w < 0 or not math.isfinite(w):
            raise argparse.ArgumentTypeError(f"weight of {name} must be >= 0")
        if w > 0:
            mix[name] = w
    if not mix:
        raise argparse.ArgumentTypeError("the mix has no call with a positive weight")
    return mix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv loadtest",
        description="Bounded ghz-style load against a block manager you own: sequences are created with "
        "unique ids and all freed at the end; the pool is checked to be back where it started.",
        epilog="scenarios: " + "; ".join(f"{k} = {v}" for k, v in SCENARIOS.items()),
    )
    p.add_argument("--target", default=defaults.BLOCK_MANAGER_ADDRESS, help="host:port of the block manager")
    p.add_argument(
        "-c", "--concurrency", type=int, default=16, help="calls in flight (workers), all connections"
    )
    p.add_argument(
        "--connections",
        type=int,
        default=1,
        help="gRPC connections; each runs in its own process (beats the GIL)",
    )
    p.add_argument("--rps", type=float, default=0.0, help="rate limit in calls/s over all workers (0 = none)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument(
        "-n", "--total", type=int, default=None, help="stop after this many calls (default 1000)"
    )
    bound.add_argument("-z", "--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument(
        "--mix",
        type=parse_mix,
        default=parse_mix("mixed"),
        help="call weights, e.g. allocate=1,append=8,free=1, or a scenario name (default: mixed)",
    )
    p.add_argument(
        "--scenario", choices=sorted(SCENARIOS), default=None, help="a named mix (overrides --mix)"
    )
    p.add_argument("--num-tokens", type=int, default=32, help="prompt tokens per Allocate")
    p.add_argument("--step-size", type=int, default=64, help="sequences per Step (the decode batch)")
    p.add_argument(
        "--max-live", type=int, default=8, help="live unary-path sequences per worker (upper bound)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="deadline of each call, seconds")
    p.add_argument("--format", choices=("summary", "json"), default="summary", help="report format")
    p.add_argument("-o", "--output", default=None, help="write the report to this file instead of stdout")
    p.add_argument(
        "--no-pool-check",
        dest="pool_check",
        action="store_false",
        help="skip the end-of-run GetStats check (for a server that others use at the same time)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed of the call choice")
    add_connection_args(p)
    return p


@dataclass(slots=True)
class PartPlan:
    """What one connection (process) runs."""

    target: str
    index: int
    workers: int
    worker_offset: int
    total: int | None
    duration: float | None
    rps_per_worker: float
    mix: dict[str, float]
    num_tokens: int
    step_size: int
    step_rotate: int
    max_live: int
    max_seq_tokens: int
    timeout_s: float
    seed: int
    # TLS files and bearer token (frontend/clients/connection.py): for a secured stack
    # (`pagedkv up --tls-dir`).
    conn: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(slots=True)
class PartResult:
    ops: bytes = b""
    latencies_ns: bytes = b""
    codes: bytes = b""
    t_start_ns: int = 0
    t_end_ns: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    cleanup_errors: list[str] = field(default_factory=list)
    fatal: str | None = None


def size_step_batch(step_size: int, num_tokens: int, block_size: int, budget: int) -> int:
    """Smallest rotation r (sequences finished and admitted per step) whose batch fits ``budget``
    blocks; raises LoadTestError if even r = step_size does not fit."""
    for r in range(1, step_size + 1):
        lifetime = ceil_div(step_size, r)  # steps a sequence lives: it gains one token per step
        if step_size * blocks_for_tokens(num_tokens + lifetime, block_size) <= budget:
            return r
    raise LoadTestError(
        f"a Step batch of {step_size} sequences of {num_tokens}+ tokens needs "
        f"{step_size * blocks_for_tokens(num_tokens + 1, block_size)} blocks per worker but only "
        f"{budget} are available per worker: lower --step-size, --num-tokens or --concurrency, or give "
        "the server more --num-gpu-blocks"
    )


def make_plans(args: argparse.Namespace, available_blocks: int, block_size: int) -> list[PartPlan]:
    if args.concurrency < 1 or args.connections < 1:
        raise LoadTestError("--concurrency and --connections must be >= 1")
    if args.connections > args.concurrency:
        raise LoadTestError("--connections cannot exceed --concurrency (each connection needs a worker)")
    if args.num_tokens < 1 or args.step_size < 1 or args.max_live < 1:
        raise LoadTestError("--num-tokens, --step-size and --max-live must be >= 1")
    total = args.total if args.total is not None or args.duration is not None else 1000
    if total is not None and total < 1:
        raise LoadTestError("--total must be >= 1")
    if args.duration is not None and not args.duration > 0:
        raise LoadTestError("--duration must be > 0")
    mix = args.mix
    per_worker = int(available_blocks * 0.9) // args.concurrency
    unary = [op for op in mix if op in ("allocate", "append", "fork", "free")]
    need = blocks_for_tokens(args.num_tokens + 1, block_size)  # one unary sequence that can grow a little
    # The Step batch takes what the unary path does not reserve: room for a few growing sequences.
    step_budget = per_worker - (min(args.max_live, 4) * need * 2 if unary else 0)
    rotate = size_step_batch(args.step_size, args.num_tokens, block_size, step_budget) if "step" in mix else 0
    step_blocks = (
        args.step_size * blocks_for_tokens(args.num_tokens + ceil_div(args.step_size, rotate), block_size)
        if rotate
        else 0
    )
    unary_budget = per_worker - step_blocks
    max_live, max_seq_tokens = args.max_live, 0
    if unary:
        max_live = min(args.max_live, unary_budget // need)
        if max_live < 1:
            raise LoadTestError(
                f"each worker has {unary_budget} blocks for unary calls, less than the {need} one sequence "
                "of "
                f"{args.num_tokens} tokens needs: lower --concurrency or --num-tokens, or give the server "
                "more --num-gpu-blocks"
            )
        max_seq_tokens = (unary_budget // max_live) * block_size
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    plans = []
    offset = 0
    for i in range(args.connections):
        workers = args.concurrency // args.connections + (1 if i < args.concurrency % args.connections else 0)
        part_total = None
        if total is not None:
            part_total = total // args.connections + (1 if i < total % args.connections else 0)
        plans.append(
            PartPlan(
                target=args.target,
                index=i,
                workers=workers,
                worker_offset=offset,
                total=part_total,
                duration=args.duration,
                rps_per_worker=(args.rps / args.concurrency) if args.rps > 0 else 0.0,
                mix=dict(mix),
                num_tokens=args.num_tokens,
                step_size=args.step_size,
                step_rotate=rotate,
                max_live=max_live,
                max_seq_tokens=max_seq_tokens,
                timeout_s=args.timeout,
                seed=seed + i,
            )
        )
        offset += workers
    return plans


# ----------------------------------------------------------------------------------------------
# One connection: `workers` asyncio tasks sharing one channel.


class _Recorder:
    def __init__(self) -> None:
        self.ops = array("B")
        self.lat = array("q")
        self.codes = array("B")
        self.errors: Counter[str] = Counter()

    def add(self, op: str, latency_ns: int, code: grpc.StatusCode, details: str = "") -> None:
        self.ops.append(OPS.index(op))
        self.lat.append(latency_ns)
        self.codes.append(code.value[0])
        if code is not grpc.StatusCode.OK and (len(self.errors) < 20 or code.name in self.errors):
            self.errors[f"{RPC_OF[op]} {code.name}: {details[:120]}"] += 1


class _Budget:
    """Calls left for this connection (shared by its tasks; asyncio needs no lock)."""

    def __init__(self, total: int | None, deadline_ns: int | None) -> None:
        self.left = total
        self.deadline_ns = deadline_ns

    def take(self, n: int = 1) -> bool:
        if self.deadline_ns is not None and time.monotonic_ns() >= self.deadline_ns:
            return False
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= n
        return True


class _Worker:
    def __init__(self, client: Any, plan: PartPlan, wid: int, rec: _Recorder, rng: random.Random) -> None:
        self.c = client
        self.plan = plan
        self.prefix = f"lt-{os.getpid()}-{wid}-"
        self.n = 0
        self.rec = rec
        self.rng = rng
        self.live: list[str] = []
        self.length: dict[str, int] = {}
        self.maybe: set[str] = set()  # outcome unknown (timeout, connection loss): free at the end
        self.batch: list[str] = []  # the Step batch, oldest first
        self.ops = list(plan.mix)
        self.weights = [plan.mix[o] for o in self.ops]

    def _new_id(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n}"

    async def _timed(self, op: str, coro: Any, seq_id: str | None = None) -> Any:
        t0 = time.perf_counter_ns()
        try:
            resp = await coro
        except grpc.RpcError as e:
            code = e.code()
            self.rec.add(op, time.perf_counter_ns() - t0, code, e.details() or "")
            if seq_id is not None and code in AMBIGUOUS:
                self.maybe.add(seq_id)
            return None
        self.rec.add(op, time.perf_counter_ns() - t0, grpc.StatusCode.OK)
        return resp

    # -- unary path --------------------------------------------------------------------------

    async def allocate(self) -> int:
        if len(self.live) >= self.plan.max_live:
            return await self.free()
        seq = self._new_id()
        if await self._timed("allocate", self.c.allocate(seq, self.plan.num_tokens), seq) is not None:
            self.live.append(seq)
            self.length[seq] = self.plan.num_tokens
        return 1

    async def append(self) -> int:
        if not self.live:
            return await self.allocate()
        seq = self.rng.choice(self.live)
        if self.length[seq] + 1 > self.plan.max_seq_tokens:
            return await self._free_one(seq)
        if await self._timed("append", self.c.append(seq, 1), seq) is not None:
            self.length[seq] += 1
        return 1

    async def fork(self) -> int:
        if not self.live:
            return await self.allocate()
        if len(self.live) >= self.plan.max_live:
            return await self.free()
        parent, child = self.rng.choice(self.live), self._new_id()
        if await self._timed("fork", self.c.fork(parent, child), child) is not None:
            self.live.append(child)
            self.length[child] = self.length[parent]
        return 1

    async def free(self) -> int:
        if not self.live:
            return await self.allocate()
        return await self._free_one(self.rng.choice(self.live))

    async def _free_one(self, seq: str) -> int:
        self.live.remove(seq)
        self.length.pop(seq, None)
        await self._timed("free", self.c.free(seq), seq)
        return 1

    async def table(self) -> int:
        if not self.live:
            return await self.allocate()
        await self._timed("table", self.c.get_block_table(self.rng.choice(self.live)))
        return 1

    async def stats(self) -> int:
        await self._timed("stats", self.c.get_stats())
        return 1

    # -- the Step batch ----------------------------------------------------------------------

    async def _admit(self, k: int, timed: bool) -> int:
        calls = 0
        for _ in range(k):
            seq = self._new_id()
            calls += 1
            if timed:
                ok = (
                    await self._timed("allocate", self.c.allocate(seq, self.plan.num_tokens), seq) is not None
                )
            else:
                try:
                    await self.c.allocate(seq, self.plan.num_tokens)
                    ok = True
                except grpc.RpcError as e:
                    if e.code() in AMBIGUOUS:
                        self.maybe.add(seq)
                    raise
            if ok:
                self.batch.append(seq)
        return calls

    async def setup(self) -> None:
        if "step" in self.plan.mix:
            await self._admit(self.plan.step_size, timed=False)

    async def step(self) -> int:
        r = self.plan.step_rotate
        finished, running = self.batch[:r], self.batch[r:]
        resp = await self._timed("step", self.c.step_decode(running, frees=finished))
        calls = 1
        if resp is None:
            self.maybe.update(self.batch)
        self.batch = running
        missing = self.plan.step_size - len(self.batch)
        return calls + await self._admit(missing, timed=True)

    # -- loop and cleanup --------------------------------------------------------------------

    async def run(self, budget: _Budget) -> None:
        rate = self.plan.rps_per_worker
        interval_ns = int(1e9 / rate) if rate > 0 else 0
        next_ns = time.monotonic_ns()
        step_cost = 1 + self.plan.step_rotate
        while True:
            op = self.rng.choices(self.ops, self.weights)[0] if len(self.ops) > 1 else self.ops[0]
            cost = step_cost if op == "step" else 1
            if not budget.take(cost):
                return
            if interval_ns:
                delay = next_ns - time.monotonic_ns()
                if delay > 0:
                    await asyncio.sleep(delay / 1e9)
                next_ns += interval_ns * cost  # --rps counts calls, and a step op makes `cost` calls
            await getattr(self, op)()

    async def cleanup(self, cleanup_client: Any) -> list[str]:
        """Free everything this worker may own; retries are safe here because NOT_FOUND is fine."""
        problems = []
        for seq in [*self.live, *self.batch, *sorted(self.maybe)]:
            try:
                await cleanup_client.free(seq, request_id=f"cleanup-{seq}")
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    problems.append(f"free {seq}: {e.code().name} {e.details()}")
        self.live.clear()
        self.batch.clear()
        self.maybe.clear()
        return problems


async def _run_part(plan: PartPlan, wait_go: Any = None) -> PartResult:
    from pagedkv.frontend.clients.block_manager import AsyncBlockManagerClient
    from pagedkv.retry import NO_RETRY, RetryPolicy

    result = PartResult()
    rec = _Recorder()
    # ghz does not retry: the measured client reports every status as it came.
    async with (
        AsyncBlockManagerClient(
            plan.target, default_timeout_s=plan.timeout_s, retry=NO_RETRY, **plan.conn
        ) as client,
        AsyncBlockManagerClient(
            plan.target,
            default_timeout_s=30.0,
            **plan.conn,
            retry=RetryPolicy(max_attempts=8, initial_backoff_s=0.05),
        ) as cleanup_client,
    ):
        workers = [
            _Worker(client, plan, plan.worker_offset + w, rec, random.Random(plan.seed * 7919 + w))
            for w in range(plan.workers)
        ]
        try:
            await client.wait_ready(plan.timeout_s)
            await asyncio.gather(*(w.setup() for w in workers))
        except grpc.RpcError as e:
            result.fatal = f"setup failed: {e.code().name} {e.details()}"
        except asyncio.TimeoutError:
            result.fatal = f"setup failed: no connection to {plan.target} within {plan.timeout_s} s"
        if wait_go is not None:  # report ready even after a failure, so the parent never waits in vain
            await asyncio.get_running_loop().run_in_executor(None, wait_go)
        if result.fatal is None:
            result.t_start_ns = time.monotonic_ns()
            deadline = None if plan.duration is None else result.t_start_ns + int(plan.duration * 1e9)
            budget = _Budget(plan.total, deadline)
            await asyncio.gather(*(w.run(budget) for w in workers))
            result.t_end_ns = time.monotonic_ns()
        for w in workers:
            result.cleanup_errors += await w.cleanup(cleanup_client)
    result.ops, result.latencies_ns, result.codes = rec.ops.tobytes(), rec.lat.tobytes(), rec.codes.tobytes()
    result.errors = dict(rec.errors)
    return result


def _process_main(plan: PartPlan, ready: Any, go: Any, results: Any) -> None:
    """Entry point of one connection's process (spawned: no inherited gRPC state)."""

    def wait_go() -> None:
        ready.put(plan.index)
        go.wait()

    try:
        res = asyncio.run(_run_part(plan, wait_go))
    except BaseException as e:  # noqa: BLE001 - report anything to the parent
        res = PartResult(fatal=f"{type(e).__name__}: {e}")
        ready.put(plan.index)
    results.put((plan.index, asdict(res)))


def run_parts(plans: list[PartPlan], start_timeout_s: float = 60.0) -> list[PartResult]:
    if len(plans) == 1:
        return [asyncio.run(_run_part(plans[0]))]
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_process_main, args=(p, ready, go, results), daemon=True) for p in plans]
    for proc in procs:
        proc.start()

    def get(q: Any, timeout_s: float) -> Any:
        """Next item of q; fails fast when a process died without sending it."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return q.get(timeout=0.2)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise LoadTestError(f"a connection process exited with code {dead[0]}") from None
                if time.monotonic() > deadline:
                    raise LoadTestError(
                        f"no answer from the connection processes in {timeout_s:.0f} s"
                    ) from None

    try:
        for _ in plans:  # all connected and set up: start together
            get(ready, start_timeout_s)
        go.set()
        budget = max((plans[0].duration or 0) * 3 + 120, 600)
        out: dict[int, PartResult] = {}
        for _ in plans:
            index, data = get(results, budget)
            out[index] = PartResult(**data)
        return [out[i] for i in range(len(plans))]
    finally:
        go.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


# ----------------------------------------------------------------------------------------------
# Report.


def _percentile(sorted_ns: Sequence[int], pct: float) -> int:
    if not sorted_ns:
        return 0
    rank = max(math.ceil(pct / 100 * len(sorted_ns)), 1)
    return sorted_ns[min(rank, len(sorted_ns)) - 1]


def build_report(
    results: list[PartResult], args: argparse.Namespace, pool: dict[str, Any] | None
) -> dict[str, Any]:
    ops, lats, codes = array("B"), array("q"), array("B")
    for r in results:
        ops.frombytes(r.ops)
        lats.frombytes(r.latencies_ns)
        codes.frombytes(r.codes)
    starts = [r.t_start_ns for r in results if r.t_start_ns]
    ends = [r.t_end_ns for r in results if r.t_end_ns]
    total_s = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    ordered = sorted(lats)
    count = len(ordered)
    ms = 1e-6
    report: dict[str, Any] = {
        "target": args.target,
        "options": {
            "concurrency": args.concurrency,
            "connections": args.connections,
            "rps": args.rps,
            "total": args.total,
            "duration": args.duration,
            "mix": args.mix,
            "num_tokens": args.num_tokens,
            "step_size": args.step_size,
            "timeout_s": args.timeout,
        },
        "count": count,
        "total_s": round(total_s, 4),
        "slowest_ms": round(ordered[-1] * ms, 3) if count else 0.0,
        "fastest_ms": round(ordered[0] * ms, 3) if count else 0.0,
        "average_ms": round(sum(ordered) / count * ms, 3) if count else 0.0,
        "rps": round(count / total_s, 1) if total_s else 0.0,
        "latency_distribution": [
            {"percentage": p, "latency_ms": round(_percentile(ordered, p) * ms, 3)} for p in PERCENTILES
        ],
        "histogram": [],
        "status_code_distribution": dict(Counter(CODE_NAMES[c] for c in codes)),
        "error_distribution": {},
        "calls": {},
        "pool_check": pool,
        "cleanup_errors": [e for r in results for e in r.cleanup_errors][:20],
        "fatal": [r.fatal for r in results if r.fatal],
    }
    for r in results:
        for k, v in r.errors.items():
            report["error_distribution"][k] = report["error_distribution"].get(k, 0) + v
    if count:
        lo, hi = ordered[0], ordered[-1]
        width = (hi - lo) / 10 or 1
        buckets = [0] * 11
        for v in ordered:
            buckets[min(int((v - lo) / width), 10)] += 1
        buckets[9] += buckets.pop()  # the top edge belongs to the last bucket
        report["histogram"] = [
            {"mark_ms": round((lo + width * (i + 1)) * ms, 3), "count": n, "frequency": round(n / count, 4)}
            for i, n in enumerate(buckets)
        ]
    per_op: dict[int, list[int]] = {}
    per_op_err: Counter[int] = Counter()
    for o, v, c in zip(ops, lats, codes, strict=False):
        per_op.setdefault(o, []).append(v)
        if c:
            per_op_err[o] += 1
    for o, vals in sorted(per_op.items()):
        vals.sort()
        report["calls"][RPC_OF[OPS[o]]] = {
            "count": len(vals),
            "rps": round(len(vals) / total_s, 1) if total_s else 0.0,
            "average_ms": round(sum(vals) / len(vals) * ms, 3),
            "p50_ms": round(_percentile(vals, 50) * ms, 3),
            "p99_ms": round(_percentile(vals, 99) * ms, 3),
            "errors": per_op_err[o],
        }
    return report


def format_summary(rep: dict[str, Any]) -> str:
    lines = ["", "Summary:"]
    lines += [
        f"  Target:\t{rep['target']}",
        f"  Count:\t{rep['count']}",
        f"  Total:\t{rep['total_s'] * 1000:.2f} ms",
        f"  Slowest:\t{rep['slowest_ms']:.2f} ms",
        f"  Fastest:\t{rep['fastest_ms']:.2f} ms",
        f"  Average:\t{rep['average_ms']:.2f} ms",
        f"  Requests/sec:\t{rep['rps']:.2f}",
        "",
        "Response time histogram:",
    ]
    peak = max((b["count"] for b in rep["histogram"]), default=0) or 1
    for b in rep["histogram"]:
        bar = "∎" * round(40 * b["count"] / peak)
        lines.append(f"  {b['mark_ms']:8.3f} [{b['count']}]\t|{bar}")
    lines += ["", "Latency distribution:"]
    for d in rep["latency_distribution"]:
        lines.append(f"  {d['percentage']:g} % in {d['latency_ms']:.2f} ms")
    lines += ["", "Status code distribution:"]
    for name, n in sorted(rep["status_code_distribution"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  [{name}]\t{n} responses")
    if rep["error_distribution"]:
        lines += ["", "Error distribution:"]
        for msg, n in sorted(rep["error_distribution"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  [{n}]\t{msg}")
    header = f"  {'call':<14}{'count':>8}{'calls/s':>10}{'avg ms':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}"
    lines += ["", "Per call:", header]
    for name, c in rep["calls"].items():
        lines.append(
            f"  {name:<14}{c['count']:>8}{c['rps']:>10.1f}{c['average_ms']:>9.3f}{c['p50_ms']:>9.3f}"
            f"{c['p99_ms']:>9.3f}{c['errors']:>8}"
        )
    pool = rep["pool_check"]
    lines += ["", "Pool check:"]
    if pool is None:
        lines.append("  skipped (--no-pool-check)")
    else:
        b, a = pool["before"], pool["after"]
        verdict = "ok: pool back where it started" if pool["ok"] else "FAILED: pool not back where it started"
        lines.append(
            f"  {verdict} (sequences {b['num_sequences']} -> {a['num_sequences']}, "
            f"used blocks {b['num_used_blocks']} -> {a['num_used_blocks']})"
        )
    for msg in rep["cleanup_errors"]:
        lines.append(f"  cleanup: {msg}")
    for msg in rep["fatal"]:
        lines.append(f"  fatal: {msg}")
    return "\n".join(lines) + "\n"


def _stats_dict(stats: Any) -> dict[str, int]:
    return {
        "num_sequences": stats.num_sequences,
        "num_used_blocks": stats.num_used_blocks,
        "num_free_blocks": stats.num_free_blocks,
        "num_cached_blocks": stats.num_cached_blocks,
    }


def main(argv: Sequence[str] | None = None) -> int:
    from pagedkv.frontend.clients.block_manager import BlockManagerClient

    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.scenario:
        args.mix = parse_mix(args.scenario)
    try:
        conn = client_kwargs(args)
    except TokenError as e:
        sys.stderr.write(f"pagedkv loadtest: {e}\n")
        return 2
    try:
        with BlockManagerClient(args.target, default_timeout_s=max(args.timeout, 1.0), **conn) as bm:
            try:
                bm.wait_ready(args.timeout)
                cfg, before = bm.get_config(), bm.get_stats()
            except (grpc.RpcError, grpc.FutureTimeoutError) as e:
                raise LoadTestError(
                    f"cannot reach the block manager at {args.target}: "
                    f"{getattr(e, 'details', lambda: 'timed out')()}"
                ) from None
        plans = make_plans(args, before.num_free_blocks + before.num_cached_blocks, cfg.block_size)
        for plan in plans:
            plan.conn = conn
    except LoadTestError as e:
        sys.stderr.write(f"pagedkv loadtest: {e}\n")
        return 2
    try:
        results = run_parts(plans)
    except LoadTestError as e:
        sys.stderr.write(f"pagedkv loadtest: {e}\n")
        return 1
    pool = None
    if args.pool_check:
        with BlockManagerClient(args.target, **conn) as bm:
            after = bm.get_stats()
        b, a = _stats_dict(before), _stats_dict(after)
        ok = a["num_sequences"] == b["num_sequences"] and a["num_used_blocks"] == b["num_used_blocks"]
        pool = {"ok": ok, "before": b, "after": a}
    report = build_report(results, args, pool)
    text = json.dumps(report, indent=2) + "\n" if args.format == "json" else format_summary(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        sys.stderr.write(f"report written to {args.output}\n")
    else:
        sys.stdout.write(text)
    if report["fatal"]:
        return 1
    return 0 if pool is None or pool["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
