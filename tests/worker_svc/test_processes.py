"""The real deployment shape on the CPU backend: a cache host and two workers as separate processes.

Shows that both workers read and write one cache (prefill on A, decode on B gives the
single-process tokens), that a SIGKILLed worker's replacement continues from the cached KV with
identical tokens, that a worker started first waits for the cache host, that a geometry mismatch
refuses to start naming the value, that the cache host leaves nothing in /dev/shm, and that a cache
host without its block manager logs every attempt and names the address when it gives up.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pagedkv.kernels.cpu import linear as cpu_linear
from pagedkv.ports import free_port
from pagedkv.v1 import worker_pb2_grpc
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.generation import Scheduler, grpc_step

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK, GPU_BLOCKS, CPU_BLOCKS = 4, 48, 8
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99]


class Proc:
    """A `pagedkv` subprocess with JSON logs collected from stderr by a thread."""

    def __init__(self, args: list[str], prefix: str) -> None:
        env = dict(os.environ, PAGEDKV_KERNEL_BACKEND="reference", PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.cli", *args, "--log-format", "json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[dict] = []
        self.raw: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name=f"{prefix}-stderr").start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            with self._cv:
                self.raw.append(line)
                try:
                    self.lines.append(json.loads(line))
                except ValueError:
                    pass
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_event(self, event: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for rec in self.lines:
                    if rec.get("event") == event:
                        return rec
                left = deadline - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not self._reader_pending()):
                    raise AssertionError(
                        f"no {event!r} log line; rc={self.p.poll()} stderr:\n{''.join(self.raw)[-3000:]}"
                    )
                self._cv.wait(min(left, 0.5))

    def _reader_pending(self) -> bool:
        return self.p.stderr is not None and not self.p.stderr.closed

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        return self.p.wait(timeout)


def start_cache_host(
    model: pathlib.Path, port: int = 0, prefix: str = "pagedkv-proc-test", *extra: str
) -> tuple[Proc, dict]:
    proc = Proc(
        [
            "cache-host",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--model",
            str(model),
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks",
            str(GPU_BLOCKS),
            "--num-cpu-blocks",
            str(CPU_BLOCKS),
            "--shm-prefix",
            prefix,
            *extra,
        ],
        "cache-host",
    )
    return proc, proc.wait_event("cache_host_ready")


def start_worker(model: pathlib.Path, cache_host_port: int, *extra: str) -> Proc:
    return Proc(
        [
            "worker",
            "--port",
            "0",
            "--device",
            "cpu",
            "--model",
            str(model),
            "--cache-host",
            f"127.0.0.1:{cache_host_port}",
            *extra,
        ],
        "worker",
    )


def _segments(ready: dict) -> list[pathlib.Path]:
    return [pathlib.Path("/dev/shm", n) for n in (ready["gpu_segment"], ready["cpu_segment"])]


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):  # workers first, the cache host last
        if p.p.poll() is None:
            p.stop(signal.SIGKILL)


def test_two_workers_share_one_cache_and_a_crash_loses_no_kv(hf_llama: HFModel, procs: list[Proc]) -> None:
    host, ready = start_cache_host(hf_llama.path)
    procs.append(host)
    a = start_worker(hf_llama.path, ready["port"])
    b = start_worker(hf_llama.path, ready["port"])
    procs += [a, b]
    port_a, port_b = a.wait_event("worker_ready")["port"], b.wait_event("worker_ready")["port"]
    assert all(s.exists() for s in _segments(ready))

    ch_a, ch_b = grpc.insecure_channel(f"127.0.0.1:{port_a}"), grpc.insecure_channel(f"127.0.0.1:{port_b}")
    sched = Scheduler(
        grpc_step(worker_pb2_grpc.WorkerStub(ch_a)), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK
    )
    sched.add("s", PROMPT)
    sched.run(["s"])  # prefill on worker A
    sched.step_fn = grpc_step(worker_pb2_grpc.WorkerStub(ch_b))
    sched.generate(["s"], 6)  # decode on worker B, reading A's KV
    expected = hf_llama.greedy(PROMPT, 20)
    assert sched.seqs["s"].generated == expected[:7]

    # Crash worker B; the KV it wrote (and A's) stays in the cache host's memory.
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    ch_b.close()
    time.sleep(0.3)
    assert all(s.exists() for s in _segments(ready)), "a dying worker must not unlink the cache"
    b2 = start_worker(hf_llama.path, ready["port"])
    procs.append(b2)
    port_b2 = b2.wait_event("worker_ready")["port"]
    ch_b2 = grpc.insecure_channel(f"127.0.0.1:{port_b2}")
    sched.step_fn = grpc_step(worker_pb2_grpc.WorkerStub(ch_b2))
    sched.generate(["s"], 7)  # no re-prefill: continues from the cached KV
    sched.step_fn = grpc_step(worker_pb2_grpc.WorkerStub(ch_a))
    sched.generate(["s"], 6)  # and back on A, which sees B2's writes
    assert sched.seqs["s"].generated == expected

    # Graceful worker shutdown, then the cache host: everything is unlinked.
    ch_a.close()
    ch_b2.close()
    assert a.stop() == 0 and b2.stop() == 0
    assert any(r.get("event") == "stopped" for r in a.lines)
    assert host.stop(signal.SIGTERM) == 0
    assert not any(s.exists() for s in _segments(ready))


def test_worker_started_first_waits_for_the_cache_host(hf_llama: HFModel, procs: list[Proc]) -> None:
    port = free_port()
    w = start_worker(hf_llama.path, port, "--connect-timeout-s", "60")
    procs.append(w)
    waiting = w.wait_event("waiting_for_cache_host")
    assert waiting["cache_host"] == f"127.0.0.1:{port}"
    host, ready = start_cache_host(hf_llama.path, port=port)
    procs.insert(0, host)
    w_ready = w.wait_event("worker_ready")
    assert w_ready["cache_instance_id"] == ready["instance_id"]
    # the worker is a process like this one: the native library it loads is the one loaded here
    assert w_ready["linear_path"] == ("native" if cpu_linear.preferred() else "onednn")
    with grpc.insecure_channel(f"127.0.0.1:{w_ready['port']}") as ch:
        sched = Scheduler(
            grpc_step(worker_pb2_grpc.WorkerStub(ch)), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK
        )
        sched.add("s", PROMPT)
        sched.generate(["s"], 5)
    assert sched.seqs["s"].generated == hf_llama.greedy(PROMPT, 5)
    assert w.stop(signal.SIGINT) == 0
    assert host.stop(signal.SIGINT) == 0
    assert not any(s.exists() for s in _segments(ready))


def test_geometry_mismatch_refuses_to_start_naming_the_value(hf_llama: HFModel, procs: list[Proc]) -> None:
    host, ready = start_cache_host(hf_llama.path)
    procs.append(host)
    w = start_worker(hf_llama.path, ready["port"], "--num-gpu-blocks", "64")
    procs.append(w)
    assert w.p.wait(60) == 2
    err = w.wait_event("config_error")["error"]
    assert "num_gpu_blocks: settings has 64" in err and f"has {GPU_BLOCKS}" in err
    assert host.stop() == 0


def test_cache_host_logs_each_attempt_to_reach_the_block_manager_and_names_it(
    hf_llama: HFModel, procs: list[Proc]
) -> None:
    port = free_port()  # nothing listens there
    host = Proc(
        [
            "cache-host",
            "--port",
            "0",
            "--device",
            "cpu",
            "--model",
            str(hf_llama.path),
            "--block-manager",
            f"127.0.0.1:{port}",
            "--connect-timeout-s",
            "2",
            "--shm-prefix",
            "pagedkv-proc-nobm",
        ],
        "cache-host",
    )
    procs.append(host)
    assert host.p.wait(60) == 2
    waiting = [r for r in host.lines if r.get("event") == "waiting_for_block_manager"]
    assert len(waiting) >= 2 and {r["block_manager"] for r in waiting} == {f"127.0.0.1:{port}"}
    assert [r["attempt"] for r in waiting] == list(range(1, len(waiting) + 1))
    err = host.wait_event("config_error")["error"]
    assert f"block manager at 127.0.0.1:{port} did not answer within 2 s" in err and "UNAVAILABLE" in err
