"""`pagedkv up` as a supervisor, with real processes on the built-in tiny model (CPU).

A SIGKILLed role is restarted (the message names it and its exit code) and the stack answers again
with the same greedy tokens: a worker; the cache host (the worker that stayed up re-attaches by
itself, the same process); the block manager (back from the stack's state dir). A role that keeps
exiting spends its restart budget and the stack stops, naming it. The default state dir is a
temporary one removed at stop; `--state-dir DIR` is used and kept.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pagedkv import cpu_runtime
from pagedkv.ports import free_ports
from pagedkv.step_channel import DIR_PREFIX, base_dir
from tests.frontend.launch.test_cli_stack import ENV, pid_alive
from tests.frontend.up_process import ROOT, UpProcess

PROMPT = "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3"


class Up(UpProcess):
    """One `pagedkv up` (no frontend) on the tiny model, and what these tests ask of it."""

    def __init__(self, tmp: pathlib.Path, *extra: str, num_workers: int = 1) -> None:
        self.bm, self.ch, self.w = free_ports(3)
        self.log_dir = tmp / "logs"
        env = {**ENV, "PAGEDKV_CACHE_HOST_CHECK_INTERVAL_S": "0.2", "PAGEDKV_LOG_LEVEL": "info"}
        args = ["--block-manager-port", str(self.bm), "--cache-host-port", str(self.ch)]
        args += ["--worker-port", str(self.w), "--num-workers", str(num_workers)]
        args += ["--num-gpu-blocks", "64", "--block-size", "4", "--no-serve", "--device", "cpu"]
        super().__init__([*args, "--log-dir", str(self.log_dir), *extra], tmp, env)
        try:
            self.ready = self.wait_ready(90)
        except BaseException:
            self.stop(30)
            raise

    def pid(self, name: str) -> int:
        """The role's current pid: the ready file's, or the last "restarted" line's naming it."""
        pattern = re.compile(rf"{name} restarted.*\(pid (\d+)\)")
        with self._cv:
            pids = [int(m.group(1)) for line in self.lines if (m := pattern.search(line))]
        return pids[-1] if pids else self.ready.service(name).pid

    def generate(self) -> dict:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedkv.cli",
                "generate",
                "--token-ids",
                PROMPT,
                "--max-tokens",
                "6",
                "--block-manager",
                f"127.0.0.1:{self.bm}",
                "--workers",
                f"127.0.0.1:{self.w}",
            ],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    made: list[Up] = []
    yield made
    for u in made:  # after a failure: a clean stop first (it removes the temporary state dir)
        u.stop(30)


def _kill(up: Up, name: str) -> tuple[int, int]:
    """SIGKILL `name`; wait for `up` to say it restarted it; (old pid, new pid)."""
    old = up.pid(name)
    mark = len(up.lines)
    os.kill(old, signal.SIGKILL)
    up.wait_for(rf"{name} exited with code -9 \(SIGKILL\); restarting it", start=mark)
    up.wait_for(rf"{name} restarted, SERVING again", start=mark)
    new = up.pid(name)
    assert new != old and not pid_alive(old)
    return old, new


