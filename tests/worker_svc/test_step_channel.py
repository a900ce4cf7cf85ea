"""The one-host step channel (pagedkv/step_channel.py, worker_svc/step_channel.py,
frontend/clients/step_channel.py): messages of every size, the same statuses as gRPC, no late reply
read as another step's, private files removed on close. A killed or paused worker process:
test_step_channel_processes.py."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pagedkv import errors
from pagedkv import step_channel as wire
from pagedkv.frontend.clients.step_channel import ChannelUnusable, StepChannel
from pagedkv.step_channel import base_dir, sweep_stale
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.worker_svc.servicer import StepRefused
from pagedkv.worker_svc.step_channel import StepChannelServer


@pytest.fixture()
def base() -> Iterator[Path]:
    """A short private directory (a Unix socket path has at most 107 bytes; pytest's are long)."""
    d = Path(tempfile.mkdtemp(prefix="sc-", dir=base_dir()))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def echo(request: wpb.WorkerStepRequest) -> wpb.WorkerStepResponse:
    """Answers with as many logits as the first sequence has token ids, each the token id."""
    resp = wpb.WorkerStepResponse(num_tokens=sum(len(s.token_ids) for s in request.sequences))
    for s in request.sequences:
        resp.outputs.add(seq_id=s.seq_id, token_id=len(s.token_ids), logits=[float(t) for t in s.token_ids])
    return resp


def request(n_tokens: int, seq_id: str = "s", *, sleep_ms: int = 0) -> wpb.WorkerStepRequest:
    req = wpb.WorkerStepRequest(request_id=f"{seq_id}-{n_tokens}")
    req.sequences.add(
        seq_id=seq_id, token_ids=[(i * 7919) % 100_000 for i in range(n_tokens)], num_cached_tokens=sleep_ms
    )
    return req


@pytest.fixture()
def served(base: Path) -> Iterator[tuple[StepChannelServer, StepChannel]]:
    server = StepChannelServer(echo, base=base)
    client = StepChannel(server.path)
    try:
        yield server, client
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("n_tokens", [0, 1, 17, 4096, 100_000, 400_000])
def test_round_trips_messages_of_every_size(
    served: tuple[StepChannelServer, StepChannel], n_tokens: int
) -> None:
    _, client = served
    req = request(n_tokens)
    resp = client(req, timeout=30)
    assert resp == echo(req)
    if n_tokens >= 400_000:  # larger than the first segment both ways: the segment grew
        assert len(req.SerializeToString()) > wire.INITIAL_BYTES - wire.HEADER_BYTES
        assert len(resp.SerializeToString()) > wire.INITIAL_BYTES - wire.HEADER_BYTES
    # and the same connection serves a small step after the large one
    small = request(3)
    assert client(small, timeout=30) == echo(small)


def test_concurrent_steps_each_get_their_own_reply(served: tuple[StepChannelServer, StepChannel]) -> None:
    server, client = served
    reqs = [request(n, f"c{n}", sleep_ms=n % 5) for n in range(1, 41)]
    with ThreadPoolExecutor(8) as pool:
        resps = list(pool.map(lambda r: client(r, timeout=30), reqs))
    assert resps == [echo(r) for r in reqs]
    assert 1 <= server.connections <= 8


def test_statuses_come_back_as_grpc_would_send_them(base: Path) -> None:
    def refuse(req: wpb.WorkerStepRequest) -> wpb.WorkerStepResponse:
        if req.request_id == "lost":
            raise StepRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "cache host gone",
                errors.CACHE_HOST_LOST,
                {"cache_instance_id": "i1"},
            )
        if req.request_id == "bad":
            raise StepRefused(grpc.StatusCode.INVALID_ARGUMENT, "no such block")
        raise RuntimeError("boom")

    server = StepChannelServer(refuse, base=base)
    client = StepChannel(server.path)
    try:
        with pytest.raises(grpc.RpcError) as lost:
            client(wpb.WorkerStepRequest(request_id="lost"), timeout=10)
        assert lost.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert lost.value.details() == "cache host gone"
        info = errors.error_info(lost.value)
        assert info is not None and info.reason == errors.CACHE_HOST_LOST
        assert dict(info.metadata) == {"cache_instance_id": "i1"}
        with pytest.raises(grpc.RpcError) as bad:
            client(wpb.WorkerStepRequest(request_id="bad"), timeout=10)
        assert (bad.value.code(), bad.value.details(), errors.reason_of(bad.value)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "no such block", "",
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as internal:
            client(wpb.WorkerStepRequest(request_id="x"), timeout=10)
        assert internal.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError: boom" in internal.value.details()
    finally:
        client.close()
        server.close()


def test_a_late_reply_is_never_read_as_a_later_steps(served: tuple[StepChannelServer, StepChannel]) -> None:
    server, client = served
    slow = request(5, "slow", sleep_ms=0)
    gate = threading.Event()

    def gated(req: wpb.WorkerStepRequest) -> wpb.WorkerStepResponse:
        if req.sequences[0].seq_id == "slow":
            assert gate.wait(10)
        return echo(req)

    server._handler = gated  # connections made from now on run the gated handler
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as late:
        client(slow, timeout=0.3)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2.0
    nxt = request(9, "next")
    gate.set()  # the slow step answers now, on the connection the client gave up
    for _ in range(5):
        assert client(nxt, timeout=10) == echo(nxt)


def test_files_are_private_and_removed_on_close(base: Path) -> None:
    server = StepChannelServer(echo, base=base)
    d = Path(server.path).parent
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert d.stat().st_uid == os.getuid()
    assert d.name.startswith(f"{wire.DIR_PREFIX}{os.getuid()}-{os.getpid()}-")
    assert [p.name for p in d.iterdir()] == [wire.SOCKET_NAME]  # segments are memfds: no files
    client = StepChannel(server.path)
    assert client(request(4), timeout=10) == echo(request(4))
    client.close()
    server.close()
    assert not d.exists()
    with pytest.raises(ChannelUnusable):
        StepChannel(server.path)(request(1), timeout=2)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_connect(base: Path) -> None:
    base.chmod(0o755)
    server = StepChannelServer(echo, base=base)
    try:
        code = (
            "import os, socket, sys; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX);\n"
            "try:\n s.connect(sys.argv[1])\nexcept PermissionError:\n sys.exit(3)\nsys.exit(0)"
        )
        assert subprocess.run([sys.executable, "-c", code, server.path], timeout=30).returncode == 3
    finally:
        server.close()


def test_a_status_reply_keeps_the_connection_and_oversize_is_refused(base: Path) -> None:
    def picky(req: wpb.WorkerStepRequest) -> wpb.WorkerStepResponse:
        if req.request_id == "bad":
            raise StepRefused(grpc.StatusCode.INVALID_ARGUMENT, "no")
        return echo(req)

    server = StepChannelServer(picky, base=base)
    client = StepChannel(server.path)
    try:
        for _ in range(3):
            with pytest.raises(grpc.RpcError):
                client(wpb.WorkerStepRequest(request_id="bad"), timeout=10)
        assert server.connections == 1  # a status is a complete exchange: the connection is reused
        assert client(request(3), timeout=10) == echo(request(3))
        huge = wpb.WorkerStepRequest(request_id="x" * (wire.MAX_BYTES + 1))
        with pytest.raises(grpc.RpcError) as big:
            client(huge, timeout=10)
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.connections == 1
    finally:
        client.close()
        server.close()


def test_sweep_keeps_a_directory_whose_socket_still_listens(base: Path) -> None:
    server = StepChannelServer(echo, base=base)
    try:
        live = Path(server.path).parent
        looks_dead = live.with_name(f"{wire.DIR_PREFIX}{os.getuid()}-999999999-x")  # a pid no process has
        live.rename(looks_dead)  # the listening socket moves with its directory
        assert sweep_stale(base) == []
        assert looks_dead.exists()
        looks_dead.rename(live)
    finally:
        server.close()
    stale = base / f"{wire.DIR_PREFIX}{os.getuid()}-999999999-y"
    stale.mkdir(mode=0o700)
    assert sweep_stale(base) == [stale]
