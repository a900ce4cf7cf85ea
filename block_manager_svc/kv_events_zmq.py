"""KV events over ZeroMQ in vLLM's wire format, for routers built for vLLM (docs/deploy.md).

llm-d's KV-cache indexer, Dynamo's KV router and other cache-aware routers
subscribe to every model server's KV events with a ZeroMQ SUB socket and
decode vLLM's format. Publishing the same format lets them route across
pagedkv pools unchanged. The facts of the format (taken from vLLM's
``vllm/distributed/kv_events.py`` and its ``kv_events_subscriber`` example):

- PUB socket; every message is three frames: topic (utf-8), an 8-byte
  big-endian sequence number (0, 1, 2, ... per publisher), the msgpack batch.
- The batch is the array ``[timestamp, [events...], data_parallel_rank]``.
- Events are tagged: ``BlockStored{block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium}``, ``BlockRemoved{block_hashes, medium}``,
  ``AllBlocksCleared{}``. vLLM since PR #42892 encodes each event as a map
  with a ``"type"`` key; older releases as a positional array whose first item
  is the tag. ``kv_events_encoding`` picks one (map by default).
- Block hashes are unsigned 64-bit ints (vLLM's default external hash): here
  the last 8 bytes, big-endian, of pagedkv's 128-bit chain hash.
- A ROUTER socket serves replays: a client sends the first sequence number it
  missed (8 bytes big-endian) and gets ``[seq, payload]`` for each buffered
  batch from there on, then ``[-1 as 8 signed bytes, b""]`` as the end marker.

Events come from the block manager's EventHub (block_manager_svc/events.py)
as a sink: called under the state lock, so it only appends to a bounded
queue; one thread owns both sockets (ZeroMQ sockets are not thread-safe),
batches whatever is queued (a chain of stored blocks becomes one BlockStored,
as vLLM sends per step), publishes and services replays. If the queue
overflows, the events in between are lost: the next batch starts with
AllBlocksCleared, so subscribers forget this pool's blocks instead of keeping
a wrong view (they relearn as blocks are stored; routing is only less
informed meanwhile). The first batch after start is AllBlocksCleared too: a
restarted block manager tells routers to drop what they knew of it.

There is no TLS in ZeroMQ's plain TCP transport: like plaintext gRPC, a
non-loopback endpoint (``tcp://*:5557`` binds every interface) needs
``allow_insecure`` (checked in ``check_endpoint``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import structlog
import zmq

from pagedkv import defaults
from pagedkv.block_manager_svc.core.kv_events import (
    ALL_BLOCKS_CLEARED,
    AllBlocksCleared,
    BlockStored,
    PoolEvent,
)
from pagedkv.tls import is_loopback

log = structlog.get_logger("pagedkv.block_manager")

MEDIUM = "GPU"  # pagedkv's prefix cache lives in the GPU pool; CPU-swapped blocks are not cached hits
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_LOST = object()  # queue marker: events were dropped before this point


def external_hash(h: bytes) -> int:
    """pagedkv's 16-byte chain hash as vLLM's external (uint64) block hash."""
    return int.from_bytes(h[-8:], "big")


def check_endpoint(endpoint: str, allow_insecure: bool) -> None:
    """Refuse a plaintext endpoint beyond loopback unless allowed; ValueError says why."""
    parts = urlsplit(endpoint)
    if parts.scheme == "ipc" or parts.scheme == "inproc":
        return
    if parts.scheme != "tcp" or not parts.netloc or ":" not in parts.netloc:
        raise ValueError(f"KV-event endpoint must look like tcp://HOST:PORT, got {endpoint!r}")
    host = parts.netloc.rsplit(":", 1)[0]
    if not allow_insecure and not is_loopback(host):
        raise ValueError(
            f"refusing to publish plaintext KV events on {endpoint!r} (not loopback; '*' means every "
            "interface): ZeroMQ has no TLS here. Use tcp://127.0.0.1:PORT, or pass --allow-insecure "
            "(PAGEDKV_ALLOW_INSECURE=true) on a network you trust"
        )


@dataclass(slots=True)
class ZmqEventConfig:
    """What the publisher needs from the block manager's settings."""

    endpoint: str
    replay_endpoint: str = ""
    topic: str = "kv-events"
    block_size: int = defaults.BLOCK_SIZE
    encoding: str = "map"  # "map" (vLLM >= PR #42892) or "array" (older vLLM)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark (messages)
    queue_size: int = 100_000  # events buffered between the state lock and the thread
    max_batch_events: int = 1024  # events per published batch at most
    data_parallel_rank: int = 0  # one pool is one engine: always rank 0


