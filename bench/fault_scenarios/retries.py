"""Retry scenario: faults injected between client and server (dropped before the server, or after it
applied the call) never double-apply, thanks to request ids; the control shows that retries without
them do (``faults.py retries``)."""

from __future__ import annotations

import random
import threading
from typing import Any

import grpc

from bench.fault_scenarios.model_client import ModelClient
from bench.fault_scenarios.processes import TRANSIENT
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


class _InjectedError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, where: str) -> None:
        super().__init__(f"injected {code.name} {where}")
        self._code, self._where = code, where

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"injected {self._code.name} ({self._where})"

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


class FaultInjector(grpc.UnaryUnaryClientInterceptor):
    """Fails calls with UNAVAILABLE / DEADLINE_EXCEEDED before they are sent (the server never
    sees them) or after the reply came back (the server applied them; the client never hears)."""

    def __init__(self, p_before: float, p_after: float, seed: int = 0, methods: tuple[str, ...] = ()) -> None:
        self.p_before, self.p_after = p_before, p_after
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.methods = methods
        self.injected_before = self.injected_after = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method.rsplit("/", 1)[-1]
        if self.methods and name not in self.methods:
            return continuation(details, request)
        with self.lock:
            r = self.rng.random()
            code = self.rng.choice(TRANSIENT)
        if r < self.p_before:
            with self.lock:
                self.injected_before += 1
            raise _InjectedError(code, "request dropped")
        outcome = continuation(details, request)
        if r < self.p_before + self.p_after:
            outcome.result()  # the server has applied it
            with self.lock:
                self.injected_after += 1
            raise _InjectedError(code, "reply dropped")
        return outcome


def run_retries(
    clients: int = 4, ops: int = 300, p_before: float = 0.15, p_after: float = 0.15, seed: int = 0
) -> dict[str, Any]:
    from pagedkv.block_manager_svc.server import start_server
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    running = start_server(
        BlockManagerSettings(port=0, num_gpu_blocks=1024, block_size=16, log_level="warning")
    )
    try:
        target = f"127.0.0.1:{running.port}"
        inj = FaultInjector(p_before, p_after, seed, methods=("Allocate", "Append", "Fork", "Free", "Step"))
        models: list[ModelClient] = []

        def work(i: int) -> None:
            with grpc.insecure_channel(target) as ch:
                stub = pb_grpc.BlockManagerStub(grpc.intercept_channel(ch, inj))
                c = ModelClient(stub, f"c{i}", 16, seed * 100 + i, sleep=lambda s: None)
                models.append(c)
                for _ in range(ops):
                    c.step_once()
                c.verify()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stats = stub.GetStats(pb.GetStatsRequest())
            live_blocks = {b for c in models for t in c.tables.values() for b in t}
            naive = _naive_double_apply(stub)
        return {
            "ops": sum(c.acked + c.rejected for c in models),
            "injected_before": inj.injected_before,
            "injected_after": inj.injected_after,
            "dedupe_hits": stats.num_dedupe_hits,
            "problems": sum(len(c.problems) for c in models),
            "problem_samples": [p for c in models for p in c.problems][:5],
            "used_blocks": stats.num_used_blocks,
            "model_blocks": len(live_blocks),
            "sequences": stats.num_sequences,
            "model_sequences": sum(len(c.tables) for c in models),
            "naive_double_applied": naive,
        }
    finally:
        running.stop(0)


def _naive_double_apply(stub: Any) -> int:
    """Contrast: the same 'reply lost, retry' without a request id appends twice."""
    stub.Allocate(pb.AllocateRequest(seq_id="naive", num_tokens=16))
    for _ in range(10):
        stub.Append(pb.AppendRequest(seq_id="naive", num_tokens=16))  # reply "lost"...
        stub.Append(pb.AppendRequest(seq_id="naive", num_tokens=16))  # ...so the client retries
    bt = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="naive"))
    stub.Free(pb.FreeRequest(seq_id="naive"))
    return (bt.num_tokens - 16 - 10 * 16) // 16
