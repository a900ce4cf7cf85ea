"""`pagedkv serve` under load through each fault, with every role a real process: the stack
`pagedkv up --model DIR` plans for this machine (block manager with a state dir, cache host, the
planned workers, then `pagedkv serve`) and `pagedkv up`'s supervisor on a thread, restarting
whatever exits one second later, like `restart: unless-stopped` or a Kubernetes container restart.

For each fault: ``concurrency`` concurrent streamed /v1/completions of ``tokens`` tokens each
(greedy, ignore_eos), the fault ``fault_after_s`` into the run (or once every stream is a quarter
through, if that comes first), then

- completed: requests that ended with HTTP 200 and all their tokens;
- identical: of those, how many have exactly the token ids of the fault-free run;
- longest stall: the longest gap between two streamed tokens of one request (what a user sees);
- leaked: blocks (and sequences) the block manager still holds once every request ended;
- later request: one more request after the fault, 200 with the fault-free tokens.

Faults: SIGKILL of a role (the supervisor restarts it), and the gray ones: SIGSTOP of a role for
``pause_s`` then SIGCONT (a long VM pause, a swap storm), the frontend's block-manager link
black-holed for ``blackhole_s`` (bench/fault_scenarios/link_proxy.py sits on that link for every
run), and the block manager's journal disk full (ENOSPC) for ``enospc_s`` (its state dir is on a
small tmpfs; only as root, the row is left out otherwise). ``run_chaos``: random faults of every
kind, dead and gray, every few seconds while ``concurrency`` clients send requests in waves.

The model is a random tiny Llama (transformers, built locally, no download): the figures are about
recovery, not speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.client
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.fault_scenarios.link_proxy import LinkProxy
from bench.models import tiny_llama
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.launch.processes import Stack, up_config, wait_serving
from pagedkv.frontend.launch.supervisor import RestartPolicy, supervise
from pagedkv.ports import free_port_block

PAUSE_S = 8.0
BLACKHOLE_S = 10.0
ENOSPC_S = 5.0
STATE_TMPFS = "16m"  # the block manager's state dir when the journal-full row runs


def fault_names(
    pause_s: float = PAUSE_S, blackhole_s: float = BLACKHOLE_S, enospc_s: float = ENOSPC_S
) -> tuple[str, ...]:
    """The rows, in order. The manager without a state dir comes last: restarting it later from the
    state dir it left would bring back sequences (and prefix-cache entries naming KV since
    overwritten) of an older state."""
    return (
        "none",
        "block manager SIGKILL, restart with its state dir",
        "cache host SIGKILL, restart",
        "a worker SIGKILL",
        f"block manager SIGSTOP {pause_s:g} s",
        f"cache host SIGSTOP {pause_s:g} s",
        f"a worker SIGSTOP {pause_s:g} s",
        f"block-manager link black-holed {blackhole_s:g} s",
        f"block manager journal ENOSPC {enospc_s:g} s",
        "block manager SIGKILL, restart without a state dir",
    )


FAULTS = fault_names()


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
    in_flight_at_fault: int = 0  # requests not finished when the fault was injected


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


def stream_completion(
    port: int,
    prompt: list[int],
    tokens: int,
    timeout_s: float = 300.0,
    on_tokens: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One streamed completion: status, token ids, the longest gap between two tokens, error.
    ``on_tokens(n)``: called with the count received so far, after each chunk."""
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
                if on_tokens is not None:
                    on_tokens(len(out["token_ids"]))
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        conn.close()
    return out


def _svc(stack: Stack, name: str) -> Any:
    return next(s for s in stack.services if s.name == name)


