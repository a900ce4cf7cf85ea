"""The step channel against a worker process that is killed (SIGKILL) or paused (SIGSTOP/SIGCONT)
mid-step (tests/worker_svc/step_channel_peer.py serves it): the same codes a gRPC call gets, and who
cleans up after a SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from pagedkv.frontend.clients.step_channel import ChannelUnusable, StepChannel
from pagedkv.step_channel import sweep_stale
from pagedkv.worker_svc.step_channel import StepChannelServer
from tests.worker_svc.test_step_channel import base, echo, request

__all__ = ["base"]  # the fixture


def _peer(base: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.worker_svc.step_channel_peer", str(base)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # its log lines first
        if line.startswith("PATH="):
            return proc, line.strip().removeprefix("PATH=")
    raise AssertionError("the peer did not start")


def test_sigkill_mid_step_is_unavailable_and_the_next_start_sweeps(base: Path) -> None:
    proc, path = _peer(base)
    client = StepChannel(path)
    try:
        assert client(request(6), timeout=10).num_tokens == 6
        threading.Timer(0.3, proc.send_signal, (signal.SIGKILL,)).start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as dead:
            client(request(6, sleep_ms=20_000), timeout=30)
        assert dead.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 3.0
        proc.wait(10)
        with pytest.raises(ChannelUnusable):  # nothing listens: the client goes back to gRPC
            client(request(1), timeout=2)
    finally:
        client.close()
        proc.kill()
        proc.wait(10)
    left = Path(path).parent
    assert left.exists()  # a SIGKILLed worker removes nothing; the segments died with it (memfds)
    assert sweep_stale(base) == [left]
    assert not left.exists()
    server = StepChannelServer(echo, base=base)  # and a new worker start sweeps the same way
    server.close()


def test_sigstop_mid_step_is_deadline_or_keepalive_as_with_grpc_then_resumes(base: Path) -> None:
    proc, path = _peer(base)
    patient = StepChannel(path, keepalive_s=5.0)
    client = StepChannel(path, keepalive_s=0.5)
    try:
        # Paused past a deadline shorter than keepalive: DEADLINE_EXCEEDED, as the gRPC call says.
        assert patient(request(2), timeout=10).num_tokens == 2
        threading.Timer(0.2, proc.send_signal, (signal.SIGSTOP,)).start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as late:
            patient(request(6, sleep_ms=600), timeout=1.0)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.9 <= time.monotonic() - t0 < 2.0
        proc.send_signal(signal.SIGCONT)
        # Paused with a long deadline: keepalive finds it (UNAVAILABLE, as gRPC's keepalive does).
        assert client(request(2), timeout=10).num_tokens == 2
        threading.Timer(0.2, proc.send_signal, (signal.SIGSTOP,)).start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as hung:
            client(request(6, sleep_ms=600), timeout=30)
        assert hung.value.code() == grpc.StatusCode.UNAVAILABLE
        assert 0.9 <= time.monotonic() - t0 < 3.0
        # While it stays stopped, a new step fails at once (a retry costs nothing), as on a gRPC
        # channel whose connection died.
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as again:
            client(request(3), timeout=10)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE and "stopped" in again.value.details()
        assert time.monotonic() - t0 < 0.5
        proc.send_signal(signal.SIGCONT)
        assert client(request(7), timeout=10).num_tokens == 7  # the same process answers again
    finally:
        patient.close()
        client.close()
        proc.kill()
        proc.wait(10)
