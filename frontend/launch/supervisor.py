"""`pagedkv up` keeps its services running: a service that exits is restarted, within a budget.

Why a budget: a service that crashes again and again (a bad flag, a port taken, a model that does
not load) must not spin forever and hide the cause; after ``max_restarts_per_minute`` restarts of one
service within a minute the stack gives up and stops, saying which service and its last exit code.

Why a backoff: a service that exits at once after a restart would otherwise be started in a tight
loop; the pause doubles with each recent restart of that service (``initial_backoff_s`` ..
``max_backoff_s``) and is interrupted by Ctrl-C.

Why order falls out by itself: services are checked in start order (block manager, cache host,
workers, frontend), one restart at a time, each waited for until SERVING. A worker that exits after
its cache host died (code 3) is restarted after the cache host is back, and attaches to it; a worker
that stayed up re-attaches to the restarted cache host by itself (worker_svc/reattach.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TextIO

import structlog

log = structlog.get_logger("pagedkv.up")


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    max_restarts_per_minute: int = 5  # per service; 0 = never restart (the stack stops when one exits)
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    window_s: float = 60.0


@dataclass(slots=True)
class RestartBudget:
    """Recent restart times per service, and what the policy allows next."""

    policy: RestartPolicy
    _times: dict[str, deque[float]] = field(default_factory=dict)

    def recent(self, name: str, now: float) -> int:
        times = self._times.setdefault(name, deque())
        while times and now - times[0] >= self.policy.window_s:
            times.popleft()
        return len(times)

    def backoff(self, name: str, now: float) -> float | None:
        """The pause before restarting ``name`` now, or None when its budget is spent."""
        n = self.recent(name, now)
        if n >= self.policy.max_restarts_per_minute:
            return None
        return min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2**n)

    def record(self, name: str, now: float) -> None:
        self._times.setdefault(name, deque()).append(now)


class WatchedProcess(Protocol):
    """One supervised service, as the supervisor sees it: a name and its process (None while down)."""

    @property
    def name(self) -> str: ...

    @property
    def process(self) -> subprocess.Popen[bytes] | None: ...


class Supervised(Protocol):
    """What ``supervise`` drives: the process stack (frontend/launch/processes.py) or any set of
    services that can say which one exited, restart one by name and kill one by name."""

    def first_exited(self) -> WatchedProcess | None: ...

    def restart(self, name: str, stop: threading.Event | None = None) -> object: ...

    def kill(self, name: str) -> None: ...


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def supervise(
    stack: Supervised,
    stop: threading.Event,
    policy: RestartPolicy,
    err: TextIO = sys.stderr,
    poll_s: float = 0.2,
    on_restart: Callable[[str, int | None], None] | None = None,
) -> int:
    """Watch ``stack`` until ``stop`` is set (returns 0) or a service's restart budget is spent
    (returns 1 after saying so on ``err``). The caller stops the stack either way.
    ``on_restart(name, previous exit code)`` runs once a restarted service is SERVING again."""
    budget = RestartBudget(policy)
    while not stop.wait(poll_s):
        svc = stack.first_exited()
        if svc is None:
            continue
        code = svc.process.returncode if svc.process is not None else None
        now = time.monotonic()
        pause = budget.backoff(svc.name, now)
        if pause is None:
            n = budget.recent(svc.name, now)
            log.error(
                "service_gave_up", service=svc.name, exit_code=code, restarts=n, window_s=policy.window_s
            )
            print(
                f"pagedkv up: {svc.name} exited with code {describe_exit(code)} after {n} restarts within "
                f"{policy.window_s:.0f} s (--max-restarts-per-minute {policy.max_restarts_per_minute}); "
                f"giving up: stopping the stack (see its log for why it exits)",
                file=err,
                flush=True,
            )
            return 1
        attempt = budget.recent(svc.name, now) + 1
        log.warning(
            "service_exited",
            service=svc.name,
            exit_code=code,
            restart_in_s=pause,
            attempt=attempt,
            max_per_minute=policy.max_restarts_per_minute,
        )
        print(
            f"pagedkv up: {svc.name} exited with code {describe_exit(code)}; restarting it in {pause:g} s "
            f"(restart {attempt} of at most {policy.max_restarts_per_minute} a minute)",
            file=err,
            flush=True,
        )
        if stop.wait(pause):
            return 0
        budget.record(svc.name, time.monotonic())
        try:
            stack.restart(svc.name, stop=stop)
        except (RuntimeError, TimeoutError) as e:  # exited or hung while starting: counted at the next check
            log.warning("service_restart_failed", service=svc.name, error=str(e))
            stack.kill(svc.name)
            continue
        if stop.is_set():
            return 0
        assert svc.process is not None
        log.info(
            "service_restarted",
            service=svc.name,
            pid=svc.process.pid,
            previous_exit_code=code,
            attempt=attempt,
        )
        print(
            f"pagedkv up: {svc.name} restarted, SERVING again (pid {svc.process.pid})", file=err, flush=True
        )
        if on_restart is not None:
            on_restart(svc.name, code)
    return 0
