"""The `pagedkv block-manager` process: flags and env, health, reflection,
loopback-only binding, graceful SIGTERM."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pagedkv.healthcheck import wait_healthy
from pagedkv.ports import free_port
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc)."""
    found = set()
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                if family == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr_hex)[::-1]))
                else:
                    raw = bytes.fromhex(addr_hex)
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    addr = socket.inet_ntop(socket.AF_INET6, words)
                    found.add(addr.removeprefix("::ffff:"))  # v4-mapped: gRPC binds v4 this way
    return found


@pytest.fixture
def process() -> object:
    procs: list[subprocess.Popen[str]] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        full_env = {**os.environ, **(env or {})}
        p = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.cli", "block-manager", *args],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serves_health_reflection_and_stops_gracefully_on_sigterm(process) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    p = process(
        ["--port", str(port), "--block-size", "8", "--log-format", "json"],
        env={"PAGEDKV_NUM_GPU_BLOCKS": "123"},
    )
    wait_healthy(f"127.0.0.1:{port}", "pagedkv.v1.BlockManager", 20.0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        cfg = pb_grpc.BlockManagerStub(ch).GetConfig(pb.GetConfigRequest(), timeout=5)
        assert (cfg.num_gpu_blocks, cfg.block_size) == (123, 8)  # env var and flag both applied
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"pagedkv.v1.BlockManager", "grpc.health.v1.Health"} <= services
    assert listening_addresses(port) == {"127.0.0.1"}
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0
    assert '"event": "block_manager_listening"' in err and '"event": "stopped"' in err


def test_flag_beats_env_and_bad_values_exit_with_a_clear_error(process) -> None:  # type: ignore[no-untyped-def]
    p = process(["--block-size", "12", "--port", "0"])
    _, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "block_size must be a power of two" in err
    p = process(["--num-gpu-blocks", "0"])
    _, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "num_gpu_blocks" in err
    p = process([], env={"PAGEDKV_PORT": "not-a-port"})
    _, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "port" in err


def test_port_in_use_is_reported(process) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = process(["--port", str(port)])
        _, err = p.communicate(timeout=20)
    assert p.returncode == 1 and "startup_failed" in err and f"127.0.0.1:{port}" in err


def test_cli_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "block-manager" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "unknown command" in bad.stderr
