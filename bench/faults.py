"""Fault benchmarks for the block manager (issue 7): crash/SIGKILL recovery,
injected retries, leases of vanished clients, a bounded soak, journal cost.

    python bench/faults.py all            # the full run (10-minute soak), prints the table
    python bench/faults.py all --quick    # a few seconds per section
    python bench/faults.py crash --kills 20 --fsync always
    python bench/faults.py retries | leases | soak --minutes 10 | fsync-cost | recovery

The same functions run (with small sizes) in tests/block_manager_svc/reliability.
Everything listens on 127.0.0.1 only and every phase is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc

from pagedkv.healthcheck import wait_healthy
from pagedkv.ports import free_port
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# --- processes --------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class ServerProcess:
    """`pagedkv block-manager` as a child process, restartable on the same port and state dir."""

    def __init__(self, port: int, args: list[str], log_path: Path) -> None:
        self.port = port
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> float:
        t0 = time.perf_counter()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedkv.cli", "block-manager", "--port", str(self.port),
                 "--log-format", "json", *self.args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )
        self.starts += 1
        wait_healthy(f"127.0.0.1:{self.port}", "pagedkv.v1.BlockManager", 30.0, proc=self.proc, interval_s=0.01,
                     name="block manager")
        return time.perf_counter() - t0

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def recoveries(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if '"state_recovered"' in line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def policy_flags() -> list[str]:
    """Flags that keep other sequences' tables stable under load (no preemption), if supported."""
    from block_manager_svc.settings import BlockManagerSettings

    return ["--preemption-mode", "off"] if "preemption_mode" in BlockManagerSettings.model_fields else []


