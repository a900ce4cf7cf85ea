"""vLLM-format KV events over ZeroMQ (block_manager_svc/kv_events_zmq.py).

The subscriber here is what a router built for vLLM runs: a plain SUB socket,
a REQ socket for replays, and msgspec structs written from vLLM's documented
schema (vllm/distributed/kv_events.py; nothing imported from pagedkv's
publisher). It rebuilds the pool's cached-prefix index from the events; after a
workload of allocations, appends, frees, evictions and a prefix-cache reset,
that index equals the block manager's own.
"""

from __future__ import annotations

import random
import time
from array import array
from typing import Any

import msgspec
import pytest
import zmq

from pagedkv.block_manager_svc.core.kv_events import BlockStored as PoolBlockStored
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.clients.block_manager import BlockManagerClient

BLOCK_SIZE = 4


# --- vLLM's schema, as documented (tagged events; the batch is positional) -------------------
class MapEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(MapEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(MapEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(MapEvent):
    pass


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# Releases before vLLM PR #42892: every event a positional array led by its tag.
class ArrayEvent(msgspec.Struct, tag=True, array_like=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A router's view of one pool: hash -> (parent hash, the block's token ids)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, batch_type: type) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        # DEALER, not REQ: a replay answers one request with many messages, and a REQ socket
        # keeps only the first reply (the server side is vLLM's: a ROUTER).
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(batch_type)
        self.topic = topic
        self.last_seq = -1
        self.index: dict[int, tuple[int | None, list[int]]] = {}
        self.num_replayed = 0
        self.num_cleared = 0
        self.dp_ranks: set[int | None] = set()

    def close(self) -> None:
        self.sub.close()
        self.replay.close()
        self.ctx.term()

    def ask_replay(self, first: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart((b"", first.to_bytes(8, "big")))  # what REQ would send
        out = []
        while True:
            assert self.replay.poll(5000), "no replay answer"
            empty, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                return out
            out.append((int.from_bytes(seq_bytes, "big"), payload))

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last_seq + 1, (seq, self.last_seq)
        self.last_seq = seq
        batch = self.decoder.decode(payload)
        self.dp_ranks.add(batch.data_parallel_rank)
        for ev in batch.events:
            name = type(ev).__name__.removeprefix("Array")
            if name == "BlockStored":
                assert ev.block_size == BLOCK_SIZE and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BLOCK_SIZE * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    self.index[h] = (parent, ev.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                    parent = h
            elif name == "BlockRemoved":
                for h in ev.block_hashes:
                    self.index.pop(h, None)
            else:
                self.index.clear()
                self.num_cleared += 1

    def drain(self, quiet_s: float = 0.3) -> None:
        """Apply everything published until the socket stays quiet; replay any gap."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:  # missed batches (at least the first one: slow joiner)
                for rseq, rpayload in self.ask_replay(self.last_seq + 1):
                    if self.last_seq < rseq < seq:
                        self.apply(rseq, rpayload)
                        self.num_replayed += 1
            self.apply(seq, payload)


def ext(h: bytes | None) -> int | None:
    """vLLM's uint64 external hash of a pagedkv chain hash (documented in docs/deploy.md)."""
    return None if h is None else int.from_bytes(h[-8:], "big")


def pool_index(running: Any) -> dict[int, int | None]:
    sv = running.servicer
    with sv._lock:
        pool = sv._core.pool
        return {ext(h): ext(pool.parent_hash[b]) for h, b in pool.index.items()}


def commit(bm: BlockManagerClient, seq_id: str, num_tokens: int) -> None:
    """Commit the computed KV when the block manager has Commit (stores happen at commit then)."""
    if hasattr(bm, "commit"):
        bm.commit(seq_id, num_tokens)


def run_workload(bm: BlockManagerClient, rng: random.Random) -> list[list[int]]:
    """Shared prefixes, decode appends, frees, allocations that evict, a reset; the sequences' tokens."""
    sequences: list[list[int]] = []
    systems = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    live: dict[str, int] = {}
    for i in range(40):
        prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        sid = f"s{i}"
        while len(live) >= 2:  # keep the 16-block pool tight: later prompts evict cached chains
            oldest = next(iter(live))
            del live[oldest]
            bm.free(oldest)
        bm.allocate(sid, len(prompt), prompt)
        commit(bm, sid, len(prompt))
        n = len(prompt)
        sequences.append(prompt)
        for _ in range(rng.randrange(0, 6)):
            prompt.append(rng.randrange(1000))
            bm.append(sid, 1, prompt[-1:])
            n += 1
            commit(bm, sid, n)
        live[sid] = n
        if i == 25:
            bm.reset_prefix_cache()
    for sid in list(live):
        bm.free(sid)
    return sequences


@pytest.mark.parametrize("encoding,batch_type", [("map", MapBatch), ("array", ArrayBatch)])
def test_subscriber_rebuilds_the_prefix_index(server_factory, encoding, batch_type) -> None:  # type: ignore[no-untyped-def]
    running = server_factory(
        num_gpu_blocks=16,
        block_size=BLOCK_SIZE,
        watermark_fraction=0,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kv@pool-a@tiny",
        kv_events_encoding=encoding,
    )
    pub = running.kv_events
    assert pub is not None
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, "kv@pool-a@tiny", batch_type)
    try:
        time.sleep(0.2)  # let the subscription reach the publisher (ZeroMQ's slow joiner)
        with BlockManagerClient(f"127.0.0.1:{running.port}") as bm:
            sequences = run_workload(bm, random.Random(7))
        sub.drain()
        expected = pool_index(running)
        assert expected, "the workload left nothing cached: the comparison would be vacuous"
        assert running.servicer._core.pool.num_evicted > 0
        assert {h: parent for h, (parent, _) in sub.index.items()} == expected
        # seq 0 (the AllBlocksCleared a starting publisher sends) came by replay or live; the reset, live.
        assert sub.last_seq + 1 == pub.num_batches and sub.num_cleared == 2
        assert sub.dp_ranks == {0}
        # Token ids chain back to the root: every cached prefix is the prefix of a real sequence.
        for h in expected:
            chain, cur = [], h
            while cur is not None:
                parent, toks = sub.index[cur]
                chain = toks + chain
                cur = parent
            assert any(seq[: len(chain)] == chain for seq in sequences), chain
    finally:
        sub.close()


def test_replay_serves_missed_batches(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A subscriber that connects late gets the whole history by replay, then live batches."""
    running = server_factory(
        num_gpu_blocks=16,
        block_size=BLOCK_SIZE,
        watermark_fraction=0,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    pub = running.kv_events
    assert pub is not None
    with BlockManagerClient(f"127.0.0.1:{running.port}") as bm:
        run_workload(bm, random.Random(11))  # nobody listening: all of it is history
        deadline = time.monotonic() + 5
        seen, stable_since = -1, time.monotonic()
        while time.monotonic() < deadline:  # until the publisher has sent its last batch
            if pub.num_batches != seen:
                seen, stable_since = pub.num_batches, time.monotonic()
            elif seen >= 2 and time.monotonic() - stable_since > 0.3:
                break
            time.sleep(0.01)
        published = pub.num_batches
        sub = Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events", MapBatch)
        try:
            history = sub.ask_replay(0)
            assert [s for s, _ in history] == list(range(published))
            for seq, payload in history:
                sub.apply(seq, payload)
            assert sub.ask_replay(published) == []  # nothing newer yet: just the end marker
            assert len(sub.ask_replay(published - 1)) == 1
            time.sleep(0.2)
            bm.allocate("late", 9, list(range(500, 509)))  # a live batch after the replay
            commit(bm, "late", 9)
            sub.drain()
            # The allocation's evictions and the commit's stores are two calls: one or two batches.
            assert sub.last_seq in (published, published + 1)
            assert {h: p for h, (p, _) in sub.index.items()} == pool_index(running)
        finally:
            sub.close()


def test_settings_refuse_plaintext_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="every interface"):
        BlockManagerSettings(kv_events_endpoint="tcp://*:5557")
    BlockManagerSettings(kv_events_endpoint="tcp://*:5557", allow_insecure=True)  # explicit opt-in
    with pytest.raises(ValueError, match="needs enable_kv_events"):
        BlockManagerSettings(kv_events_endpoint="tcp://127.0.0.1:5557", enable_kv_events=False)
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        BlockManagerSettings(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        BlockManagerSettings(kv_events_endpoint="127.0.0.1:5557")


def test_no_endpoint_no_publisher(server_factory) -> None:  # type: ignore[no-untyped-def]
    running = server_factory(num_gpu_blocks=16, block_size=BLOCK_SIZE)
    assert running.kv_events is None
    assert running.servicer._core.pool.events is None  # and the core pays nothing for events


def test_overflow_is_followed_by_all_blocks_cleared() -> None:
    """Events lost to a full queue are never silently skipped: the next batch clears the pool."""
    import sys

    from pagedkv.block_manager_svc.kv_events_zmq import ZmqEventConfig, ZmqKvEventPublisher

    pub = ZmqKvEventPublisher(
        ZmqEventConfig(
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            block_size=BLOCK_SIZE,
            queue_size=16,
        )
    )
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events", MapBatch)
    try:
        time.sleep(0.2)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1.0)  # keep the publisher thread off the GIL while the queue fills
        try:
            for i in range(200):  # 200 stored blocks of one chain, far more than the queue holds
                pub(
                    i + 1,
                    PoolBlockStored(
                        i,
                        (i + 1).to_bytes(16, "big"),
                        i.to_bytes(16, "big") if i else None,
                        array("I", [i] * BLOCK_SIZE),
                    ),
                )
        finally:
            sys.setswitchinterval(interval)
        assert pub.num_lost_events > 0
        deadline = time.monotonic() + 5
        while pub._lost and time.monotonic() < deadline:
            time.sleep(0.01)
        pub(
            500, PoolBlockStored(7, (500).to_bytes(16, "big"), None, array("I", [9] * BLOCK_SIZE))
        )  # after recovery
        sub.drain()
        assert sub.num_cleared == 2  # the publisher's first batch, then the one after the overflow
        assert set(sub.index) == {500}  # what was known before the loss is forgotten, not kept stale
        assert sub.last_seq + 1 == pub.num_batches
    finally:
        sub.close()
        pub.close()
