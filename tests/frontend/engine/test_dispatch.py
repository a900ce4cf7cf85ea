"""frontend/engine/dispatch.py without servers: who gets what, balance by tokens, failover and cache loss."""

from __future__ import annotations

import grpc
import pytest

from pagedkv import errors
from pagedkv.frontend.engine.dispatch import (
    DECODE,
    MIXED,
    PREFILL,
    CacheLostEverywhere,
    WorkerPool,
    WorkerSlot,
)
from pagedkv.v1 import worker_pb2 as wpb


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", reason: str = "") -> None:
        self._code, self._details = code, details
        status = errors.rich_status(code, details, reason, errors.WORKER_DOMAIN)
        self._trailers = status.trailing_metadata if reason else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailers


class FakeWorker:
    """Answers a step with one output per sequence (token = number of its tokens), or fails."""

    def __init__(self, target: str, fail: grpc.RpcError | None = None) -> None:
        self.target = target
        self.fail = fail
        self.calls: list[wpb.WorkerStepRequest] = []

    def step(self, req: wpb.WorkerStepRequest, *, timeout_s: float | None = None) -> wpb.WorkerStepResponse:
        self.calls.append(req)
        if self.fail is not None:
            raise self.fail
        return wpb.WorkerStepResponse(
            outputs=[wpb.SequenceOutput(seq_id=s.seq_id, token_id=len(s.token_ids)) for s in req.sequences],
            num_tokens=sum(len(s.token_ids) for s in req.sequences),
        )


def pool(*roles: int, fail: dict[int, grpc.RpcError] | None = None) -> tuple[WorkerPool, list[FakeWorker]]:
    fakes = [FakeWorker(f"w{i}", (fail or {}).get(i)) for i in range(len(roles))]
    return WorkerPool([WorkerSlot(f, r) for f, r in zip(fakes, roles, strict=True)]), fakes  # type: ignore[arg-type]


def request(lengths: list[int], ops: bool = False) -> wpb.WorkerStepRequest:
    req = wpb.WorkerStepRequest(request_id="step-1")
    for i, n in enumerate(lengths):
        req.sequences.add(seq_id=f"s{i}", token_ids=list(range(1, n + 1)))
    if ops:
        req.ops.copies.add(src=1, dst=2)
    return req


def test_split_balances_tokens_longest_first() -> None:
    assert WorkerPool.split([512, 1, 1, 1, 300, 200], 2) == [[0], [1, 2, 3, 4, 5]]
    groups = WorkerPool.split([5, 5, 4, 3, 3], 2)
    assert sorted(sum([5, 5, 4, 3, 3][i] for i in g) for g in groups) == [9, 11]  # LPT: within 4/3 of best
    assert WorkerPool.split([1], 3) == [[0]]


def test_roles_decide_the_pipelines_and_failover_ignores_them() -> None:
    p, _ = pool(PREFILL, DECODE)
    assert p.disaggregated()
    assert [s.role for s in p.prefill_workers()] == [PREFILL] and [s.role for s in p.decode_workers()] == [
        DECODE
    ]
    p.slots[1].benched = True  # the decode worker is gone: the prefill worker does everything
    assert not p.disaggregated() and p.decode_workers() == [p.slots[0]]
    m, _ = pool(MIXED, MIXED)
    assert not m.disaggregated() and len(m.decode_workers()) == len(m.prefill_workers()) == 2


def test_parallel_step_merges_outputs_in_request_order_and_runs_ops_first() -> None:
    p, fakes = pool(MIXED, MIXED)
    resp = p.step(request([1, 7, 1, 1, 5], ops=True), p.workers())
    assert [o.seq_id for o in resp.outputs] == [f"s{i}" for i in range(5)]
    assert [o.token_id for o in resp.outputs] == [1, 7, 1, 1, 5]
    first = next(c for f in fakes for c in f.calls if len(c.ops.copies))
    assert not first.sequences, "the ops go alone, before the parts that may read their blocks"
    parts = [c for f in fakes for c in f.calls if c.sequences]
    assert len(parts) == 2 and all(not len(c.ops.copies) for c in parts)
    assert resp.num_tokens == 15
    p.close()


def test_an_unavailable_worker_is_benched_and_its_part_runs_elsewhere() -> None:
    p, fakes = pool(MIXED, MIXED, fail={0: _Err(grpc.StatusCode.UNAVAILABLE)})
    resp = p.step(request([3, 3]), p.workers())
    assert [o.token_id for o in resp.outputs] == [3, 3]
    assert p.stats.retries == 1 and p.workers() == [p.slots[1]]
    p.close()


def test_cache_lost_everywhere_and_other_errors_propagate() -> None:
    lost = _Err(grpc.StatusCode.FAILED_PRECONDITION, "gone", errors.CACHE_HOST_LOST)
    p, _ = pool(MIXED, MIXED, fail={0: lost, 1: lost})
    with pytest.raises(CacheLostEverywhere) as e:
        p.call(request([1]), p.workers())
    assert len(e.value.details) == 2
    # The cause is the error detail, not the text: a look-alike message alone is just an error.
    text_only, _ = pool(MIXED, fail={0: _Err(grpc.StatusCode.FAILED_PRECONDITION, "cache host lost: gone")})
    with pytest.raises(grpc.RpcError):
        text_only.call(request([1]), text_only.workers())
    bad, _ = pool(MIXED, fail={0: _Err(grpc.StatusCode.INVALID_ARGUMENT, "bad")})
    with pytest.raises(grpc.RpcError):
        bad.call(request([1]), bad.workers())
    assert bad.stats.retries == 0


class _ComesBack(FakeWorker):
    """Unreachable for its first ``down`` calls (a worker its supervisor is restarting), then well."""

    def __init__(self, target: str, down: int) -> None:
        super().__init__(target)
        self.down = down

    def step(self, req: wpb.WorkerStepRequest, *, timeout_s: float | None = None) -> wpb.WorkerStepResponse:
        if self.down > 0:
            self.down -= 1
            self.calls.append(req)
            raise _Err(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return super().step(req, timeout_s=timeout_s)


def test_with_every_worker_unreachable_the_step_waits_for_one_to_come_back() -> None:
    """The only worker died and is being restarted: the step is tried again with backoff, each pass
    under a new request id (the worker that comes back refuses the fenced one), until it answers."""
    back = _ComesBack("w0", down=3)
    p = WorkerPool([WorkerSlot(back, MIXED)], outage_s=30)  # type: ignore[arg-type]
    resp = p.call(request([2, 4]), p.workers())
    assert [o.token_id for o in resp.outputs] == [2, 4]
    ids = [c.request_id for c in back.calls]
    assert len(ids) == 4 and len(set(ids)) == 4 and ids[0] == "step-1"
    assert all(c.sequences == back.calls[0].sequences for c in back.calls)
    p.close()


def test_past_the_outage_budget_the_step_fails() -> None:
    p, fakes = pool(MIXED, fail={0: _Err(grpc.StatusCode.UNAVAILABLE)})
    p.outage_s = 0.3
    with pytest.raises(grpc.RpcError) as e:
        p.call(request([1]), p.workers())
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert len(fakes[0].calls) >= 2  # tried again before giving up
    p.close()
