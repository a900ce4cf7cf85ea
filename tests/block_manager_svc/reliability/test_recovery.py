"""Crash recovery: journal + snapshot restore the exact state (tables, ref counts, prefix index,
eviction order, CPU pool, leases, dedupe window); a torn tail is dropped; misuse is refused."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from pagedkv.block_manager_svc.journal import list_segments
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers, crash


def workload(stub, rng: random.Random, n: int, tag: str = "") -> list[tuple[str, object, object]]:
    """Random mixed mutations; returns (method, request, reply) of every acknowledged one."""
    live: list[str] = []
    acked = []
    for i in range(n):
        r = rng.random()
        rid = f"{tag}r{i}" if rng.random() < 0.7 else ""
        try:
            if not live or r < 0.25:
                s = f"{tag}s{i}"
                k = rng.randint(1, 20)
                toks = [rng.randrange(3) * 100 + j if j < 8 else rng.randrange(1000) for j in range(k)]
                req = pb.AllocateRequest(
                    seq_id=s,
                    num_tokens=k,
                    token_ids=toks,
                    request_id=rid,
                    lease_id="L1" if rng.random() < 0.2 else "",
                )
                acked.append(("Allocate", req, stub.Allocate(req)))
                live.append(s)
            elif r < 0.55:
                k = rng.randint(1, 5)
                req = pb.AppendRequest(
                    seq_id=rng.choice(live),
                    num_tokens=k,
                    token_ids=[rng.randrange(1000) for _ in range(k)],
                    request_id=rid,
                )
                acked.append(("Append", req, stub.Append(req)))
            elif r < 0.65:
                c = f"{tag}f{i}"
                req = pb.ForkRequest(parent_seq_id=rng.choice(live), child_seq_id=c, request_id=rid)
                acked.append(("Fork", req, stub.Fork(req)))
                live.append(c)
            elif r < 0.8:
                req = pb.FreeRequest(seq_id=live.pop(rng.randrange(len(live))), request_id=rid)
                acked.append(("Free", req, stub.Free(req)))
            elif r < 0.85:
                req = pb.StepRequest(
                    append_seq_ids=rng.sample(live, min(3, len(live))),
                    grant_seq_ids=rng.sample(live, min(2, len(live))),
                    request_id=rid,
                )
                acked.append(("Step", req, stub.Step(req)))
            elif r < 0.9:  # a Commit of some of what the sequence holds (recovery keeps the cache)
                s = rng.choice(live)
                n = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).num_tokens
                req = pb.CommitRequest(seq_id=s, num_computed_tokens=rng.randint(0, n), request_id=rid)
                acked.append(("Commit", req, stub.Commit(req)))
            elif r < 0.95:  # an engine iteration: commits, an allocation with a lease, a fork
                s, c = f"{tag}s{i}", f"{tag}f{i}"
                k = rng.randint(1, 12)
                commit = rng.sample(live, min(2, len(live)))
                counts = [stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=x)).num_tokens for x in commit]
                req = pb.StepRequest(
                    commit_seq_ids=commit,
                    commit_num_computed_tokens=counts,
                    alloc_seq_ids=[s],
                    alloc_num_tokens=[k],
                    alloc_token_ids=[rng.randrange(3) * 100 + j for j in range(k)],
                    alloc_lease_ids=["L1" if rng.random() < 0.5 else ""],
                    fork_parent_seq_ids=[s],
                    fork_child_seq_ids=[c],
                    request_id=rid,
                )
                resp = stub.Step(req)
                acked.append(("Step", req, resp))
                if not resp.errors:
                    live += [s, c]
            else:
                req = pb.KeepAliveRequest(lease_id="L1", ttl_ms=60_000, request_id=rid)
                acked.append(("KeepAlive", req, stub.KeepAlive(req)))
        except grpc.RpcError as e:
            # Full pool, or a sequence that preemption (recompute) already dropped.
            assert e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND), e.details()
    return acked


def canonical(obj: object, depth: int = 0) -> object:
    """A plain, comparable rendering of an object graph (dict order and list order kept)."""
    assert depth < 40
    if isinstance(obj, (int, float, str, bytes, bool, type(None))):
        return obj
    if isinstance(obj, dict):
        return ("dict", [(canonical(k, depth + 1), canonical(v, depth + 1)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [canonical(v, depth + 1) for v in obj])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted(repr(canonical(v, depth + 1)) for v in obj))
    if hasattr(obj, "tobytes"):  # array.array
        return ("array", obj.tobytes())
    if hasattr(obj, "__getstate__") and type(obj).__module__.startswith("collections"):
        return (
            type(obj).__name__,
            canonical(list(obj.items()) if hasattr(obj, "items") else list(obj), depth + 1),
        )
    names: list[str] = []
    for klass in type(obj).__mro__:
        names += [n for n in getattr(klass, "__slots__", ()) if n not in names]
    state = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
    state.update(getattr(obj, "__dict__", {}))
    return (type(obj).__qualname__, [(k, canonical(v, depth + 1)) for k, v in sorted(state.items())])


def state_bytes(running) -> object:
    """The whole state (core and leases) in a form that compares by value."""
    s = running.servicer
    return canonical((s._core, s.reliable.leases.export()))


def drain_then_allocate(running, stub) -> None:  # type: ignore[no-untyped-def]
    """End of a recovery test: freeing every restored sequence leaves no sequence and no referenced
    block (recovery leaked no ref count), and a new request gets its blocks."""
    core = running.servicer._core  # noqa: SLF001 - every sequence the state holds
    for seq_id in [*core.seqs, *core.swapped]:
        stub.Free(pb.FreeRequest(seq_id=seq_id))
    s = stub.GetStats(pb.GetStatsRequest())
    assert (s.num_sequences, s.num_used_blocks) == (0, 0)
    got = stub.Allocate(pb.AllocateRequest(seq_id="after-recovery", num_tokens=4 * 5, request_id="after"))
    assert len(got.block_ids) == 5
    stub.Free(pb.FreeRequest(seq_id="after-recovery"))
    core.check_invariants()


@pytest.mark.parametrize("fsync", ["always", "batch", "off"])
def test_crash_restores_exact_state_and_replies(servers: Servers, state_dir: str, fsync: str) -> None:
    kw = {"state_dir": state_dir, "fsync": fsync, "num_gpu_blocks": 48, "snapshot_every_ops": 70}
    rng = random.Random(7)
    running, stub = servers.start(**kw)
    acked = workload(stub, rng, 250)
    before = state_bytes(running)
    crash(running)
    running2, stub2 = servers.start(**kw)
    running2.servicer._core.check_invariants()
    assert state_bytes(running2) == before  # tables, ref counts, index, eviction order, leases
    # Every acknowledged request with an id is answered from the rebuilt window, unchanged.
    # (A pure KeepAlive renewal is not remembered: its retry is re-run, which is harmless.)
    with_ids = [(m, req, rep) for m, req, rep in acked if req.request_id and m != "KeepAlive"]
    assert with_ids
    for method, req, rep in with_ids[-60:]:
        assert getattr(stub2, method)(req) == rep
    assert state_bytes(running2) == before
    # And the state keeps working: more load, another crash, same again.
    workload(stub2, rng, 100, tag="b")
    before2 = state_bytes(running2)
    crash(running2)
    running3, stub3 = servers.start(**kw)
    assert state_bytes(running3) == before2
    assert running3.servicer.reliable.recovery is not None
    drain_then_allocate(running3, stub3)


def test_torn_last_record_is_dropped_not_half_applied(servers: Servers, state_dir: str) -> None:
    kw = {"state_dir": state_dir, "snapshot_every_ops": 0, "snapshot_interval_s": 0}
    running, stub = servers.start(**kw)
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=5))
    before = state_bytes(running)
    stub.Append(pb.AppendRequest(seq_id="a", num_tokens=9, request_id="x"))
    crash(running)
    _, seg = list_segments(Path(state_dir))[-1]
    data = seg.read_bytes()
    seg.write_bytes(data[:-3])  # the Append's record torn
    running2, stub2 = servers.start(**kw)
    assert state_bytes(running2) == before
    assert running2.servicer.reliable.recovery.dropped_bytes > 0
    assert stub2.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 5
    # The client never got an ack it can trust... and its retry applies it exactly once.
    stub2.Append(pb.AppendRequest(seq_id="a", num_tokens=9, request_id="x"))
    stub2.Append(pb.AppendRequest(seq_id="a", num_tokens=9, request_id="x"))
    assert stub2.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 14
    drain_then_allocate(running2, stub2)


def test_clean_stop_snapshots_and_restarts_without_replay(servers: Servers, state_dir: str) -> None:
    running, stub = servers.start(state_dir=state_dir)
    workload(stub, random.Random(3), 60)
    before = state_bytes(running)
    running.stop(0)
    running2, _ = servers.start(state_dir=state_dir)
    assert running2.servicer.reliable.recovery.replayed == 0
    assert state_bytes(running2) == before


def test_snapshot_deletes_covered_segments(servers: Servers, state_dir: str) -> None:
    running, stub = servers.start(state_dir=state_dir, snapshot_every_ops=0, snapshot_interval_s=0)
    workload(stub, random.Random(5), 40)
    assert len(list_segments(Path(state_dir))) == 1
    seq = running.servicer.reliable.snapshot_now()
    segs = list_segments(Path(state_dir))
    assert [first for first, _ in segs] == [seq + 1]
    before = state_bytes(running)
    crash(running)
    running2, _ = servers.start(state_dir=state_dir)
    assert (
        running2.servicer.reliable.recovery.replayed == 0
        and running2.servicer.reliable.recovery.snapshot_seq == seq
    )
    assert state_bytes(running2) == before


def test_geometry_change_and_second_server_are_refused(servers: Servers, state_dir: str) -> None:
    running, stub = servers.start(state_dir=state_dir)
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=5))
    with pytest.raises(RuntimeError, match="in use"):
        start_server(BlockManagerSettings(port=0, num_gpu_blocks=64, block_size=4, state_dir=state_dir))
    running.stop(0)
    with pytest.raises(RuntimeError, match="num_gpu_blocks=64.*settings say 65"):
        start_server(BlockManagerSettings(port=0, num_gpu_blocks=65, block_size=4, state_dir=state_dir))
    _running2, stub2 = servers.start(state_dir=state_dir)  # the refused start left the dir usable
    assert stub2.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 5


def test_lease_expiry_is_journaled_and_leases_survive(servers: Servers, state_dir: str) -> None:
    kw = {"state_dir": state_dir, "lease_ttl_s": 0.3, "lease_sweep_interval_s": 0.05}
    running, stub = servers.start(**kw)
    stub.Allocate(pb.AllocateRequest(seq_id="gone", num_tokens=5, lease_id="A"))
    stub.Allocate(pb.AllocateRequest(seq_id="kept", num_tokens=5, lease_id="B"))
    stub.KeepAlive(pb.KeepAliveRequest(lease_id="B", ttl_ms=60_000))
    import time

    deadline = time.monotonic() + 5
    while stub.GetStats(pb.GetStatsRequest()).num_leases_expired < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    before = state_bytes(running)
    crash(running)
    running2, stub2 = servers.start(**kw)
    assert state_bytes(running2) == before
    s = stub2.GetStats(pb.GetStatsRequest())
    assert (s.num_sequences, s.num_leases, s.num_leases_expired) == (1, 1, 1)
    assert running2.servicer.reliable.leases.lease_of == {"kept": "B"}
    drain_then_allocate(running2, stub2)
