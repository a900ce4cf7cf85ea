"""Fencing: a worker that did not answer a step may still run it, so the step's blocks wait.

Why. A worker that stops answering (paused by SIGSTOP, a long VM pause, a silent link) is benched
and its step runs on another worker (frontend/engine/dispatch.py). The paused process still holds
that step (running, or its request waiting in a socket buffer), and when it resumes it writes the
step's KV into the shared cache. Rewriting a sequence's own KV with the same values is harmless;
writing into blocks that were freed during the pause and handed to another sequence corrupts that
sequence. A process can be stopped between any check and its write, so the worker cannot be
trusted to stop itself; instead the engine keeps the blocks: a sequence of an unanswered step
is not freed (its Free waits) until the worker is known to have no such step in flight:

- it answers ``Fence(request_ids)`` (the probe thread asks every ``probe_interval_s``) listing
  none of them as running; from then on it refuses to start them (worker_svc/step_fence.py), so
  the answer stays true; a new process at that address knows none of them and answers the same;
- or nothing listens at its address any more (a refused TCP connection): a paused process keeps
  its listening socket (the kernel accepts connections for it), so the process that held the step
  is gone.

Written by the dispatch threads (``note``) and the probe thread (``check``); the engine thread
reads ``held`` before each block-manager Step. docs/reliability.md, "Fencing a paused worker's late
writes", says what this covers and what not.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import structlog

from pagedkv.frontend.clients.worker import WorkerClient

log = structlog.get_logger("pagedkv.dispatch")


@dataclass(slots=True, frozen=True)
class FencedStep:
    """A step a worker did not answer: its request id and the sequences whose blocks it may write."""

    request_id: str
    seq_ids: tuple[str, ...]
    since: float  # monotonic time it was fenced


def nothing_listens(target: str, timeout_s: float) -> bool:
    """True when a TCP connection to ``target`` (host:port) is refused: no process listens there.
    Any other outcome (connected, timed out, unreachable, not a host:port) proves nothing."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or target.startswith("unix:"):
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class Fences:
    """The steps each worker did not answer, until it is known to run none of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[WorkerClient, list[FencedStep]] = {}
        self.fenced = 0  # steps fenced so far
        self.released = 0  # of them, released

    def note(self, client: WorkerClient, request_id: str, seq_ids: Iterable[str]) -> None:
        """``client`` did not answer step ``request_id``: hold the blocks of ``seq_ids``."""
        step = FencedStep(request_id, tuple(seq_ids), time.monotonic())
        with self._lock:
            self._open.setdefault(client, []).append(step)
            self.fenced += 1
        log.warning("step_fenced", worker=client.target, request_id=request_id, num_seqs=len(step.seq_ids))

    def held(self) -> set[str]:
        """Sequences whose blocks an unanswered step may still write: their Free waits."""
        with self._lock:
            return {s for steps in self._open.values() for f in steps for s in f.seq_ids}

    def clients(self) -> list[WorkerClient]:
        with self._lock:
            return [c for c, steps in self._open.items() if steps]

    def check(self, client: WorkerClient, timeout_s: float) -> None:
        """Ask ``client`` about its fenced steps; release those it is not running (all of them when
        nothing listens at its address). Raises ValueError when its channel was closed."""
        with self._lock:
            steps = list(self._open.get(client, ()))
        if not steps:
            return
        try:
            reply = client.fence([f.request_id for f in steps], timeout_s=timeout_s)
            running, reason = set(reply.running_request_ids), "answered"
        except grpc.RpcError:
            if not nothing_listens(client.target, timeout_s):
                return  # paused, or its link silent: it may still write
            running, reason = set(), "nothing listens at its address"
        done = [f for f in steps if f.request_id not in running]
        if not done:
            return
        with self._lock:
            left = [f for f in self._open.get(client, ()) if f not in done]
            if left:
                self._open[client] = left
            else:
                self._open.pop(client, None)
            self.released += len(done)
        now = time.monotonic()
        log.warning(
            "fence_released",
            worker=client.target,
            request_ids=[f.request_id for f in done],
            held_s=round(max(now - f.since for f in done), 3),
            reason=reason,
        )
