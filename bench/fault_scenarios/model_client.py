"""A block-manager client that keeps an exact model of its own sequences (the crash and retry
scenarios' oracle), and ``client_main``: the ``faults.py client`` subcommand that runs one in a
child process until a stop file appears."""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.fault_scenarios.processes import TRANSIENT
from pagedkv.arith import ceil_div
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


class ModelClient:
    """Drives mixed Allocate/Append/Fork/Free/Step with request ids, retrying transient
    failures with the *same* id until it gets an answer, and checks every reply and, after
    each outage, every table against its own model. A lost acknowledged operation shows up
    as a mismatch (or an unexpected NOT_FOUND)."""

    def __init__(
        self,
        stub: Any,
        name: str,
        block_size: int,
        seed: int,
        max_live: int = 12,
        call_timeout: float = 2.0,
        give_up_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.stub = stub
        self.name = name
        self.bs = block_size
        self.rng = random.Random(seed)
        self.max_live = max_live
        self.call_timeout = call_timeout
        self.give_up_s = give_up_s
        self.sleep = sleep
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}
        self.freed: list[str] = []
        self.n = 0
        self.acked = 0
        self.rejected = 0
        self.retried_calls = 0
        self.outages = 0
        self.verifications = 0
        self.problems: list[str] = []
        self._outage = False

    def _rid(self) -> str:
        self.n += 1
        return f"{self.name}-r{self.n}"

    def call(self, method: str, request: Any) -> Any:
        """The answer to `request` (retried with its id through outages); None if refused."""
        fn = getattr(self.stub, method)
        give_up = time.monotonic() + self.give_up_s
        first = True
        while True:
            try:
                r = fn(request, timeout=self.call_timeout)
                return r
            except grpc.RpcError as e:
                code = e.code()
                if code in TRANSIENT:
                    if first:
                        self.retried_calls += 1
                        first = False
                    self._outage = True
                    if time.monotonic() > give_up:
                        raise
                    self.sleep(0.02)
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.rejected += 1
                    return None
                self.problems.append(
                    f"{method} {request.request_id if hasattr(request, 'request_id') else ''}: "
                    f"{code.name} {e.details()}"
                )
                return None

    def _expect_blocks(self, seq: str) -> None:
        want = ceil_div(self.tokens[seq], self.bs)
        if len(self.tables[seq]) != want:
            self.problems.append(f"{seq}: {len(self.tables[seq])} blocks for {self.tokens[seq]} tokens")

    def _apply_append(self, seq: str, k: int, new: list[int], replaced: bool) -> None:
        t = self.tables[seq]
        if replaced:
            t[-1] = new[0]
            t.extend(new[1:])
        else:
            t.extend(new)
        self.tokens[seq] += k
        self._expect_blocks(seq)

    def step_once(self) -> None:
        rng = self.rng
        live = list(self.tables)
        r = rng.random()
        if not live or (r < 0.25 and len(live) < self.max_live):
            seq = f"{self.name}-s{self.n}"
            n = rng.randint(1, 6 * self.bs)
            prefix = rng.randrange(4)
            tokens = [(prefix * 1000 + i) if i < 2 * self.bs else rng.randrange(50_000) for i in range(n)]
            resp = self.call(
                "Allocate",
                pb.AllocateRequest(seq_id=seq, num_tokens=n, token_ids=tokens, request_id=self._rid()),
            )
            if resp is not None:
                self.tables[seq] = list(resp.block_ids)
                self.tokens[seq] = n
                self.acked += 1
                self._expect_blocks(seq)
        elif r < 0.60:
            seq = rng.choice(live)
            k = rng.choice((1, 1, 1, 2, self.bs))
            resp = self.call(
                "Append",
                pb.AppendRequest(
                    seq_id=seq,
                    num_tokens=k,
                    token_ids=[rng.randrange(50_000) for _ in range(k)],
                    request_id=self._rid(),
                ),
            )
            if resp is not None:
                self.acked += 1
                self._apply_append(seq, k, list(resp.new_block_ids), resp.replaced_last_block)
        elif r < 0.70 and len(live) < self.max_live:
            parent = rng.choice(live)
            child = f"{self.name}-s{self.n}"
            resp = self.call(
                "Fork", pb.ForkRequest(parent_seq_id=parent, child_seq_id=child, request_id=self._rid())
            )
            if resp is not None:
                self.acked += 1
                if list(resp.block_ids) != self.tables[parent]:
                    self.problems.append(
                        f"fork {child}: {list(resp.block_ids)} != parent {self.tables[parent]}"
                    )
                self.tables[child] = list(resp.block_ids)
                self.tokens[child] = self.tokens[parent]
        elif r < 0.88:
            seq = rng.choice(live)
            resp = self.call("Free", pb.FreeRequest(seq_id=seq, request_id=self._rid()))
            if resp is not None:
                self.acked += 1
                del self.tables[seq], self.tokens[seq]
                self.freed.append(seq)
        else:
            seqs = rng.sample(live, min(len(live), 4))
            frees = [s for s in seqs[:1] if rng.random() < 0.3]
            appends = [s for s in seqs if s not in frees]
            resp = self.call(
                "Step", pb.StepRequest(append_seq_ids=appends, free_seq_ids=frees, request_id=self._rid())
            )
            if resp is not None:
                self.acked += 1
                errs = {(e.kind, e.index): e for e in resp.errors}
                for j, s in enumerate(frees):
                    if (pb.StepItemError.PACKED_FREE, j) in errs:
                        self.problems.append(
                            f"step free {s}: {errs[(pb.StepItemError.PACKED_FREE, j)].message}"
                        )
                    else:
                        del self.tables[s], self.tokens[s]
                        self.freed.append(s)
                per: dict[int, list[int]] = {}
                for i, b in zip(resp.packed_new_block_index, resp.packed_new_block_ids, strict=False):
                    per.setdefault(i, []).append(b)
                replaced = set(resp.packed_replaced_index)
                for i, s in enumerate(appends):
                    e = errs.get((pb.StepItemError.PACKED_APPEND, i))
                    if e is not None:
                        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                            self.problems.append(f"step append {s}: {e.message}")
                        continue
                    self._apply_append(s, 1, per.get(i, []), i in replaced)
        if self._outage:
            self._outage = False
            self.outages += 1
            self.verify()

    def verify(self) -> None:
        """Every live table equals the model; a few freed sequences are gone."""
        self.verifications += 1
        for seq, table in self.tables.items():
            bt = self.call("GetBlockTable", pb.GetBlockTableRequest(seq_id=seq))
            if bt is None:
                self.problems.append(f"verify {seq}: missing")
            elif list(bt.block_ids) != table or bt.num_tokens != self.tokens[seq]:
                self.problems.append(
                    f"verify {seq}: server {list(bt.block_ids)}/{bt.num_tokens} "
                    f"!= model {table}/{self.tokens[seq]}"
                )
        give_up = time.monotonic() + self.give_up_s
        for seq in self.freed[-5:]:
            while True:
                try:
                    self.stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq), timeout=self.call_timeout)
                    self.problems.append(f"verify {seq}: freed but present")
                except grpc.RpcError as e:
                    if e.code() in TRANSIENT and time.monotonic() < give_up:
                        self._outage = True  # the next kill came during the check: ask again
                        self.sleep(0.02)
                        continue
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        self.problems.append(f"verify {seq}: {e.code().name}")
                break

    def free_all(self) -> None:
        for seq in list(self.tables):
            if self.call("Free", pb.FreeRequest(seq_id=seq, request_id=self._rid())) is not None:
                del self.tables[seq], self.tokens[seq]

    def result(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "acked": self.acked,
            "rejected": self.rejected,
            "outages": self.outages,
            "retried_calls": self.retried_calls,
            "verifications": self.verifications,
            "problems": self.problems[:20],
            "num_problems": len(self.problems),
            "live": {s: t for s, t in self.tables.items()},
        }


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="faults.py client")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--free-all", action="store_true")
    a = p.parse_args(argv)
    opts = [
        ("grpc.initial_reconnect_backoff_ms", 20),
        ("grpc.min_reconnect_backoff_ms", 20),
        ("grpc.max_reconnect_backoff_ms", 100),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{a.port}", options=opts) as ch:
        c = ModelClient(pb_grpc.BlockManagerStub(ch), a.name, a.block_size, a.seed)
        stop = Path(a.stop_file)
        while not stop.exists():
            c.step_once()
        c.verify()
        if a.free_all:
            c.free_all()
        Path(a.out).write_text(json.dumps(c.result()))
    return 0
