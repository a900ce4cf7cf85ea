"""A TCP proxy between two roles that a test can make misbehave like a real network does.

``LinkProxy(target).start()`` listens on 127.0.0.1 (``.port``) and forwards every connection to
``target`` on an asyncio loop in a thread of its own. Then, while requests run:

- ``blackhole()``: a partition. Connections are accepted and nothing is answered: bytes in both
  directions are held (and TCP backpressure builds) until ``heal()`` delivers them, as TCP
  retransmission does when a link comes back.
- ``halfopen()``: the connections open now go silent for good (bytes swallowed, never closed), as
  when the peer's host vanished without a FIN; new connections work. Only keepalive or a deadline
  can tell.
- ``drop()``: every open connection is reset, and new ones are refused until ``heal()``.
- ``delay_s``: added to every chunk in both directions.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Conn:
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    silent: bool = False

    def abort(self) -> None:
        for w in self.writers:
            w.transport.abort()


class LinkProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target_host, self.target_port = host, int(port)
        self.delay_s = 0.0
        self.port = 0
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-proxy", daemon=True)
        self._open = asyncio.Event()  # set: bytes flow; clear: black-holed
        self._refusing = False
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None

    def start(self) -> LinkProxy:
        self._thread.start()
        self._run(self._start())
        return self

    async def _start(self) -> None:
        self._open.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    # --- faults ----------------------------------------------------------------------------
    def blackhole(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        def heal() -> None:
            self._refusing = False
            self._open.set()

        self._loop.call_soon_threadsafe(heal)

    def halfopen(self) -> None:
        def silence() -> None:
            for c in self._conns:
                c.silent = True

        self._loop.call_soon_threadsafe(silence)

    def drop(self) -> None:
        def drop() -> None:
            self._refusing = True
            for c in list(self._conns):
                c.abort()

        self._loop.call_soon_threadsafe(drop)

    # --- forwarding ---------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self._refusing:
            writer.transport.abort()
            return
        await self._open.wait()  # black-holed: accepted, never answered
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        conn = _Conn([writer, up_writer])
        self._conns.add(conn)
        try:
            await asyncio.gather(self._pump(reader, up_writer, conn), self._pump(up_reader, writer, conn))
        finally:
            self._conns.discard(conn)
            conn.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await self._open.wait()
                if conn.silent:
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        conn.abort()  # one side closed: so does the other (a half-open one included)

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._conns):
                c.abort()

        self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