def test_up_restarts_killed_roles_and_answers_again(tmp_path: pathlib.Path, ups: list[Up]) -> None:
    up = Up(tmp_path)
    ups.append(up)
    up.wait_for(r"block manager state in \S+ \(temporary")
    state = pathlib.Path(up.ready.state_dir)
    assert state.is_dir()
    first = up.generate()
    before = first["completions"][0]["token_ids"]
    assert len(before) == 6 and first["num_cached_tokens"] == 0

    killed = up.pid("worker-0")
    channel_dirs = f"{DIR_PREFIX}{os.getuid()}-{killed}-*"
    assert list(pathlib.Path(base_dir()).glob(channel_dirs))  # the worker offers the step channel
    # Intel's OpenMP runtime (preloaded into CPU workers where installed) registers each process in
    # /dev/shm and removes the file only at a clean exit.
    omp_file = pathlib.Path("/dev/shm") / f"__KMP_REGISTERED_LIB_{killed}_{os.getuid()}"
    omp_registered = omp_file.exists()
    assert omp_registered or cpu_runtime.intel_openmp() is None
    _kill(up, "worker-0")
    assert up.generate()["completions"][0]["token_ids"] == before
    # The restarted worker swept the killed one's step-channel directory (its segments died with it),
    # and `up` removed the runtime's file the killed worker left.
    assert not list(pathlib.Path(base_dir()).glob(channel_dirs))
    assert not omp_file.exists()

    worker = up.pid("worker-0")
    _kill(up, "cache-host")
    # The worker stayed up and re-attached to the new cache host by itself: same process.
    deadline = time.monotonic() + 20
    while "cache_host_reattached" not in (up.log_dir / "worker-0.log").read_text():
        assert time.monotonic() < deadline, (up.log_dir / "worker-0.log").read_text()[-3000:]
        time.sleep(0.2)
    assert up.pid("worker-0") == worker and pid_alive(worker)
    # The dead host's blocks left the prefix cache (the new cache host reset it): no hits on empty memory.
    again = up.generate()
    assert again["completions"][0]["token_ids"] == before and again["num_cached_tokens"] == 0

    _kill(up, "block-manager")
    assert any(state.iterdir())  # the restarted manager journals there
    restored = up.generate()
    assert restored["completions"][0]["token_ids"] == before
    assert restored["num_cached_tokens"] > 0  # it came back with its prefix cache, from the state dir

    out = up.stop()
    assert up.p.returncode == 0, out
    assert "nothing left running, no shared memory left behind" in out
    assert not state.exists()  # the temporary state dir goes at a clean stop


def test_restart_budget_spent_stops_the_stack_naming_the_role(tmp_path: pathlib.Path, ups: list[Up]) -> None:
    kept = tmp_path / "state"
    up = Up(tmp_path, "--max-restarts-per-minute", "1", "--state-dir", str(kept))
    ups.append(up)
    up.wait_for(rf"block manager state in {re.escape(str(kept))} \(kept\)")
    assert up.ready.state_dir == str(kept)
    pids = [up.pid(n) for n in ("block-manager", "cache-host", "worker-0")]
    _kill(up, "worker-0")
    mark = len(up.lines)
    os.kill(up.pid("worker-0"), signal.SIGKILL)
    up.wait_for(
        r"worker-0 exited with code -9 \(SIGKILL\) after 1 restarts within 60 s "
        r"\(--max-restarts-per-minute 1\); giving up: stopping the stack",
        start=mark,
    )
    out = up.stop()
    assert up.p.returncode == 1, out
    # The structlog lines too: each restart with its exit code, then giving up.
    assert re.search(r"event='service_exited'.*service='worker-0'.*exit_code=-9", out), out
    assert re.search(r"event='service_gave_up'.*service='worker-0'", out), out
    assert not any(pid_alive(p) for p in pids)
    assert kept.is_dir() and any(kept.iterdir())  # --state-dir is the manager's, and kept


def test_restart_budget_backs_off_and_forgets_after_a_minute() -> None:
    from pagedkv.frontend.launch.supervisor import RestartBudget, RestartPolicy, describe_exit

    budget = RestartBudget(RestartPolicy(max_restarts_per_minute=3, initial_backoff_s=0.5, max_backoff_s=1.5))
    pauses = []
    for t in (0.0, 1.0, 2.0):
        pauses.append(budget.backoff("worker-0", t))
        budget.record("worker-0", t)
    assert pauses == [0.5, 1.0, 1.5]  # doubling, capped
    assert budget.backoff("worker-0", 3.0) is None  # spent: the stack gives up
    assert budget.backoff("cache-host", 3.0) == 0.5  # per service
    assert budget.backoff("worker-0", 60.5) == 1.5  # the restart at t=0 left the window: 2 recent
    assert budget.backoff("worker-0", 61.5) == 1.0  # and the one at t=1
    assert RestartBudget(RestartPolicy(max_restarts_per_minute=0)).backoff("x", 0.0) is None  # never restart
    assert describe_exit(-9) == "-9 (SIGKILL)" and describe_exit(3) == "3"


