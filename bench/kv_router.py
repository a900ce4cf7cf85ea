"""Routing across pools by cached-prefix overlap, from each pool's vLLM-format KV events.

A small scorer of the kind llm-d's KV-cache-aware routing uses, for
bench/multipool_bench.py and as a worked example of consuming pagedkv's
ZeroMQ events (docs/deploy.md); not a cluster service.

- ``PoolSubscriber`` subscribes to one pool's KV events (SUB socket, topic of
  the pool), replays missed batches through the pool's replay socket (DEALER
  to the block manager's ROUTER), and keeps that pool's index.
- The index is keyed by the router's own chain key of each block's token ids
  (built from ``token_ids`` and ``parent_block_hash`` in BlockStored), so the
  router never needs the engine's hash function: a request's prompt is cut
  into the same blocks, keyed the same way, and the longest run of leading
  keys present in a pool is that pool's expected prefix hit.
- ``PrefixAwareRouter.pick`` scores each pool like llm-d's default profile:
  prefix overlap (weight 3) plus low load (weight 2), both scaled to [0, 1].
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

ROOT_KEY = 0


class _Event(msgspec.Struct, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def chain_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """The router's key of each full block of `tokens`: a chain over the blocks' token ids."""
    keys = []
    parent = ROOT_KEY
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


@dataclass(slots=True)
class PoolIndex:
    """One pool's cached blocks as the router knows them from its events."""

    keys: set[int] = field(default_factory=set)
    by_engine_hash: dict[int, int] = field(default_factory=dict)  # engine hash -> router key

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = (
                    ROOT_KEY
                    if ev.parent_block_hash is None
                    else self.by_engine_hash.get(ev.parent_block_hash)
                )
                bs = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    if parent is None:  # parent unknown (missed): this chain cannot be keyed
                        break
                    key = hash((parent, tuple(ev.token_ids[i * bs : (i + 1) * bs])))
                    self.by_engine_hash[h] = key
                    self.keys.add(key)
                    parent = key
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    gone = self.by_engine_hash.pop(h, None)
                    if gone is not None:
                        self.keys.discard(gone)
            else:
                self.keys.clear()
                self.by_engine_hash.clear()

    def overlap(self, keys: Sequence[int]) -> int:
        """Leading blocks of a prompt this pool holds."""
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


class PoolSubscriber:
    """Follows one pool's KV events on a background thread (ZeroMQ sockets stay on that thread)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "kv-events",
        context: zmq.Context | None = None,
    ) -> None:
        self.index = PoolIndex()
        self.lock = threading.Lock()
        self.last_seq = -1
        self.num_replayed = 0
        self._ctx = context or zmq.Context.instance()
        self._endpoint, self._replay_endpoint, self._topic = endpoint, replay_endpoint, topic
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-router-sub", daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self._topic)
        sub.connect(self._endpoint)
        replay = None
        if self._replay_endpoint:
            replay = self._ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(self._replay_endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(50):
                    continue
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= self.last_seq:
                    continue
                if seq > self.last_seq + 1 and replay is not None:
                    self._replay(replay, seq)
                self._apply(seq, payload)
        finally:
            sub.close()
            if replay is not None:
                replay.close()

    def _replay(self, replay: zmq.Socket, upto: int) -> None:
        replay.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
        while replay.poll(1000):
            _, seq_bytes, payload = replay.recv_multipart()
            if not payload:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq < seq < upto:
                self._apply(seq, payload)
                self.num_replayed += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        with self.lock:
            self.index.apply(batch)
            self.last_seq = seq

    def overlap(self, keys: Sequence[int]) -> int:
        with self.lock:
            return self.index.overlap(keys)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


class PrefixAwareRouter:
    """Pick a pool by expected prefix hit and load (llm-d-style weighted scorers)."""

    def __init__(
        self,
        pools: Sequence[PoolSubscriber],
        block_size: int,
        prefix_weight: float = 3.0,
        load_weight: float = 2.0,
    ) -> None:
        self.pools = list(pools)
        self.block_size = block_size
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight

    def pick(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """Index of the pool for `prompt`; `loads[i]` = requests in flight on pool i."""
        keys = chain_keys(prompt, self.block_size)
        most = max(loads) if loads else 0
        best, best_score = 0, float("-inf")
        for i, pool in enumerate(self.pools):
            prefix = pool.overlap(keys) / len(keys) if keys else 0.0
            load = 1.0 - (loads[i] / most if most else 0.0)
            score = self.prefix_weight * prefix + self.load_weight * load
            if score > best_score:
                best, best_score = i, score
        return best


class RoundRobinRouter:
    def __init__(self, num_pools: int) -> None:
        self.num_pools = num_pools
        self._next = 0

    def pick(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        i = self._next
        self._next = (i + 1) % self.num_pools
        return i