# --- a client that keeps an exact model of its own sequences ---------------------------------
class ModelClient:
    """Drives mixed Allocate/Append/Fork/Free/Step with request ids, retrying transient
    failures with the *same* id until it gets an answer, and checks every reply and, after
    each outage, every table against its own model. A lost acknowledged operation shows up
    as a mismatch (or an unexpected NOT_FOUND)."""

    def __init__(self, stub: Any, name: str, block_size: int, seed: int, max_live: int = 12,
                 call_timeout: float = 2.0, give_up_s: float = 60.0, sleep: Callable[[float], None] = time.sleep):
        self.stub = stub
        self.name = name
        self.bs = block_size
        self.rng = random.Random(seed)
        self.max_live = max_live
        self.call_timeout = call_timeout
        self.give_up_s = give_up_s
        self.sleep = sleep
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}
        self.freed: list[str] = []
        self.n = 0
        self.acked = 0
        self.rejected = 0
        self.retried_calls = 0
        self.outages = 0
        self.verifications = 0
        self.problems: list[str] = []
        self._outage = False

    def _rid(self) -> str:
        self.n += 1
        return f"{self.name}-r{self.n}"

    def call(self, method: str, request: Any) -> Any:
        """The answer to `request` (retried with its id through outages); None if refused."""
        fn = getattr(self.stub, method)
        give_up = time.monotonic() + self.give_up_s
        first = True
        while True:
            try:
                r = fn(request, timeout=self.call_timeout)
                return r
            except grpc.RpcError as e:
                code = e.code()
                if code in TRANSIENT:
                    if first:
                        self.retried_calls += 1
                        first = False
                    self._outage = True
                    if time.monotonic() > give_up:
                        raise
                    self.sleep(0.02)
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.rejected += 1
                    return None
                self.problems.append(f"{method} {request.request_id if hasattr(request, 'request_id') else ''}: "
                                     f"{code.name} {e.details()}")
                return None

    def _expect_blocks(self, seq: str) -> None:
        want = -(-self.tokens[seq] // self.bs)
        if len(self.tables[seq]) != want:
            self.problems.append(f"{seq}: {len(self.tables[seq])} blocks for {self.tokens[seq]} tokens")

    def _apply_append(self, seq: str, k: int, new: list[int], replaced: bool) -> None:
        t = self.tables[seq]
        if replaced:
            t[-1] = new[0]
            t.extend(new[1:])
        else:
            t.extend(new)
        self.tokens[seq] += k
        self._expect_blocks(seq)

    def step_once(self) -> None:
        rng = self.rng
        live = list(self.tables)
        r = rng.random()
        if not live or (r < 0.25 and len(live) < self.max_live):
            seq = f"{self.name}-s{self.n}"
            n = rng.randint(1, 6 * self.bs)
            prefix = rng.randrange(4)
            tokens = [(prefix * 1000 + i) if i < 2 * self.bs else rng.randrange(50_000) for i in range(n)]
            resp = self.call("Allocate", pb.AllocateRequest(seq_id=seq, num_tokens=n, token_ids=tokens,
                                                            request_id=self._rid()))
            if resp is not None:
                self.tables[seq] = list(resp.block_ids)
                self.tokens[seq] = n
                self.acked += 1
                self._expect_blocks(seq)
        elif r < 0.60:
            seq = rng.choice(live)
            k = rng.choice((1, 1, 1, 2, self.bs))
            resp = self.call("Append", pb.AppendRequest(seq_id=seq, num_tokens=k,
                                                        token_ids=[rng.randrange(50_000) for _ in range(k)],
                                                        request_id=self._rid()))
            if resp is not None:
                self.acked += 1
                self._apply_append(seq, k, list(resp.new_block_ids), resp.replaced_last_block)
        elif r < 0.70 and len(live) < self.max_live:
            parent = rng.choice(live)
            child = f"{self.name}-s{self.n}"
            resp = self.call("Fork", pb.ForkRequest(parent_seq_id=parent, child_seq_id=child,
                                                    request_id=self._rid()))
            if resp is not None:
                self.acked += 1
                if list(resp.block_ids) != self.tables[parent]:
                    self.problems.append(f"fork {child}: {list(resp.block_ids)} != parent {self.tables[parent]}")
                self.tables[child] = list(resp.block_ids)
                self.tokens[child] = self.tokens[parent]
        elif r < 0.88:
            seq = rng.choice(live)
            resp = self.call("Free", pb.FreeRequest(seq_id=seq, request_id=self._rid()))
            if resp is not None:
                self.acked += 1
                del self.tables[seq], self.tokens[seq]
                self.freed.append(seq)
        else:
            seqs = rng.sample(live, min(len(live), 4))
            frees = [s for s in seqs[:1] if rng.random() < 0.3]
            appends = [s for s in seqs if s not in frees]
            resp = self.call("Step", pb.StepRequest(append_seq_ids=appends, free_seq_ids=frees,
                                                    request_id=self._rid()))
            if resp is not None:
                self.acked += 1
                errs = {(e.kind, e.index): e for e in resp.errors}
                for j, s in enumerate(frees):
                    if (pb.StepItemError.PACKED_FREE, j) in errs:
                        self.problems.append(f"step free {s}: {errs[(pb.StepItemError.PACKED_FREE, j)].message}")
                    else:
                        del self.tables[s], self.tokens[s]
                        self.freed.append(s)
                per: dict[int, list[int]] = {}
                for i, b in zip(resp.packed_new_block_index, resp.packed_new_block_ids):
                    per.setdefault(i, []).append(b)
                replaced = set(resp.packed_replaced_index)
                for i, s in enumerate(appends):
                    e = errs.get((pb.StepItemError.PACKED_APPEND, i))
                    if e is not None:
                        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                            self.problems.append(f"step append {s}: {e.message}")
                        continue
                    self._apply_append(s, 1, per.get(i, []), i in replaced)
        if self._outage:
            self._outage = False
            self.outages += 1
            self.verify()

    def verify(self) -> None:
        """Every live table equals the model; a few freed sequences are gone."""
        self.verifications += 1
        for seq, table in self.tables.items():
            bt = self.call("GetBlockTable", pb.GetBlockTableRequest(seq_id=seq))
            if bt is None:
                self.problems.append(f"verify {seq}: missing")
            elif list(bt.block_ids) != table or bt.num_tokens != self.tokens[seq]:
                self.problems.append(f"verify {seq}: server {list(bt.block_ids)}/{bt.num_tokens} "
                                     f"!= model {table}/{self.tokens[seq]}")
        give_up = time.monotonic() + self.give_up_s
        for seq in self.freed[-5:]:
            while True:
                try:
                    self.stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq), timeout=self.call_timeout)
                    self.problems.append(f"verify {seq}: freed but present")
                except grpc.RpcError as e:
                    if e.code() in TRANSIENT and time.monotonic() < give_up:
                        self._outage = True  # the next kill came during the check: ask again
                        self.sleep(0.02)
                        continue
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        self.problems.append(f"verify {seq}: {e.code().name}")
                break

    def free_all(self) -> None:
        for seq in list(self.tables):
            if self.call("Free", pb.FreeRequest(seq_id=seq, request_id=self._rid())) is not None:
                del self.tables[seq], self.tokens[seq]

    def result(self) -> dict[str, Any]:
        return {"name": self.name, "acked": self.acked, "rejected": self.rejected, "outages": self.outages,
                "retried_calls": self.retried_calls, "verifications": self.verifications,
                "problems": self.problems[:20], "num_problems": len(self.problems),
                "live": {s: t for s, t in self.tables.items()}}


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="faults.py client")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--free-all", action="store_true")
    a = p.parse_args(argv)
    opts = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 100)]
    with grpc.insecure_channel(f"127.0.0.1:{a.port}", options=opts) as ch:
        c = ModelClient(pb_grpc.BlockManagerStub(ch), a.name, a.block_size, a.seed)
        stop = Path(a.stop_file)
        while not stop.exists():
            c.step_once()
        c.verify()
        if a.free_all:
            c.free_all()
        Path(a.out).write_text(json.dumps(c.result()))
    return 0