def test_plan_gives_the_block_manager_the_state_dir(tmp_path: pathlib.Path) -> None:
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.processes import Stack, plan

    bm = plan(StackConfig(), state_dir="/var/x")[0]
    assert bm.name == "block-manager" and bm.args[bm.args.index("--state-dir") + 1] == "/var/x"
    assert "--state-dir" not in plan(StackConfig())[0].args
    # One host: the journal is written to the OS, not fsynced per mutation, unless asked.
    assert bm.args[bm.args.index("--fsync") + 1] == "off"
    durable = plan(StackConfig(fsync="always"), state_dir="/var/x")[0]
    assert durable.args[durable.args.index("--fsync") + 1] == "always"
    kept = tmp_path / "a" / "b"
    s = Stack(StackConfig(state_dir=str(kept)), out=open(os.devnull, "w"))  # noqa: SIM115
    assert kept.is_dir() and not s.state_dir_is_temporary  # created
    s.stop()
    assert kept.is_dir()  # kept
    s = Stack(StackConfig(), out=open(os.devnull, "w"))  # noqa: SIM115
    temp = s.state_dir
    assert temp.is_dir() and s.state_dir_is_temporary and temp.name.startswith("pagedkv-up-state-")
    s.stop()
    assert not temp.exists()


@dataclass(slots=True)
class _FakeService:
    name: str
    process: subprocess.Popen[bytes] | None


class _FakeStack:
    """One service whose process exits once; a restart starts a process that stays up."""

    def __init__(self) -> None:
        self.svc = _FakeService("svc", subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
        self.svc.process.wait()  # type: ignore[union-attr]

    def first_exited(self) -> _FakeService | None:
        p = self.svc.process
        return self.svc if p is not None and p.poll() is not None else None

    def restart(self, name: str, stop: threading.Event | None = None) -> object:
        self.svc.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        return self.svc

    def kill(self, name: str) -> None:
        raise AssertionError("a restart that works kills nothing")


def test_supervise_reports_each_restart_once_the_service_is_back() -> None:
    from pagedkv.frontend.launch.supervisor import RestartPolicy, supervise

    stack, stop = _FakeStack(), threading.Event()
    seen: list[tuple[str, int | None]] = []

    def restarted(name: str, code: int | None) -> None:
        seen.append((name, code))
        stop.set()

    policy = RestartPolicy(initial_backoff_s=0.01)
    try:
        assert supervise(stack, stop, policy, err=io.StringIO(), poll_s=0.01, on_restart=restarted) == 0
        assert seen == [("svc", 3)] and stack.svc.process is not None and stack.svc.process.poll() is None
    finally:
        if stack.svc.process is not None:
            stack.svc.process.kill()
            stack.svc.process.wait()


def test_every_role_stops_when_up_itself_is_killed(tmp_path: pathlib.Path) -> None:
    """SIGKILL to `up` (nothing of it runs to stop the stack): each role sees its launcher gone
    (pagedkv/parent_watch.py) and stops as on SIGTERM, the HTTP front door included, and the cache
    host's shared memory goes with it."""
    bm, ch, w, http = free_ports(4)
    up = UpProcess(
        ["--block-manager-port", str(bm), "--cache-host-port", str(ch), "--worker-port", str(w),
         "--serve-port", str(http), "--num-workers", "1", "--num-gpu-blocks", "64", "--device", "cpu",
         "--log-dir", str(tmp_path / "logs")],
        tmp_path,
        ENV,
    )  # fmt: skip
    try:
        ready = up.wait_ready(120)
        prefix = f"pagedkv-up-{up.p.pid}"  # StackConfig.shm_prefix's default
        pids = {s.name: s.pid for s in ready.services}
        assert {"block-manager", "cache-host", "worker-0"} <= set(pids) and len(pids) >= 4, pids
        assert any(p.name.startswith(prefix) for p in pathlib.Path("/dev/shm").iterdir())
        up.p.send_signal(signal.SIGKILL)
        up.p.wait()
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [n for n, p in pids.items() if pid_alive(p)], "roles outlived `up`"
        assert not [p.name for p in pathlib.Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
    finally:
        for p in (pids if "pids" in locals() else {}).values():
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        up.stop(10)
