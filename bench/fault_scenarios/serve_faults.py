"""`pagedkv serve` under load through each fault, with every role a real process started the way
docker-compose.yml starts them (block manager with a state dir, cache host, two workers, then
`pagedkv serve`) and `pagedkv up`'s supervisor on a thread, restarting whatever exits one second
later, like `restart: unless-stopped` or a Kubernetes container restart.

For each fault: ``concurrency`` concurrent streamed /v1/completions of ``tokens`` tokens each
(greedy, ignore_eos), the fault ``fault_after_s`` into the run, then

- completed: requests that ended with HTTP 200 and all their tokens;
- identical: of those, how many have exactly the token ids of the fault-free run;
- longest stall: the longest gap between two streamed tokens of one request (what a user sees);
- leaked: blocks (and sequences) the block manager still holds once every request ended;
- later request: one more request after the fault, 200 with the fault-free tokens.

The model is a random tiny Llama (transformers, built locally, no download): the figures are about
recovery, not speed.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.models import tiny_llama
from frontend.clients.block_manager import BlockManagerClient
from frontend.launch.config import StackConfig
from frontend.launch.processes import Stack, wait_serving
from frontend.launch.supervisor import RestartPolicy, supervise
from pagedkv.ports import free_port_block

# The manager without a state dir comes last: restarting it later from the state dir it left would
# bring back sequences (and prefix-cache entries naming KV since overwritten) of an older state.
FAULTS = (
    "none",
    "block manager SIGKILL, restart with its state dir",
    "cache host SIGKILL, restart",
    "one of two workers SIGKILL",
    "block manager SIGKILL, restart without a state dir",
)


@dataclass(slots=True)
class ServeFaultRow:
    fault: str
    requests: int
    completed: int = 0
    identical: int = 0
    longest_stall_s: float = 0.0
    leaked_blocks: int = 0
    leaked_sequences: int = 0
    later_request_ok: bool = False
    restarts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


class Supervision:
    """The product's supervisor (frontend/launch/supervisor.py, what `pagedkv up` runs) on a thread:
    whatever exits is restarted ``delay_s`` later, like `restart: unless-stopped` or a Kubernetes
    container restart, with a budget no scenario reaches."""

    def __init__(self, stack: Stack, delay_s: float = 1.0) -> None:
        self.stack = stack
        self.restarts: list[str] = []
        self.errors: list[str] = []
        self._policy = RestartPolicy(
            max_restarts_per_minute=1000, initial_backoff_s=delay_s, max_backoff_s=delay_s
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        # Each service's process as last started and SERVING (by the stack, then by the supervisor):
        # a process not in here is a restart still in progress.
        self._settled_pids = {s.name: self._pid(s.name) for s in stack.services}
        self._lock = threading.Lock()

    def _pid(self, name: str) -> int | None:
        svc = next(s for s in self.stack.services if s.name == name)
        return svc.process.pid if svc.process is not None else None

    def _run(self) -> None:
        said = io.StringIO()  # the supervisor's lines for people; the restarts come from on_restart

        def restarted(name: str, code: int | None) -> None:
            with self._lock:
                self.restarts.append(f"{name} (exit {code})")
                self._settled_pids[name] = self._pid(name)

        if supervise(self.stack, self._stop, self._policy, err=said, poll_s=0.05, on_restart=restarted):
            self.errors.append(said.getvalue().strip().splitlines()[-1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def settled(self, timeout_s: float = 120.0) -> bool:
        """Every service running again, its restart (if any) reported done, answering its health
        check."""
        deadline = time.monotonic() + timeout_s
        tls = self.stack.security.client_tls()
        while time.monotonic() < deadline:
            services = self.stack.services
            with self._lock:
                known = dict(self._settled_pids)
            if all(
                s.process is not None and s.process.poll() is None and known[s.name] == s.process.pid
                for s in services
            ):
                try:
                    for s in services:
                        assert s.process is not None
                        wait_serving(s.address, s.health_service, deadline, s.process, tls, s.health_url)
                    return True
                except (RuntimeError, TimeoutError):
                    pass  # one exited again, or is still starting: the supervisor is on it
            time.sleep(0.1)
        return False


def stream_completion(port: int, prompt: list[int], tokens: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One streamed completion: status, token ids, the longest gap between two tokens, error."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out: dict[str, Any] = {"status": 0, "token_ids": [], "max_gap_s": 0.0, "error": ""}
    try:
        conn.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = r.read().decode(errors="replace")[:200]
            return out
        last: float | None = None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                out["error"] = str(msg["error"].get("message", msg))[:200]
                break
            ids = [t for c in msg.get("choices", []) for t in c.get("token_ids", [])]
            if ids:
                now = time.monotonic()
                if last is not None:
                    out["max_gap_s"] = max(out["max_gap_s"], now - last)
                last = now
                out["token_ids"].extend(ids)
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        conn.close()
    return out


def _svc(stack: Stack, name: str) -> Any:
    return next(s for s in stack.services if s.name == name)


def _inject(stack: Stack, fault: str) -> None:
    if fault.startswith("block manager"):
        bm = _svc(stack, "block-manager")
        while "without" in fault and "--state-dir" in bm.args:  # the restart policy starts it with none
            i = bm.args.index("--state-dir")
            del bm.args[i : i + 2]
        bm.process.send_signal(signal.SIGKILL)
    elif fault.startswith("cache host"):
        _svc(stack, "cache-host").process.send_signal(signal.SIGKILL)
    elif fault.startswith("one of two workers"):
        _svc(stack, "worker-1").process.send_signal(signal.SIGKILL)


def run_one(
    stack: Stack,
    sup: Supervision,
    fault: str,
    prompts: list[list[int]],
    tokens: int,
    fault_after_s: float,
    reference: list[list[int]] | None,
) -> tuple[ServeFaultRow, list[list[int]]]:
    port = stack.opts.serve_port
    assert port is not None
    row = ServeFaultRow(fault, len(prompts))
    results: list[dict[str, Any]] = [{} for _ in prompts]
    restarts_before = len(sup.restarts)

    def one(i: int) -> None:
        results[i] = stream_completion(port, prompts[i], tokens)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(fault_after_s)
    if fault != "none":
        _inject(stack, fault)
    for t in threads:
        t.join(600)
    row.wall_s = time.monotonic() - t0
    for i, r in enumerate(results):
        ok = r.get("status") == 200 and not r.get("error") and len(r.get("token_ids", [])) == tokens
        row.completed += ok
        row.identical += ok and (reference is None or r["token_ids"] == reference[i])
        row.longest_stall_s = max(row.longest_stall_s, r.get("max_gap_s", 0.0))
        if not ok:
            row.errors.append(f"request {i}: HTTP {r.get('status')} {r.get('error', '')}")
    if not sup.settled():
        row.errors.append("the services did not all come back")
    try:
        with BlockManagerClient(_svc(stack, "block-manager").address) as bm:
            deadline = time.monotonic() + 15
            while True:
                st = bm.get_stats(timeout_s=10)
                if (st.num_sequences, st.num_used_blocks) == (0, 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            row.leaked_blocks, row.leaked_sequences = int(st.num_used_blocks), int(st.num_sequences)
    except Exception as e:  # noqa: BLE001 - reported in the table
        row.leaked_blocks = row.leaked_sequences = -1
        row.errors.append(f"GetStats: {type(e).__name__}")
    later = stream_completion(port, prompts[0], min(tokens, 32))
    row.later_request_ok = (
        later["status"] == 200
        and not later["error"]
        and (reference is None or later["token_ids"] == reference[0][: min(tokens, 32)])
    )
    if not row.later_request_ok:
        row.errors.append(f"later request: HTTP {later['status']} {later['error']}")
    row.restarts = sup.restarts[restarts_before:]
    return row, [r.get("token_ids", []) for r in results]


def run_serve_faults(
    tokens: int = 400,
    concurrency: int = 12,
    fault_after_s: float = 1.0,
    faults: tuple[str, ...] = FAULTS,
    log_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Every fault of FAULTS (the first, "none", gives the reference tokens) on one stack."""
    work = Path(tempfile.mkdtemp(prefix="pagedkv-serve-faults-"))
    model = tiny_llama(work / "tiny")  # the directory name is the served model name
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(8, 48))] for _ in range(concurrency)]
    base = free_port_block(5)
    opts = StackConfig(
        block_manager_port=base,
        cache_host_port=base + 1,
        worker_port=base + 2,
        num_workers=2,
        num_gpu_blocks=max(1024, concurrency * (48 + tokens) // 16 + 64),
        num_cpu_blocks=0,
        block_size=16,
        model=str(model),
        device="cpu",
        dtype="float32",
        log_dir=log_dir or str(work / "logs"),
        serve_port=base + 4,
        shm_prefix=f"pagedkv-sfb-{os.getpid()}",
        ready_timeout_s=180,
        state_dir=str(work / "bm-state"),
    )
    stack = Stack(opts, out=open(os.devnull, "w"))  # noqa: SIM115
    rows: list[dict[str, Any]] = []
    stack.start()
    sup = Supervision(stack)
    sup.start()
    try:
        reference: list[list[int]] | None = None  # the fault-free run's tokens
        for fault in faults:
            row, got = run_one(stack, sup, fault, prompts, tokens, fault_after_s, reference)
            rows.append(asdict(row))
            if fault == "none":
                if row.completed != len(prompts):
                    raise RuntimeError(f"the fault-free run did not complete: {row.errors}")
                reference = got
    finally:
        sup.stop()
        for name in stack.stop():
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
    for r in rows:
        r["supervisor_errors"] = sup.errors
    return rows