# --- crash: SIGKILL under load, restart, check ----------------------------------------------
def run_crash(kills: int = 20, clients: int = 3, fsync: str = "always", gap_s: tuple[float, float] = (0.15, 0.5),
              num_gpu_blocks: int = 512, block_size: int = 16, seed: int = 0,
              workdir: Path | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="pagedkv-crash-"))
    state = tmp / "state"
    port = free_port()
    server = ServerProcess(port, ["--state-dir", str(state), "--fsync", fsync, "--num-gpu-blocks",
                                  str(num_gpu_blocks), "--block-size", str(block_size),
                                  "--snapshot-every-ops", "2000", *policy_flags()], tmp / "server.log")
    server.start()
    stop = tmp / "stop"
    procs = []
    for i in range(clients):
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "client", "--port", str(port), "--name", f"c{i}", "--block-size",
             str(block_size), "--seed", str(seed * 100 + i), "--stop-file", str(stop), "--out",
             str(tmp / f"c{i}.json"), "--free-all"], cwd=ROOT))
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


# --- retries: injected faults between client and server ---------------------------------------
class _InjectedError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, where: str) -> None:
        super().__init__(f"injected {code.name} {where}")
        self._code, self._where = code, where

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"injected {self._code.name} ({self._where})"

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


class FaultInjector(grpc.UnaryUnaryClientInterceptor):
    """Fails calls with UNAVAILABLE / DEADLINE_EXCEEDED before they are sent (the server never
    sees them) or after the reply came back (the server applied them; the client never hears)."""

    def __init__(self, p_before: float, p_after: float, seed: int = 0, methods: tuple[str, ...] = ()) -> None:
        self.p_before, self.p_after = p_before, p_after
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.methods = methods
        self.injected_before = self.injected_after = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method.rsplit("/", 1)[-1]
        if self.methods and name not in self.methods:
            return continuation(details, request)
        with self.lock:
            r = self.rng.random()
            code = self.rng.choice(TRANSIENT)
        if r < self.p_before:
            with self.lock:
                self.injected_before += 1
            raise _InjectedError(code, "request dropped")
        outcome = continuation(details, request)
        if r < self.p_before + self.p_after:
            outcome.result()  # the server has applied it
            with self.lock:
                self.injected_after += 1
            raise _InjectedError(code, "reply dropped")
        return outcome