class StateDisk:
    """The block manager's state dir on a small tmpfs of its own (mounting needs root), filled up
    (ENOSPC) on demand by a filler file, and freed by deleting it."""

    def __init__(self, root: Path) -> None:
        self.mount = root / "state-tmpfs"
        self.mount.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={STATE_TMPFS}", "tmpfs", str(self.mount)], check=True
        )
        self.state_dir = self.mount / "bm-state"

    @staticmethod
    def possible() -> bool:
        return os.geteuid() == 0 and shutil.which("mount") is not None

    def fill(self) -> None:
        with open(self.mount / "filler", "wb", buffering=0) as f:
            for chunk in (1 << 20, 65536, 4096):
                with contextlib.suppress(OSError):
                    while f.write(b"\0" * chunk):
                        pass

    def free(self) -> None:
        (self.mount / "filler").unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], check=False)


@dataclass(slots=True)
class Faults:
    """How to inject each kind of fault into one stack; gray ones undo themselves after their time."""

    stack: Stack
    proxy: LinkProxy
    disk: StateDisk | None
    pause_s: float = PAUSE_S
    blackhole_s: float = BLACKHOLE_S
    enospc_s: float = ENOSPC_S

    def _later(self, seconds: float, undo: Callable[[], None]) -> None:
        t = threading.Timer(seconds, undo)
        t.daemon = True
        t.start()

    def kill(self, name: str) -> None:
        self.stack_process(name).send_signal(signal.SIGKILL)

    def pause(self, name: str) -> None:
        proc = self.stack_process(name)
        proc.send_signal(signal.SIGSTOP)
        self._later(self.pause_s, lambda: proc.send_signal(signal.SIGCONT))

    def blackhole(self) -> None:
        self.proxy.blackhole()
        self._later(self.blackhole_s, self.proxy.heal)

    def journal_full(self) -> None:
        assert self.disk is not None
        self.disk.fill()
        self._later(self.enospc_s, self.disk.free)

    def stack_process(self, name: str) -> Any:
        return _svc(self.stack, name).process

    def inject(self, fault: str) -> None:
        """The fault a row of fault_names() names."""
        if "SIGSTOP" in fault:
            self.pause(_role(fault))
        elif "black-holed" in fault:
            self.blackhole()
        elif "ENOSPC" in fault:
            self.journal_full()
        elif "SIGKILL" in fault:
            if "without a state dir" in fault:  # the restart policy starts it with none
                bm = _svc(self.stack, "block-manager")
                while "--state-dir" in bm.args:
                    i = bm.args.index("--state-dir")
                    del bm.args[i : i + 2]
            self.kill(_role(fault))

    def kinds(self) -> dict[str, tuple[float, Callable[[], None]]]:
        """Every fault chaos draws from, in a fixed order: what -> (seconds it lasts, inject it)."""
        kinds: dict[str, tuple[float, Callable[[], None]]] = {}
        for name in ("block-manager", "cache-host", *_workers(self.stack)):
            kinds[f"{name} SIGKILL"] = (0.0, functools.partial(self.kill, name))
            kinds[f"{name} SIGSTOP {self.pause_s:g} s"] = (self.pause_s, functools.partial(self.pause, name))
        kinds[f"block-manager link black-holed {self.blackhole_s:g} s"] = (self.blackhole_s, self.blackhole)
        if self.disk is not None:
            kinds[f"journal ENOSPC {self.enospc_s:g} s"] = (self.enospc_s, self.journal_full)
        return kinds


@dataclass(slots=True, frozen=True)
class PlannedFault:
    """One fault of a chaos schedule: when (seconds into the run, if every fault took no time to
    inject), the wait before it, and what."""

    at_s: float
    wait_s: float
    what: str


def chaos_schedule(
    seed: int, lasts: dict[str, float], seconds: float, every_s: tuple[float, float]
) -> list[PlannedFault]:
    """The faults a chaos run injects, drawn from ``random.Random(seed)`` before it starts, so that
    the same seed (and the same kinds: the journal fault exists only as root) injects the same
    faults after the same waits: a wait of ``every_s`` after the previous fault ended, then a fault
    of any kind, until ``seconds``."""
    rng = random.Random(seed)
    names = list(lasts)
    plan: list[PlannedFault] = []
    t = 0.0
    while True:
        wait = rng.uniform(*every_s)
        t += wait
        if t >= seconds:
            return plan
        what = rng.choice(names)
        plan.append(PlannedFault(round(t, 2), round(wait, 2), what))
        t += lasts[what]


