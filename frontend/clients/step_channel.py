"""The client's side of the one-host step channel (format and reasons: pagedkv/step_channel.py).

``StepChannel(path)`` is called like the gRPC stub method it replaces,
``channel(request, timeout=..., metadata=...)``, so ``WorkerClient`` runs it through the same
deadline-and-retry path (pagedkv/retry.py) and its failures are the same ``grpc.RpcError`` codes:

- the deadline passes -> DEADLINE_EXCEEDED;
- the worker process is gone (end of file, a broken pipe) or answers no keepalive ping within
  ``keepalive_s`` while it computes (SIGSTOP, a hang: as gRPC's keepalive closes such a
  connection) -> UNAVAILABLE;
- a status the worker answered (INVALID_ARGUMENT, FAILED_PRECONDITION with its CACHE_HOST_LOST
  ErrorInfo, ABORTED for a fenced step, ...) -> that status, details and trailer.

One step in flight per connection; connections are pooled (idle ones are reused, a concurrent
caller opens another), and a connection whose step failed is closed, so the late reply of a step
the engine gave up on can never be read as another step's. ``ChannelUnusable`` (not an RpcError)
means the socket could not be reached at all: the caller goes back to gRPC.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import grpc
from google.rpc import status_pb2

from pagedkv import step_channel as wire
from pagedkv.v1 import worker_pb2 as wpb

# No spin by default: the reply to a real step comes after a forward pass (milliseconds), never
# within a spin's microseconds, so spinning only takes a core from the worker, which on a small
# machine is a large share of its compute. bench/step_channel_bench.py measures both ways
# (docs/worker.md, "Step transport", has the figures: the spin made steps slower).
DEFAULT_SPIN_US = 0.0
KEEPALIVE_S = 2.0


class ChannelUnusable(OSError):
    """The channel's socket cannot be connected (another host, another user, the worker gone)."""


def _unavailable(why: str) -> wire.StepChannelError:
    return wire.StepChannelError(grpc.StatusCode.UNAVAILABLE, why)


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.segment: wire.Segment | None = None
        self.seq = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def adopt(self, fds: Any) -> None:
        if not fds:
            raise _unavailable("the worker sent a segment frame without a segment")
        for extra in fds[1:]:
            with contextlib.suppress(OSError):
                os.close(extra)
        new = wire.Segment.adopt(fds[0])
        old, self.segment = self.segment, new
        if old is not None:
            old.close()

    def wait(self, want: bytes, deadline: float, keepalive_s: float) -> None:
        """Read frames until ``want`` arrives; pings the worker after ``keepalive_s`` of silence."""
        heard = time.monotonic()
        ping_at: float | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise wire.StepChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if ping_at is not None and now - ping_at >= keepalive_s:
                raise _unavailable(f"the worker answered no keepalive ping within {keepalive_s} s")
            if ping_at is None and now - heard >= keepalive_s:
                try:
                    self.sock.sendall(wire.PING)
                except OSError as e:
                    raise _unavailable(f"the worker's step channel closed: {e}") from e
                ping_at = now
                continue
            until = ping_at + keepalive_s if ping_at is not None else heard + keepalive_s
            self.sock.settimeout(max(min(deadline, until) - now, 1e-4))
            try:
                tag, fds = wire.recv_tag(self.sock)
            except TimeoutError:
                continue
            except OSError as e:
                raise _unavailable(f"the worker's step channel closed: {e}") from e
            if not tag:
                raise _unavailable("the worker closed its step channel (the process exited)")
            heard, ping_at = time.monotonic(), None
            if tag == wire.NEW_SEGMENT:
                self.adopt(fds)
                if want == wire.NEW_SEGMENT:
                    return
            elif tag == want:
                return
            elif tag != wire.PONG:
                raise _unavailable(f"unexpected frame {tag!r} on the step channel")


