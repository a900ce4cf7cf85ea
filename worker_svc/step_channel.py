"""The worker's side of the one-host step channel (format and reasons: pagedkv/step_channel.py).

``StepChannelServer`` listens on a Unix socket in a fresh 0700 directory of this user (under
/dev/shm, else the temp dir) and serves each client connection with two threads: a reader that
waits on the socket (doorbells, keepalive pings, grow requests) and a stepper that runs the step
through the same ``run_step`` as the gRPC servicer (cache checks, step fence, error mapping), writes
the reply into the connection's segment and rings back. The pings are answered while a step
computes, as gRPC's own threads answer keepalive pings: a client tells a hung worker (SIGSTOP) from
a busy one the same way on both transports.

Clean-up: ``close`` removes the directory. After a SIGKILL nothing but the directory and its socket
file is left (the segments are memfds, gone with the processes); ``sweep_stale``
(pagedkv/step_channel.py) removes this user's directories whose process no longer exists, and runs
at every worker start (``pagedkv up`` restarts an exited worker at once) and when ``pagedkv up``
stops.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from pagedkv import step_channel as wire
from pagedkv.step_channel import base_dir, sweep_stale
from pagedkv.v1 import worker_pb2
from pagedkv.worker_svc.servicer import StepRefused

log = structlog.get_logger("pagedkv.worker")

Handler = Callable[[worker_pb2.WorkerStepRequest], worker_pb2.WorkerStepResponse]
MAX_CONNECTIONS = 64  # each is two threads, a socket and a segment


class _Connection:
    """One client connection: its segment, a reader thread and a stepper thread."""

    def __init__(
        self, sock: socket.socket, handler: Handler, on_close: Callable[[_Connection], None]
    ) -> None:
        self.sock = sock
        self.handler = handler
        self.on_close = on_close
        self.segment = wire.Segment.create(wire.INITIAL_BYTES)
        self.send_lock = threading.Lock()
        self.steps: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.reader = threading.Thread(target=self._read_loop, name="step-channel-read", daemon=True)
        self.stepper = threading.Thread(target=self._step_loop, name="step-channel-step", daemon=True)

    def start(self) -> None:
        with self.send_lock:
            wire.send_segment(self.sock, self.segment)  # the hello
        self.reader.start()
        self.stepper.start()

    def _send(self, tag: bytes) -> None:
        with self.send_lock:
            self.sock.sendall(tag)

    def _replace(self, size: int) -> wire.Segment:
        new = wire.Segment.create(size)
        with self.send_lock:
            wire.send_segment(self.sock, new)
        old, self.segment = self.segment, new
        old.close()
        return new

    def _read_loop(self) -> None:
        try:
            while True:
                tag = self.sock.recv(1)
                if not tag:
                    break
                if tag == wire.STEP:
                    self.steps.put(1)
                elif tag == wire.PING:
                    self._send(wire.PONG)
                elif tag == wire.GROW_TAG:
                    (size,) = wire.GROW.unpack(wire.recv_exact(self.sock, wire.GROW.size))
                    if size > wire.HEADER_BYTES + wire.MAX_BYTES:
                        log.warning("step_channel_grow_refused", size=size, max_bytes=wire.MAX_BYTES)
                        break  # the client never asks for it (it refuses such a request itself)
                    self._replace(wire.size_for(size - wire.HEADER_BYTES))
                else:
                    log.warning("step_channel_bad_frame", tag=tag.hex())
                    break
        except OSError:
            pass
        finally:
            self.steps.put(None)

    def _step_loop(self) -> None:
        try:
            while self.steps.get() is not None:
                self._one_step()
        except OSError:
            pass  # the client went away (it gave up on this step, or exited): nobody to answer
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.segment.close()
            self.on_close(self)

    def _one_step(self) -> None:
        seg = self.segment
        h = seg.header()
        code, payload = 0, b""
        try:
            request = worker_pb2.WorkerStepRequest.FromString(seg.payload(h.req_len))
            payload = self.handler(request).SerializeToString()
        except StepRefused as e:
            code, payload = e.code.value[0], e.status().SerializeToString()
        except Exception as e:  # noqa: BLE001 - a status for the client, the trace in the log
            log.exception("step_channel_failed")
            refused = StepRefused(grpc.StatusCode.INTERNAL, f"step failed: {type(e).__name__}: {e}")
            code, payload = refused.code.value[0], refused.status().SerializeToString()
        if len(payload) > seg.capacity:
            seg = self._replace(wire.size_for(len(payload)))
            seg.write_request(h.req_seq, b"")  # the new segment's header names the step it answers
        seg.write_reply(h.req_seq, code, payload)
        self._send(wire.REPLY)

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class StepChannelServer:
    """Accepts step-channel connections for one worker; ``path`` goes into ``WorkerInfo.step_channel``."""

    def __init__(self, handler: Handler, base: Path | None = None) -> None:
        base = base or base_dir()
        swept = sweep_stale(base)
        if swept:
            log.info("step_channel_swept", dirs=[str(d) for d in swept])
        self.dir = Path(tempfile.mkdtemp(prefix=f"{wire.DIR_PREFIX}{os.getuid()}-{os.getpid()}-", dir=base))
        os.chmod(self.dir, 0o700)  # mkdtemp's mode already; said once more, it is the access control
        self.path = str(self.dir / wire.SOCKET_NAME)
        self._handler = handler
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)
            try:
                self._listener.bind(self.path)  # 0600 from the start: no window with a wider mode
            finally:
                os.umask(old)
            self._listener.listen(16)
        except BaseException:
            self._listener.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self._acceptor = threading.Thread(target=self._accept_loop, name="step-channel-accept", daemon=True)
        self._acceptor.start()
        log.info("step_channel_listening", path=self.path)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                _pid, uid = wire.peer_pid_uid(sock)
                with self._lock:
                    full = len(self._conns) >= MAX_CONNECTIONS
                if uid != os.getuid() or full or self._closed:
                    log.warning("step_channel_refused", peer_uid=uid, full=full)
                    sock.close()
                    continue
                conn = _Connection(sock, self._handler, self._forget)
            except OSError as e:
                log.warning("step_channel_accept_failed", error=str(e))
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            with self._lock:
                self._conns.add(conn)
            try:
                conn.start()
            except OSError as e:  # the client left before its hello: nothing started, all released
                log.warning("step_channel_accept_failed", error=str(e))
                with contextlib.suppress(OSError):
                    sock.close()
                conn.segment.close()
                self._forget(conn)

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop accepting, end every connection (its clients see end of file), remove the directory."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for c in conns:
            c.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._acceptor.join(timeout=2.0)