def run_retries(clients: int = 4, ops: int = 300, p_before: float = 0.15, p_after: float = 0.15,
                seed: int = 0) -> dict[str, Any]:
    from block_manager_svc.server import start_server
    from block_manager_svc.settings import BlockManagerSettings

    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=1024, block_size=16, log_level="warning"))
    try:
        target = f"127.0.0.1:{running.port}"
        inj = FaultInjector(p_before, p_after, seed, methods=("Allocate", "Append", "Fork", "Free", "Step"))
        models: list[ModelClient] = []

        def work(i: int) -> None:
            with grpc.insecure_channel(target) as ch:
                stub = pb_grpc.BlockManagerStub(grpc.intercept_channel(ch, inj))
                c = ModelClient(stub, f"c{i}", 16, seed * 100 + i, sleep=lambda s: None)
                models.append(c)
                for _ in range(ops):
                    c.step_once()
                c.verify()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stats = stub.GetStats(pb.GetStatsRequest())
            live_blocks = {b for c in models for t in c.tables.values() for b in t}
            naive = _naive_double_apply(stub)
        return {
            "ops": sum(c.acked + c.rejected for c in models),
            "injected_before": inj.injected_before,
            "injected_after": inj.injected_after,
            "dedupe_hits": stats.num_dedupe_hits,
            "problems": sum(len(c.problems) for c in models),
            "problem_samples": [p for c in models for p in c.problems][:5],
            "used_blocks": stats.num_used_blocks,
            "model_blocks": len(live_blocks),
            "sequences": stats.num_sequences,
            "model_sequences": sum(len(c.tables) for c in models),
            "naive_double_applied": naive,
        }
    finally:
        running.stop(0)


def _naive_double_apply(stub: Any) -> int:
    """Contrast: the same 'reply lost, retry' without a request id appends twice."""
    stub.Allocate(pb.AllocateRequest(seq_id="naive", num_tokens=16))
    for _ in range(10):
        stub.Append(pb.AppendRequest(seq_id="naive", num_tokens=16))  # reply "lost"...
        stub.Append(pb.AppendRequest(seq_id="naive", num_tokens=16))  # ...so the client retries
    bt = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="naive"))
    stub.Free(pb.FreeRequest(seq_id="naive"))
    return (bt.num_tokens - 16 - 10 * 16) // 16


# --- leases: clients that vanish ---------------------------------------------------------------
def _vanishing_client(port: int, lease: str, n: int) -> None:
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
    from block_manager_svc.server import start_server
    from block_manager_svc.settings import BlockManagerSettings

    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=256, block_size=16, lease_ttl_s=ttl_s,
                                                lease_sweep_interval_s=sweep_s, log_level="warning"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stub.Allocate(pb.AllocateRequest(seq_id="unleased", num_tokens=40))
            procs = [subprocess.Popen([sys.executable, __file__, "vanish", "--port", str(running.port),
                                       "--lease", f"L{i}", "--n", str(seqs)], cwd=ROOT, stdout=subprocess.PIPE,
                                      text=True) for i in range(clients)]
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
                "ttl_s": ttl_s, "sweep_s": sweep_s,
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


# --- soak: bounded load at a fraction of the measured peak ------------------------------------
def _soak_worker(stub: Any, name: str, stop: threading.Event, rate: float | None, counter: list[int],
                 errors: list[str]) -> None:
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
                stub.Allocate(pb.AllocateRequest(seq_id=s, num_tokens=rng.randint(1, 64), request_id=rid,
                                                 lease_id=f"{name}-lease"), timeout=5)
                live.append(s)
            elif rng.random() < 0.2:
                stub.Free(pb.FreeRequest(seq_id=live.pop(rng.randrange(len(live))), request_id=rid), timeout=5)
            else:
                stub.Append(pb.AppendRequest(seq_id=rng.choice(live), num_tokens=1, request_id=rid), timeout=5)
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