class StepChannel:
    """A pool of step-channel connections to one worker. Thread-safe."""

    def __init__(
        self, path: str, *, spin_us: float = DEFAULT_SPIN_US, keepalive_s: float = KEEPALIVE_S
    ) -> None:
        self.path = path
        self.spin_s = spin_us / 1e6
        self.keepalive_s = keepalive_s
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._closed = False
        self.peer_pid = 0  # the worker's pid, from the last connection (SO_PEERCRED)

    def _connect(self, deadline: float) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise ChannelUnusable(f"step channel {self.path}: {e}") from e
        conn = _Connection(sock)
        try:
            pid, _uid = wire.peer_pid_uid(sock)
            self.peer_pid = pid
            if wire.process_stopped(pid):
                # A stopped process's listening socket still accepts (the kernel does): fail at once,
                # as a gRPC channel whose connection died fails its calls until it reconnects.
                raise _unavailable(f"the worker process {pid} is stopped")
            # A live worker's acceptor answers at once: a hello slower than a keepalive round is a hang.
            conn.wait(wire.NEW_SEGMENT, min(deadline, time.monotonic() + self.keepalive_s), self.keepalive_s)
        except wire.StepChannelError as e:
            conn.close()
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() < deadline:
                raise _unavailable(f"the worker sent no hello within {self.keepalive_s} s") from e
            raise
        except BaseException:
            conn.close()
            raise
        return conn

    def _acquire(self, deadline: float) -> _Connection:
        with self._lock:
            if self._closed:
                raise ValueError("the step channel is closed")
            if self._idle:
                return self._idle.pop()
        return self._connect(deadline)

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def __call__(
        self, request: wpb.WorkerStepRequest, timeout: float | None = None, metadata: Any = None
    ) -> wpb.WorkerStepResponse:
        deadline = time.monotonic() + (timeout if timeout is not None else 365 * 86400.0)
        payload = request.SerializeToString()
        if len(payload) > wire.MAX_BYTES:  # as gRPC refuses a message over its limit
            raise wire.StepChannelError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Sent message larger than max ({len(payload)} vs. {wire.MAX_BYTES})",
            )
        conn = self._acquire(deadline)
        answered = False  # a reply or a status came back: the connection is clean
        try:
            reply = self._step(conn, payload, deadline)
            answered = True
            return reply
        except wire.StepChannelError as e:
            answered = e.answered
            raise
        finally:
            if answered:
                self._release(conn)
            else:
                conn.close()  # its step may still run and answer late: never read from it again

    def _step(self, conn: _Connection, payload: bytes, deadline: float) -> wpb.WorkerStepResponse:
        assert conn.segment is not None
        try:
            if len(payload) > conn.segment.capacity:
                conn.sock.sendall(wire.GROW_TAG + wire.GROW.pack(wire.HEADER_BYTES + len(payload)))
                conn.wait(wire.NEW_SEGMENT, deadline, self.keepalive_s)
            conn.seq += 1
            seq = conn.seq
            conn.segment.write_request(seq, payload)
            conn.sock.sendall(wire.STEP)
        except OSError as e:
            raise _unavailable(f"the worker's step channel closed: {e}") from e
        if self.spin_s > 0:  # a reply that is already there is read without sleeping in the kernel
            spin_end = time.perf_counter() + self.spin_s
            while conn.segment.rep_seq() != seq and time.perf_counter() < spin_end:
                pass
        while True:
            conn.wait(wire.REPLY, deadline, self.keepalive_s)
            h = conn.segment.header()
            if h.rep_seq == seq:
                break
            # Not this step's reply: cannot happen on a connection that only ever carries one step at
            # a time, and is never taken as one.
        body = conn.segment.payload(h.rep_len)
        if h.rep_code == 0:
            return wpb.WorkerStepResponse.FromString(body)
        code = wire.CODES.get(h.rep_code, grpc.StatusCode.UNKNOWN)
        status = status_pb2.Status.FromString(body)
        refused = wire.StepChannelError(code, status.message, body if len(status.details) else b"")
        refused.answered = True  # the worker's own status: this connection can carry the next step
        raise refused

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