class ZmqKvEventPublisher:
    """A sink for the EventHub that publishes vLLM-format batches on ZeroMQ."""

    def __init__(self, config: ZmqEventConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue[Any] = queue.Queue(config.queue_size)
        self._lost = False  # set under the state lock when the queue overflowed
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode()
        self._next_seq = 0
        self.num_batches = 0
        self.num_lost_events = 0
        self._stop = threading.Event()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = ""
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"cannot bind KV-event endpoint: {e}") from e
        # Subscribers must forget what they knew of this pool (a restart, or a new pool).
        self._queue.put_nowait((0, ALL_BLOCKS_CLEARED))
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    # --- the hub's side (under the state lock: never blocks) -------------------------------
    def __call__(self, version: int, event: PoolEvent) -> None:
        if self._lost:
            self.num_lost_events += 1
            return
        try:
            self._queue.put_nowait((version, event))
        except queue.Full:
            self._lost = True
            self.num_lost_events += 1

    # --- the publisher thread ----------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._lost:
                    self._recover()
                continue
            items = [first]
            while len(items) < self.config.max_batch_events:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._publish(self._events(items))
            if self._lost and self._queue.empty():
                self._recover()
        # Drain what is queued so a clean stop loses nothing.
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if items:
            self._publish(self._events(items))

    def _recover(self) -> None:
        """After an overflow: subscribers drop this pool's blocks and relearn them."""
        self._lost = False
        log.warning("kv_events_overflow", lost_events=self.num_lost_events, queue_size=self.config.queue_size)
        self._publish([self._cleared()])

    def _events(self, items: list[tuple[int, PoolEvent]]) -> list[Any]:
        """Coalesce consecutive stored blocks of one chain, and consecutive removals."""
        out: list[Any] = []
        run_kind = ""  # "stored" or "removed"
        hashes: list[int] = []
        tokens: list[int] = []
        parent: bytes | None = None
        last: bytes | None = None

        def flush() -> None:
            if run_kind == "stored":
                out.append(self._stored(hashes, parent, tokens))
            elif run_kind == "removed":
                out.append(self._removed(hashes))

        for _version, ev in items:
            if isinstance(ev, AllBlocksCleared):
                flush()
                run_kind, hashes, tokens = "", [], []
                out.append(self._cleared())
                continue
            stored = isinstance(ev, BlockStored)
            kind = "stored" if stored else "removed"
            par = ev.parent_hash if isinstance(ev, BlockStored) else None
            if kind != run_kind or (stored and par != last):
                flush()
                run_kind, hashes, tokens, parent = kind, [], [], par
            hashes.append(external_hash(ev.block_hash))
            if isinstance(ev, BlockStored) and ev.token_ids is not None:
                tokens.extend(ev.token_ids)
            last = ev.block_hash
        flush()
        return out

    def _stored(self, hashes: list[int], parent: bytes | None, tokens: list[int]) -> Any:
        p = external_hash(parent) if parent is not None else None
        bs = self.config.block_size
        if self.config.encoding == "array":
            return ["BlockStored", hashes, p, tokens, bs, None, MEDIUM]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": p,
            "token_ids": tokens,
            "block_size": bs,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }

    def _removed(self, hashes: list[int]) -> Any:
        if self.config.encoding == "array":
            return ["BlockRemoved", hashes, MEDIUM]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}

    def _cleared(self) -> Any:
        return ["AllBlocksCleared"] if self.config.encoding == "array" else {"type": "AllBlocksCleared"}

    def _publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = self._encoder.encode([time.time(), events, self.config.data_parallel_rank])
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError as e:  # a full HWM drops silently on PUB; anything else is logged
            log.warning("kv_events_publish_failed", seq=seq, error=str(e))
        self._buffer.append((seq, payload))
        self.num_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            if len(frames) >= 2:
                self._replay.send_multipart((frames[0], b"", END_SEQ, b""))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in tuple(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    # --- lifecycle -----------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
