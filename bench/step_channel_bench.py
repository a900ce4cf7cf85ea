"""A worker step's round trip over gRPC and over the one-host step channel (shared memory), side by side.

The worker runs in its own process: the real Worker servicer (worker_svc/servicer.py) behind the
real gRPC server (pagedkv/grpc_server.py, the worker's 4 threads) and the real step channel
(worker_svc/step_channel.py), both calling the same ``run_step``. Its model runner is a stand-in
that answers at once (one greedy token per sequence): the figures are what the transport costs a
step, not the forward pass. This process sends the engine's own decode step message
(frontend/engine/output.py ``worker_request``: 512-token contexts in 16-token blocks, greedy
sampling) for 1 and for 32 sequences through ``WorkerClient`` with ``step_transport`` grpc, shm
(the default: no spin) and shm with a 50 us spin on the reply, one call in flight, in
alternating rounds so that a noisy neighbour on a shared host hits every row alike.

End to end (``--e2e``): ``pagedkv up`` with the built-in tiny model and one worker, whose frontend
uses ``--step-transport shm``, and a second ``pagedkv serve`` on the same block manager and worker
with ``--step-transport grpc``; one request at a time (greedy, ``ignore_eos``, streamed), alternating
between the two frontends; per transport the time per output token after the first (TPOT:
(last token - first token) / (tokens - 1)), p50 and mean over the requests.

    python -m bench.step_channel_bench            # about 20 s
    python -m bench.step_channel_bench --quick    # a few seconds
    python -m bench.step_channel_bench --e2e      # about 2 minutes
    python -m bench.step_channel_bench --engine   # about 1 minute

``--engine``: the same stack as processes without a frontend, and two ``Engine``s in this process
(one per transport) on its one worker, one request at a time, alternating: ms per output token after
the first as the engine produces them, the p50 of the engine's worker step calls (its
``WorkerClient.on_call``) and of the same calls less the compute time the worker reports
(``forward_ms`` + ``cache_ops_ms``): what the transport and the servicer cost a step, without HTTP
in between; and the worker process's CPU time per token (all its threads, /proc), the mean over the
requests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine.output import worker_request
from pagedkv.frontend.engine.types import Completion, GenerationRequest, RequestOutput, Seq, SeqBlocks
from pagedkv.v1 import worker_pb2 as wpb

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 512
BLOCK = 16
CACHE_ID = "cafe0123"
ROWS = (("grpc", "grpc", 0.0), ("shm", "shm", 0.0), ("shm, 50us spin", "shm", 50.0))


class _InstantRunner:
    """A model runner that computes nothing: one token per sequence, at once."""

    def step(self, seqs: Any, ops: Any) -> Any:
        from pagedkv.worker_svc.model_runner import SequenceResult, StepResult

        outs = [
            SequenceResult(seq_id=s.seq_id, token_id=(len(s.token_ids) * 31) % 32000, logprob=-0.5)
            for s in seqs
        ]
        return StepResult(
            outputs=outs, num_tokens=sum(len(s.token_ids) for s in seqs), cache_ops_ms=0.0, forward_ms=0.0
        )


def serve() -> None:
    """The worker side (``--serve``): prints ``READY <port> <channel path>``, serves until stdin closes."""
    from pagedkv.grpc_server import start_server
    from pagedkv.v1 import worker_pb2_grpc
    from pagedkv.worker_svc.servicer import SERVICE_NAME, WorkerServicer
    from pagedkv.worker_svc.step_channel import StepChannelServer

    servicer = WorkerServicer(
        _InstantRunner(), wpb.WorkerInfo(model_name="instant", cache_instance_id=CACHE_ID)
    )  # type: ignore[arg-type]
    channel = StepChannelServer(servicer.run_step)
    servicer.info.step_channel = channel.path
    running = start_server(
        "127.0.0.1", 0, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s), SERVICE_NAME
    )
    print(f"READY {running.port} {channel.path}", flush=True)
    sys.stdin.read()
    channel.close()
    running.stop(grace=0.5)


def decode_step(num_seqs: int, step: int) -> wpb.WorkerStepRequest:
    """The engine's decode step for ``num_seqs`` sequences at a 512-token context."""
    batch: list[tuple[Seq, int]] = []
    for i in range(num_seqs):
        prompt = [(7 * i + 13 * t) % 32000 for t in range(CONTEXT)]
        req = GenerationRequest(f"bench-{i}", prompt, max_tokens=256)
        seq = Seq(
            seq_id=f"engine-0123456789ab-{i}-0",
            request=req,
            output=RequestOutput(req.request_id, prompt, [Completion(0)]),
            index=0,
            tokens=[*prompt, 11],
            blocks=SeqBlocks(table=list(range(i * (CONTEXT // BLOCK + 1), (i + 1) * (CONTEXT // BLOCK + 1)))),
            num_computed=CONTEXT,
        )
        batch.append((seq, 1))
    return worker_request(batch, None, f"step-bench-{step}", CACHE_ID, lambda s, k: [])


@dataclass(slots=True)
class Row:
    label: str
    num_seqs: int
    times_ms: list[float] = field(default_factory=list)

    def pct(self, q: float) -> float:
        xs = sorted(self.times_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def e2e(rounds: int, max_tokens: int) -> None:
    """TPOT through ``pagedkv up`` (frontend on shm) and a second frontend on gRPC, alternating."""
    import asyncio
    import dataclasses
    import json
    import tempfile
    import urllib.request

    from bench.serve_bench import Req, one_request
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.processes import Stack
    from pagedkv.ports import free_port

    ports = {"shm": free_port(), "grpc": free_port()}
    opts = StackConfig(
        block_manager_port=free_port(),
        cache_host_port=free_port(),
        worker_port=free_port(),
        num_workers=1,
        device="cpu",
        log_format="json",
        log_dir=tempfile.mkdtemp(prefix="pagedkv-step-e2e-"),
        serve_port=ports["shm"],
        serve_args=("--step-transport", "shm"),
    )
    stack = Stack(opts, out=sys.stderr)
    shm_fe = next(s for s in stack.services if s.name == "frontend")
    args = list(shm_fe.args)
    args[args.index("--port") + 1] = str(ports["grpc"])
    args[args.index("--step-transport") + 1] = "grpc"
    stack.services.append(
        dataclasses.replace(
            shm_fe,
            name="frontend-grpc",
            args=args,
            address=f"{opts.host}:{ports['grpc']}",
            health_url=shm_fe.health_url.replace(str(ports["shm"]), str(ports["grpc"])),
            process=None,
        )
    )
    stack.start()
    try:
        urls = {t: f"http://127.0.0.1:{p}" for t, p in ports.items()}
        with urllib.request.urlopen(urls["shm"] + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        tpot: dict[str, list[float]] = {"grpc": [], "shm": []}
        for r in range(rounds + 1):
            order = ["grpc", "shm"] if r % 2 == 0 else ["shm", "grpc"]
            for t in order:
                prompt = [(5 * r + 3 * i + (t == "shm")) % 200 + 1 for i in range(16)]
                res = asyncio.run(one_request(urls[t], model, Req(prompt, max_tokens), ""))
                if not res.ok:
                    raise SystemExit(f"{t}: {res.error}")
                if r > 0:  # round 0 warms both up
                    tpot[t].append((res.e2e - res.ttft) / (res.output_tokens - 1) * 1e3)
        print(
            "End to end through `pagedkv up` (built-in tiny model, 1 CPU worker; "
            f"{os.cpu_count()} CPUs shared with other jobs): one request at a time, {max_tokens} tokens "
            f"each, {rounds} per transport, alternating"
        )
        print(f"{'transport':<10} {'TPOT p50 ms':>12} {'TPOT mean ms':>13}")
        for t in ("grpc", "shm"):
            print(f"{t:<10} {statistics.median(tpot[t]):>12.2f} {statistics.fmean(tpot[t]):>13.2f}")
    finally:
        stack.stop()


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system, all threads) process ``pid`` has used, in ms (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def engine_rows(rounds: int, max_tokens: int) -> None:
    """ms per token with an Engine per transport on one worker process, alternating (no HTTP)."""
    import io
    import tempfile

    from pagedkv.frontend.clients.block_manager import BlockManagerClient
    from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.processes import Stack
    from pagedkv.ports import free_port

    opts = StackConfig(
        block_manager_port=free_port(),
        cache_host_port=free_port(),
        worker_port=free_port(),
        num_workers=1,
        device="cpu",
        log_dir=tempfile.mkdtemp(prefix="pagedkv-step-engine-"),
    )
    stack = Stack(opts, out=io.StringIO())
    stack.start()
    try:
        bm = BlockManagerClient(stack.services[0].address)
        engines: dict[str, Engine] = {}
        calls: dict[str, list[float]] = {}
        outside: dict[str, list[float]] = {}  # call time less the worker's own compute time

        def observer(t: str) -> Any:
            def seen(dt: float, resp: Any) -> None:
                if isinstance(resp, wpb.WorkerStepResponse):
                    calls[t].append(dt * 1e3)
                    outside[t].append(dt * 1e3 - resp.forward_ms - resp.cache_ops_ms)

            return seen

        for t in ("grpc", "shm"):
            w = WorkerClient(stack.services[2].address, step_transport=t)
            calls[t], outside[t] = [], []
            w.on_call = observer(t)
            engines[t] = Engine(bm, [w], EngineConfig())
            assert w.transport == t, (t, w.transport)
        per: dict[str, list[float]] = {"grpc": [], "shm": []}
        cpu: dict[str, list[float]] = {"grpc": [], "shm": []}  # the worker process's CPU ms per token
        worker = stack.services[2].process
        assert worker is not None
        for r in range(rounds + 1):
            for t in ("grpc", "shm") if r % 2 == 0 else ("shm", "grpc"):
                eng = engines[t]
                out = eng.add_request(
                    GenerationRequest(f"{t}{r}", [5 + r, 7, 9, 11, 13], max_tokens=max_tokens)
                )
                eng.step()  # the prompt and the first token
                n0 = len(out.completions[0].token_ids)
                t0, c0 = time.perf_counter(), _cpu_ms(worker.pid)
                while not out.finished:
                    eng.step()
                n = len(out.completions[0].token_ids) - n0
                if r > 0:  # round 0 warms both up
                    per[t].append((time.perf_counter() - t0) / n * 1e3)
                    cpu[t].append((_cpu_ms(worker.pid) - c0) / n)
        print(
            "Engine in this process on a worker process (built-in tiny model; "
            f"{os.cpu_count()} CPUs shared with other jobs): one request at a time, {max_tokens} tokens "
            f"each, {rounds} per transport, alternating"
        )
        print(
            f"{'transport':<10} {'ms/token p50':>13} {'ms/token mean':>14} {'step call p50 ms':>17} "
            f"{'call - worker compute p50 ms':>29} {'worker CPU ms/token':>20}"
        )
        for t in ("grpc", "shm"):
            print(
                f"{t:<10} {statistics.median(per[t]):>13.2f} {statistics.fmean(per[t]):>14.2f} "
                f"{statistics.median(calls[t]):>17.2f} {statistics.median(outside[t]):>29.2f} "
                f"{statistics.fmean(cpu[t]):>20.2f}"
            )
        for e in engines.values():
            e.close()
        bm.close()
    finally:
        stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=100, help="calls per row per round")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 30 calls")
    ap.add_argument("--e2e", action="store_true", help="end to end through `pagedkv up` instead")
    ap.add_argument("--e2e-requests", type=int, default=20, help="requests per transport (--e2e, --engine)")
    ap.add_argument("--e2e-tokens", type=int, default=64, help="output tokens per request (--e2e, --engine)")
    ap.add_argument("--engine", action="store_true", help="Engines in this process instead (no HTTP)")
    args = ap.parse_args()
    if args.engine:
        engine_rows(args.e2e_requests, args.e2e_tokens)
        return
    if args.serve:
        serve()
        return
    if args.e2e:
        e2e(args.e2e_requests, args.e2e_tokens)
        return
    if args.quick:
        args.rounds, args.calls = 3, 30
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.step_channel_bench", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        port = ""
        for line in proc.stdout:
            if line.startswith("READY "):
                port = line.split()[1]
                break
        if not port:
            raise SystemExit("the worker process did not start")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # its log lines
        target = f"127.0.0.1:{port}"
        clients = {
            label: WorkerClient(target, step_transport=transport, step_spin_us=spin)
            for label, transport, spin in ROWS
        }
        for label, c in clients.items():
            c.get_info(timeout_s=10)
            assert c.transport == dict((r[0], r[1]) for r in ROWS)[label], (label, c.transport)
        rows = {(label, n): Row(label, n) for n in (1, 32) for label, _, _ in ROWS}
        msgs = {n: [decode_step(n, k) for k in range(8)] for n in (1, 32)}
        sizes = {n: len(msgs[n][0].SerializeToString()) for n in (1, 32)}
        for c in clients.values():  # warm-up: connections, segments, code paths
            for n in (1, 32):
                for m in msgs[n]:
                    c.step(m, timeout_s=10)
        for r in range(args.rounds):
            order = list(ROWS) if r % 2 == 0 else list(reversed(ROWS))
            for label, _, _ in order:
                for n in (1, 32):
                    row, client = rows[(label, n)], clients[label]
                    for k in range(args.calls):
                        t0 = time.perf_counter()
                        client.step(msgs[n][k % 8], timeout_s=10)
                        row.times_ms.append((time.perf_counter() - t0) * 1e3)
        cpus = os.cpu_count()
        print(
            "Worker step round trip, one call in flight, worker in its own process with a model that "
            f"computes nothing ({cpus} CPUs, shared with other jobs; {args.rounds} alternating rounds "
            f"x {args.calls} calls)"
        )
        print(f"{'transport':<14} {'seqs':>4} {'request B':>9} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
        for (label, n), row in rows.items():
            print(
                f"{label:<14} {n:>4} {sizes[n]:>9} {row.pct(0.5):>8.3f} {row.pct(0.99):>8.3f} "
                f"{statistics.fmean(row.times_ms):>8.3f}"
            )
        for c in clients.values():
            c.close()
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