def run_soak(seconds: float = 600.0, fraction: float = 0.75, threads: int = 8, peak_window_s: float = 3.0,
             fsync: str = "batch", samples: int = 10) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="pagedkv-soak-"))
    port = free_port()
    server = ServerProcess(port, ["--state-dir", str(tmp / "state"), "--fsync", fsync, "--num-gpu-blocks",
                                  "4096", "--lease-ttl-s", "30", "--dedupe-max-entries", "20000",
                                  *policy_flags()], tmp / "server.log")
    server.start()
    assert server.proc is not None
    pid = server.proc.pid
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)

            def phase(duration: float, rate: float | None, tag: str,
                      on_sample: Callable[[float], None] | None = None) -> tuple[int, list[str]]:
                stop = threading.Event()
                counters = [[0] for _ in range(threads)]
                errors: list[str] = []
                ts = [threading.Thread(target=_soak_worker, args=(stub, f"{tag}{i}", stop, rate, counters[i], errors))
                      for i in range(threads)]
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
            calls, errors = phase(seconds, target / threads, "soak", lambda t: trace.append((round(t, 1), rss_kib(pid))))
            stats = stub.GetStats(pb.GetStatsRequest())
            rss_end = rss_kib(pid)
            return {
                "seconds": seconds, "peak_calls_s": peak, "target_calls_s": target,
                "achieved_calls_s": calls / seconds, "calls": calls, "errors": len(errors),
                "error_samples": errors[:3],
                "rss_start_kib": rss_start, "rss_end_kib": rss_end, "rss_trace": trace,
                "free_after": stats.num_free_blocks + stats.num_cached_blocks,
                "total_blocks": stats.num_gpu_blocks, "sequences_after": stats.num_sequences,
                "used_after": stats.num_used_blocks,
            }
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # journal, snapshots and log: nothing left in the temp dir