def describe_schedule(seed: int, plan: list[PlannedFault]) -> str:
    return f"chaos schedule (--seed {seed}): " + (
        "; ".join(f"{f.at_s:.1f} s {f.what}" for f in plan) or "no fault"
    )


def _role(fault: str) -> str:
    if fault.startswith("block manager"):
        return "block-manager"
    if fault.startswith("cache host"):
        return "cache-host"
    return "worker-0"  # the first worker: the only one on a plan of one, a busy one on a plan of several


def _workers(stack: Stack) -> list[str]:
    return [s.name for s in stack.services if s.name.startswith("worker-")]


def run_one(
    stack: Stack,
    sup: Supervision,
    fault: str,
    prompts: list[list[int]],
    tokens: int,
    fault_after_s: float,
    reference: list[list[int]] | None,
    faults: Faults | None = None,
) -> tuple[ServeFaultRow, list[list[int]]]:
    port = stack.opts.serve_port
    assert port is not None
    row = ServeFaultRow(fault, len(prompts))
    results: list[dict[str, Any]] = [{} for _ in prompts]
    restarts_before = len(sup.restarts)
    received = [0] * len(prompts)

    def one(i: int) -> None:
        results[i] = stream_completion(
            port, prompts[i], tokens, on_tokens=functools.partial(received.__setitem__, i)
        )

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # The fault hits fault_after_s into the run, or as soon as every stream is a quarter through,
    # whichever comes first: mid-generation however fast the stack decodes (several tokens an
    # iteration with multi-step decode).
    deadline = t0 + fault_after_s
    while time.monotonic() < deadline and min(received) < max(1, tokens // 4):
        time.sleep(0.002)
    row.in_flight_at_fault = sum(t.is_alive() for t in threads)
    if fault != "none":
        assert faults is not None
        faults.inject(fault)
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
    row.leaked_blocks, row.leaked_sequences = _leaked(stack, row.errors)
    row.later_request_ok = _later_request(port, prompts[0], tokens, reference, row.errors)
    row.restarts = sup.restarts[restarts_before:]
    return row, [r.get("token_ids", []) for r in results]


def _leaked(stack: Stack, errors: list[str]) -> tuple[int, int]:
    """(blocks, sequences) the block manager still holds once every request ended."""
    last = ""
    with BlockManagerClient(_svc(stack, "block-manager").address) as bm:
        deadline = time.monotonic() + 30  # a paused manager answers again within its pause
        while time.monotonic() < deadline:
            try:
                st = bm.get_stats(timeout_s=5)
            except Exception as e:  # noqa: BLE001 - reported in the table
                last = f"{type(e).__name__}: {e}"[:200]
                time.sleep(0.2)
                continue
            if (st.num_sequences, st.num_used_blocks) == (0, 0) or time.monotonic() > deadline - 15:
                return int(st.num_used_blocks), int(st.num_sequences)
            time.sleep(0.1)
    errors.append(f"GetStats: {last}")
    return -1, -1


def _later_request(
    port: int, prompt: list[int], tokens: int, reference: list[list[int]] | None, errors: list[str]
) -> bool:
    later = stream_completion(port, prompt, min(tokens, 32))
    ok = (
        later["status"] == 200
        and not later["error"]
        and (reference is None or later["token_ids"] == reference[0][: min(tokens, 32)])
    )
    if not ok:
        errors.append(f"later request: HTTP {later['status']} {later['error']}")
    return bool(ok)


@dataclass(slots=True)
class ChaosRow:
    seconds: float
    requests: int = 0
    completed: int = 0
    identical: int = 0
    longest_stall_s: float = 0.0
    leaked_blocks: int = 0
    leaked_sequences: int = 0
    later_request_ok: bool = False
    faults: list[str] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seed: int = 0
    schedule: str = ""  # the planned faults (describe_schedule), printed before the run
    fenced_steps: int = 0  # worker steps the engine gave up on and fenced (frontend log: step_fenced)
    fences_released: int = 0  # of them, released (fence_released): the worker ran none of them any more


@contextlib.contextmanager
def serving_stack(
    tokens: int,
    concurrency: int,
    log_dir: str | None,
    worker_args: tuple[str, ...],
    journal_disk: bool,
    pause_s: float,
    blackhole_s: float,
    enospc_s: float,
) -> Any:
    """Every role as a process, a supervisor, a link proxy between `pagedkv serve` and the block
    manager, and (``journal_disk``, as root) the manager's state dir on a tmpfs of its own:
    yields (stack, supervisor, faults, prompts)."""
    work = Path(tempfile.mkdtemp(prefix="pagedkv-serve-faults-"))
    model = tiny_llama(work / "tiny")  # the directory name is the served model name
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(8, 48))] for _ in range(concurrency)]
    disk = StateDisk(work) if journal_disk and StateDisk.possible() else None
    base = free_port_block(5)
    # The stack `pagedkv up --model DIR` plans for this machine (workers, cores, threads, KV bytes),
    # so the faults hit the default a user runs, whatever number of workers it chose; only ports,
    # logs, the state dir and no swap pool (recompute is what the rows check) are set here.
    state_dir = disk.state_dir if disk is not None else work / "bm-state"
    opts = up_config(
        [
            "--model", str(model), "--num-cpu-blocks", "0",
            "--block-manager-port", str(base), "--cache-host-port", str(base + 1),
            "--worker-port", str(base + 2), "--serve-port", str(base + 4),
            "--log-dir", log_dir or str(work / "logs"), "--state-dir", str(state_dir),
            "--ready-timeout-s", "180",
        ]
    )  # fmt: skip
    opts = dataclasses.replace(opts, shm_prefix=f"pagedkv-sfb-{os.getpid()}", worker_args=worker_args)
    stack = Stack(opts, out=open(os.devnull, "w"))  # noqa: SIM115
    bm = _svc(stack, "block-manager")
    proxy = LinkProxy(bm.address).start()
    frontend = _svc(stack, "frontend")
    frontend.args[frontend.args.index("--block-manager") + 1] = proxy.address  # serve -> proxy -> manager
    sup: Supervision | None = None
    try:
        stack.start()
        sup = Supervision(stack)
        sup.start()
        yield stack, sup, Faults(stack, proxy, disk, pause_s, blackhole_s, enospc_s), prompts
    finally:
        if sup is not None:
            sup.stop()
        for name in stack.stop():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        proxy.close()
        if disk is not None:
            disk.close()
        shutil.rmtree(work, ignore_errors=True)


