"""The one-host step channel's wire format, shared by the worker (worker_svc/step_channel.py) and the
client (frontend/clients/step_channel.py).

Why a second transport for one call: every engine iteration sends one ``Worker.Step`` to each worker,
and a gRPC call on loopback costs a real share of a token's time when one request is in flight (its
HTTP/2 stack and the server's hand-off to a pool thread are paid on every step; docs/worker.md, "Step
transport", has the figures from ``bench/step_channel_bench.py``). When the client and the worker
run on one host as one user, the step goes through shared memory instead: the same serialized
``WorkerStepRequest`` / ``WorkerStepResponse`` bytes, written into a segment both map, with a
one-byte doorbell on a Unix-domain socket.

Choices, and why:

- The doorbell is a connected Unix stream socket (one per client connection), not a FIFO or an
  eventfd: an eventfd cannot be opened by an unrelated process; a FIFO has no end-of-file for a
  reader whose writer died mid-step and needs a second one for replies. A socket gives a blocking
  wait that burns no core (a spinning reader takes a core from the forward pass), an EOF the moment
  the peer process is gone (dead worker -> UNAVAILABLE), the peer's uid (SO_PEERCRED, checked) and
  fd passing. Its wake-up costs tens of microseconds. A spin on the reply header before blocking is
  there (``WorkerClient(step_spin_us=...)``) but off by default: a step's reply follows a forward
  pass of milliseconds, so the spin never catches it and only takes CPU from the worker
  (bench/step_channel_bench.py compares both; docs/worker.md).
- The segments are memfds passed over that socket (SCM_RIGHTS), not named POSIX shm: they have no
  name anyone else can open, and nothing outlives the two processes: a SIGKILLed worker leaves no
  segment behind. The only thing on the file system is the socket, in a 0700 directory of the
  worker's user (``/dev/shm/pagedkv-step-<uid>-<pid>-<random>/sock``, mode 0600); the next worker
  start of that user sweeps directories whose process is gone.
- One segment per connection and one step in flight per connection (the client keeps a small pool
  of connections for concurrent steps, so two engines or two pipelines each get their own). A
  connection whose step failed (deadline, keepalive) is closed, never reused: a late reply cannot
  reach a later step; the sequence numbers in the header check the same thing once more.
- A message larger than the segment grows it: the client asks (``G`` + size) before writing a
  request, the worker makes a larger memfd for a larger reply; either way the worker sends the new
  segment (``N`` + fd) before using it.

Layout of a segment: a 64-byte header, then the payload (the request, later the reply, in place).
Header: request sequence number, request length, reply sequence number, reply length, reply status
(0 = OK, else a gRPC code whose payload is a serialized ``google.rpc.Status``), 28 bytes spare.

Frames on the socket (one tag byte each): client -> worker ``S`` (a request is in the segment),
``P`` (keepalive ping), ``G`` + u64 (grow the segment to at least that many bytes);
worker -> client ``N`` with one fd (the segment to use from now on; the first one is the hello),
``R`` (a reply is in the segment), ``p`` (pong).
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

HEADER = struct.Struct("<QQQQi28x")
HEADER_BYTES = 64
assert HEADER.size == HEADER_BYTES
GROW = struct.Struct("<Q")
INITIAL_BYTES = 1 << 20  # a 32-sequence decode step and its reply are a few KiB
MAX_BYTES = 64 * 1024 * 1024  # the largest message either side accepts, as gRPC's (pagedkv/grpc_server.py)

STEP, PING, GROW_TAG = b"S", b"P", b"G"
NEW_SEGMENT, REPLY, PONG = b"N", b"R", b"p"

DIR_PREFIX = "pagedkv-step-"
SOCKET_NAME = "sock"


def size_for(payload: int) -> int:
    """Segment bytes for a payload: the next power of two that holds header + payload."""
    need = HEADER_BYTES + payload
    size = INITIAL_BYTES
    while size < need:
        size *= 2
    return size


@dataclass(slots=True)
class Header:
    req_seq: int = 0
    req_len: int = 0
    rep_seq: int = 0
    rep_len: int = 0
    rep_code: int = 0


class Segment:
    """One mapped memfd: the header and the payload area, in this process."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size)
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new anonymous segment (the worker's side): no name, gone with its last fd and mapping."""
        fd = os.memfd_create("pagedkv-step", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int) -> Segment:
        """A segment received over the socket (the client's side)."""
        try:
            return cls(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise

    @property
    def capacity(self) -> int:
        return self.size - HEADER_BYTES

    def header(self) -> Header:
        return Header(*HEADER.unpack_from(self.map, 0))

    def rep_seq(self) -> int:
        return int(struct.unpack_from("<Q", self.map, 16)[0])

    def write_request(self, seq: int, payload: bytes) -> None:
        n = len(payload)
        self.view[HEADER_BYTES : HEADER_BYTES + n] = payload
        HEADER.pack_into(self.map, 0, seq, n, 0, 0, 0)

    def write_reply(self, seq: int, code: int, payload: bytes) -> None:
        h = self.header()
        n = len(payload)
        self.view[HEADER_BYTES : HEADER_BYTES + n] = payload
        HEADER.pack_into(self.map, 0, h.req_seq, h.req_len, seq, n, code)

    def payload(self, n: int) -> bytes:
        return bytes(self.view[HEADER_BYTES : HEADER_BYTES + n])

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)


def send_segment(sock: socket.socket, seg: Segment) -> None:
    socket.send_fds(sock, [NEW_SEGMENT], [seg.fd])


def recv_tag(sock: socket.socket) -> tuple[bytes, Sequence[int]]:
    """One tag byte and any fds that came with it (b"" at end of file)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    return data, fds


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionResetError("the peer closed the step channel")
        out += got
    return out


def peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def process_stopped(pid: int) -> bool:
    """True when process ``pid`` (on this host) is stopped (SIGSTOP, a debugger): /proc says T or t."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"T", b"t")


def base_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listened(path: Path) -> bool:
    """True when a process accepts connections on the Unix socket ``path`` (a stopped one does too:
    the kernel accepts for it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # cannot tell (e.g. a full backlog): keep it
    return True


def sweep_stale(base: Path | None = None) -> list[Path]:
    """Remove this user's step-channel directories whose worker is gone; return them.

    Gone: the pid in the name is not alive here AND nothing listens on its socket. The second test
    keeps a live worker's directory when that pid is not visible from here (another PID namespace
    sharing /dev/shm) or was reused."""
    base = base or base_dir()
    prefix = f"{DIR_PREFIX}{os.getuid()}-"
    removed = []
    for d in base.glob(prefix + "*"):
        pid_text = d.name[len(prefix) :].split("-", 1)[0]
        try:
            if not pid_text.isdigit() or d.lstat().st_uid != os.getuid() or _pid_alive(int(pid_text)):
                continue
        except OSError:
            continue
        if _listened(d / SOCKET_NAME):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


class StepChannelError(grpc.RpcError):
    """A step over the channel that failed, as the gRPC call would have: ``code()``, ``details()``
    and ``trailing_metadata()`` (the ``grpc-status-details-bin`` trailer when the worker gave a
    reason), so the engine's handling (frontend/engine/dispatch.py, pagedkv/errors.py) and the
    client's retries are the same for both transports."""

    def __init__(self, code: grpc.StatusCode, details: str, status_bin: bytes = b"") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._status_bin = status_bin
        self.answered = False  # True: the worker answered with this status (the exchange completed)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        from pagedkv.errors import DETAILS_KEY

        return ((DETAILS_KEY, self._status_bin),) if self._status_bin else ()


CODES = {c.value[0]: c for c in grpc.StatusCode}