# --- journal cost per op under each fsync policy --------------------------------------------------
def run_fsync_cost(ops: int = 2000, threads: int = 8) -> list[dict[str, Any]]:
    from block_manager_svc.server import start_server
    from block_manager_svc.settings import BlockManagerSettings

    rows = []
    for label, extra in (("memory (no --state-dir)", {}), ("memory + request_id", {"_rid": True}),
                         ("--fsync off", {"fsync": "off"}), ("--fsync batch (5 ms)", {"fsync": "batch"}),
                         ("--fsync always", {"fsync": "always"})):
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
                j = running.servicer.journal
                rows.append({"mode": label, "p50_us_1": lat[len(lat) // 2] * 1e6,
                             "p99_us_1": lat[int(len(lat) * 0.99)] * 1e6,
                             "calls_s_concurrent": (ops // threads) * threads / wall,
                             "fsyncs": j.num_fsyncs if j else 0,
                             "bytes_per_op": (j.bytes_written / max(j.last_seq, 1)) if j else 0})
        finally:
            running.stop(0)
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


# --- recovery time vs journal size -------------------------------------------------------------
def run_recovery(sizes: tuple[int, ...] = (1000, 10000, 50000)) -> list[dict[str, Any]]:
    from block_manager_svc.core import CoreError  # noqa: F401
    from block_manager_svc import snapshot
    from block_manager_svc.journal import Journal
    from block_manager_svc.reliability import ReliableServicer
    from block_manager_svc.server import build_core
    from block_manager_svc.settings import BlockManagerSettings

    rows = []
    for n in sizes:
        tmp = Path(tempfile.mkdtemp(prefix="pagedkv-recovery-"))
        settings = BlockManagerSettings(num_gpu_blocks=65536, block_size=16, state_dir=str(tmp), fsync="off",
                                        snapshot_every_ops=0, snapshot_interval_s=0)
        s = ReliableServicer(build_core(settings))
        s.state_dir = tmp
        s.journal = Journal(tmp, 1, "off")
        ctx = _Ctx()
        rng = random.Random(n)
        live: list[str] = []
        for i in range(n):
            try:
                if len(live) < 256 and (not live or rng.random() < 0.1):
                    live.append(f"s{i}")
                    s.Allocate(pb.AllocateRequest(seq_id=live[-1], num_tokens=rng.randint(16, 1024),
                                                  request_id=f"r{i}"), ctx)
                elif rng.random() < 0.03:
                    s.Free(pb.FreeRequest(seq_id=live.pop(rng.randrange(len(live))), request_id=f"r{i}"), ctx)
                else:
                    r = s.Step(pb.StepRequest(append_seq_ids=live, request_id=f"r{i}"), ctx)
                    gone = {p.seq_id for p in getattr(r, "preempted", ())}
                    live = [x for x in live if x not in gone]
            except RuntimeError:  # pool full (Allocate) or already preempted (Free): refused, not journaled
                live = [x for x in live if x in s._core.seqs]
        size = s.journal.bytes_written
        s.journal.close()
        t0 = time.perf_counter()
        s2 = ReliableServicer(build_core(settings))
        rep = s2.recover(tmp)
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        payload_len = len(snapshot.dumps(s2._state()))  # what snapshot_now does under the lock
        snap_s = time.perf_counter() - t0
        rows.append({"records": n, "journal_mib": size / 2**20, "recovery_s": dt, "replayed": rep.replayed,
                     "us_per_record": dt / n * 1e6, "snapshot_mib": payload_len / 2**20, "snapshot_export_s": snap_s})
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


class _Ctx:
    def time_remaining(self) -> None:
        return None

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


# --- the table -----------------------------------------------------------------------------------
def print_report(res: dict[str, Any]) -> None:
    out = sys.stdout.write
    for c in res.get("crash", []):
        out(f"\n## Crash: SIGKILL under load (--fsync {c['fsync']}, {c['wall_s']:.0f} s)\n\n")
        out("| kills survived | acked ops | calls hit by a kill | verifications | acked ops lost | "
            "final pool (free+cached / total) | restart to SERVING median / max | replay max (records, KiB, ms) |\n")
        out("|---|---|---|---|---|---|---|---|\n")
        out(f"| {c['restarts_ok']}/{c['kills']} | {c['acked_ops']} | {c['calls_hit_by_kill']} | {c['verifications']} | "
            f"{c['lost_or_mismatched']} | {c['final_free']}/{c['total_blocks']} (used {c['final_used']}) | "
            f"{c['restart_s_median']:.2f} / {c['restart_s_max']:.2f} s | "
            f"{c['replay_records_max']}, {c['replay_bytes_max'] / 1024:.0f}, {c['replay_s_max'] * 1000:.1f} |\n")
    if "recovery" in res:
        out("\n## Recovery time vs journal size (65,536 blocks, up to 256 live sequences, in-process)\n\n")
        out("| records | journal MiB | recovery s | µs/record | snapshot MiB | snapshot export ms |\n|---|---|---|---|---|---|\n")
        for r in res["recovery"]:
            out(f"| {r['records']} | {r['journal_mib']:.2f} | {r['recovery_s']:.3f} | {r['us_per_record']:.0f} | "
                f"{r['snapshot_mib']:.2f} | {r['snapshot_export_s'] * 1000:.1f} |\n")
    if "fsync" in res:
        out("\n## Cost per Append under each fsync policy (loopback, sync stub)\n\n")
        out("| mode | p50 µs (1 in flight) | p99 µs | calls/s (8 in flight) | fsyncs | journal bytes/op |\n"
            "|---|---|---|---|---|---|\n")
        for r in res["fsync"]:
            out(f"| {r['mode']} | {r['p50_us_1']:.0f} | {r['p99_us_1']:.0f} | {r['calls_s_concurrent']:.0f} | "
                f"{r['fsyncs']} | {r['bytes_per_op']:.0f} |\n")
    if "retries" in res:
        r = res["retries"]
        out("\n## Retries through injected UNAVAILABLE / DEADLINE_EXCEEDED\n\n")
        out("| ops | dropped before server | dropped after server applied | dedupe hits | model mismatches | "
            "used blocks (server / model) | naive retries without request_id: double appends |\n|---|---|---|---|---|---|---|\n")
        out(f"| {r['ops']} | {r['injected_before']} | {r['injected_after']} | {r['dedupe_hits']} | {r['problems']} | "
            f"{r['used_blocks']} / {r['model_blocks']} | {r['naive_double_applied']} of 10 |\n")
    if "leases" in res:
        r = res["leases"]
        out("\n## Leases: clients SIGKILLed without Free\n\n")
        out("| TTL s | sweep s | sequences alive (renewing) | after | leases expired | sequences freed | "
            "reclaimed after kill s |\n|---|---|---|---|---|---|---|\n")
        out(f"| {r['ttl_s']} | {r['sweep_s']} | {r['sequences_while_alive']} | {r['sequences_after']} | "
            f"{r['leases_expired']} | {r['sequences_expired']} | {r['reclaim_s']:.2f} |\n")
    if "soak" in res:
        r = res["soak"]
        out(f"\n## Soak ({r['seconds']:.0f} s, --fsync batch, request ids + leases)\n\n")
        out("| peak calls/s | target (75%) | achieved | achieved / peak (goal ≥ 70%) | errors | "
            "RSS start → end KiB | pool after free-all |\n|---|---|---|---|---|---|---|\n")
        share = r["achieved_calls_s"] / r["peak_calls_s"] if r["peak_calls_s"] else 0.0
        out(f"| {r['peak_calls_s']:.0f} | {r['target_calls_s']:.0f} | {r['achieved_calls_s']:.0f} | "
            f"{share:.0%} {'ok' if share >= 0.70 else 'MISS'} | {r['errors']} | "
            f"{r['rss_start_kib']} → {r['rss_end_kib']} | {r['free_after']}/{r['total_blocks']} free, "
            f"{r['sequences_after']} seqs |\n")
        out(f"\nRSS trace (s, KiB): {r['rss_trace']}\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    if argv and argv[0] == "vanish":
        p = argparse.ArgumentParser()
        p.add_argument("--port", type=int)
        p.add_argument("--lease")
        p.add_argument("--n", type=int)
        a = p.parse_args(argv[1:])
        _vanishing_client(a.port, a.lease, a.n)
        return 0
    from pagedkv.logging_setup import configure_logging

    configure_logging("warning", "console")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("all", "crash", "retries", "leases", "soak", "fsync-cost", "recovery"))
    p.add_argument("--quick", action="store_true", help="small sizes (seconds per section)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--fsync", default=None, help="crash: one policy (default: all three)")
    p.add_argument("--minutes", type=float, default=10.0, help="soak duration")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    res: dict[str, Any] = {}
    quick = a.quick

    def section(key: str, fn: Callable[[], Any]) -> None:
        res[key] = fn()
        print_report({key: res[key]})  # as soon as it is measured
        sys.stdout.flush()
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))

    if a.what in ("all", "crash"):
        policies = [a.fsync] if a.fsync else ["always", "batch", "off"]
        section("crash", lambda: [run_crash(kills=a.kills, fsync=f) for f in policies])
    if a.what in ("all", "recovery"):
        section("recovery", lambda: run_recovery((500, 2000) if quick else (1000, 10000, 50000)))
    if a.what in ("all", "fsync-cost"):
        section("fsync", lambda: run_fsync_cost(400 if quick else 4000))
    if a.what in ("all", "retries"):
        section("retries", lambda: run_retries(ops=100 if quick else 500))
    if a.what in ("all", "leases"):
        section("leases", run_leases)
    if a.what in ("all", "soak"):
        section("soak", lambda: run_soak(seconds=10 if quick else a.minutes * 60, peak_window_s=2 if quick else 5))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    bad = any(c["lost_or_mismatched"] or c["restarts_ok"] != c["kills"] for c in res.get("crash", []))
    bad |= bool(res.get("retries", {}).get("problems"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