def run_serve_faults(
    tokens: int = 400,
    concurrency: int = 12,
    fault_after_s: float = 1.0,
    faults: tuple[str, ...] | None = None,
    log_dir: str | None = None,
    pause_s: float = PAUSE_S,
    blackhole_s: float = BLACKHOLE_S,
    enospc_s: float = ENOSPC_S,
    worker_args: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Every fault of ``faults`` (default: all of fault_names(); the first, "none", gives the
    reference tokens) on one stack. The journal-full row is left out when this process may not mount
    a tmpfs."""
    names = faults or fault_names(pause_s, blackhole_s, enospc_s)
    rows: list[dict[str, Any]] = []
    wants_disk = any("ENOSPC" in f for f in names)
    with serving_stack(
        tokens, concurrency, log_dir, worker_args, wants_disk, pause_s, blackhole_s, enospc_s
    ) as (stack, sup, inject, prompts):
        if inject.disk is None:
            names = tuple(f for f in names if "ENOSPC" not in f)
        reference: list[list[int]] | None = None  # the fault-free run's tokens
        for fault in names:
            row, got = run_one(stack, sup, fault, prompts, tokens, fault_after_s, reference, inject)
            rows.append(asdict(row))
            if fault == "none":
                if row.completed != len(prompts):
                    raise RuntimeError(f"the fault-free run did not complete: {row.errors}")
                reference = got
    for r in rows:
        r["supervisor_errors"] = sup.errors
    return rows


def run_chaos(
    seconds: float = 60.0,
    tokens: int = 64,
    concurrency: int = 12,
    every_s: tuple[float, float] = (3.0, 6.0),
    pause_s: float = PAUSE_S,
    blackhole_s: float = BLACKHOLE_S,
    enospc_s: float = ENOSPC_S,
    seed: int = 0,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """Random faults of every kind (SIGKILL and SIGSTOP of each role, the black-holed link, a full
    journal disk as root) every ``every_s`` seconds (after the last one ended) for ``seconds``, while
    ``concurrency`` clients each send request after request (``tokens`` tokens). Every request must
    finish with its fault-free tokens. The faults and the waits between them come from
    ``chaos_schedule(seed, ...)``, drawn and printed before the clients start: a run is repeated
    with the same ``seed``."""
    row = ChaosRow(seconds, seed=seed)
    with serving_stack(tokens, concurrency, log_dir, (), True, pause_s, blackhole_s, enospc_s) as (
        stack,
        sup,
        inject,
        prompts,
    ):
        port = stack.opts.serve_port
        assert port is not None
        reference = [stream_completion(port, p, tokens)["token_ids"] for p in prompts]
        if any(len(r) != tokens for r in reference):
            raise RuntimeError("the fault-free requests did not complete")
        stop = threading.Event()
        lock = threading.Lock()

        def client(i: int) -> None:
            while not stop.is_set():
                r = stream_completion(port, prompts[i], tokens)
                ok = r["status"] == 200 and not r["error"] and len(r["token_ids"]) == tokens
                with lock:
                    row.requests += 1
                    row.completed += ok
                    row.identical += ok and r["token_ids"] == reference[i]
                    row.longest_stall_s = max(row.longest_stall_s, r["max_gap_s"])
                    if not ok or r["token_ids"] != reference[i]:
                        row.errors.append(f"client {i}: HTTP {r['status']} {r['error'] or 'other tokens'}")

        kinds = inject.kinds()
        plan = chaos_schedule(seed, {k: v[0] for k, v in kinds.items()}, seconds, every_s)
        row.schedule = describe_schedule(seed, plan)
        sys.stdout.write(row.schedule + "\n")
        sys.stdout.flush()
        restarts_before = len(sup.restarts)
        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
        for t in clients:
            t.start()
        t0 = time.monotonic()
        for fault in plan:
            time.sleep(fault.wait_s)
            if time.monotonic() - t0 >= seconds:
                break
            lasts, act = kinds[fault.what]
            act()
            row.faults.append(f"{time.monotonic() - t0:.0f}s {fault.what}")
            time.sleep(lasts)
        stop.set()
        for t in clients:
            t.join(600)
        if not sup.settled():
            row.errors.append("the services did not all come back")
        row.leaked_blocks, row.leaked_sequences = _leaked(stack, row.errors)
        row.later_request_ok = _later_request(port, prompts[0], tokens, reference, row.errors)
        row.restarts = sup.restarts[restarts_before:]
        row.fenced_steps, row.fences_released = _fence_events(stack)
    return asdict(row)


def _fence_events(stack: Stack) -> tuple[int, int]:
    """(step_fenced, fence_released) events in `pagedkv serve`'s log (frontend/engine/fencing.py)."""
    log = Path(stack.opts.log_dir or ".") / "frontend.log"
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return -1, -1
    lines = text.splitlines()
    fenced = sum(1 for line in lines if "step_fenced" in line)
    # One fence_released line names every step it released (request ids are "step-<engine>-<n>").
    released = sum(line.count("'step-") + line.count('"step-') for line in lines if "fence_released" in line)
    return fenced, released
