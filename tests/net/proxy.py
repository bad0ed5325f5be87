"""A TCP proxy on loopback for transport tests: records every byte each way, may tamper with them.

It runs its own event loop in a thread, so the peers under test see a real separate endpoint.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

Tamper = Callable[[str, bytes], bytes]  # (direction "up" (caller to callee) or "down", bytes) -> bytes


class LoopbackProxy:
    """Listens on `listen_host` (port 0: any free one) and forwards each connection to `target`.

    Attributes:
        up / down: every byte seen caller->callee / callee->caller, over all connections.
        connections: how many connections were accepted.
    """

    def __init__(self, target: tuple[str, int] | None, listen_host: str = "127.0.0.1", port: int = 0,
                 tamper: Tamper | None = None) -> None:
        self.target = target
        self.tamper = tamper
        self.up = bytearray()
        self.down = bytearray()
        self.connections = 0
        self._sock = socket.create_server((listen_host, port))
        self.port: int = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._handle, sock=self._sock)

        self._server = self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        # connections still piping end here, before the loop closes (else each is a "Task was
        # destroyed but it is pending" at the interpreter's exit)
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.target is None:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 5)
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(self._pipe("up", reader, up_writer, self.up),
                             self._pipe("down", up_reader, writer, self.down), return_exceptions=True)

    async def _pipe(self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    record: bytearray) -> None:
        try:
            while data := await reader.read(1 << 16):
                record += data
                if self.tamper is not None:
                    data = self.tamper(direction, data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class RecordFlipper:
    """A `Tamper` that flips one byte inside every TLS application-data record of at least
    `min_length` bytes sent caller->callee (the records of a large request; the handshake and
    HTTP/2 set-up travel in smaller ones). It follows the TLS record layer across reads."""

    def __init__(self, min_length: int = 8192) -> None:
        self.min_length = min_length
        self.flipped = 0
        self._header = bytearray()
        self._left = 0          # payload bytes of the current record still to pass
        self._flip_at = -1      # offset in the current payload to flip (-1: none)
        self._offset = 0

    def __call__(self, direction: str, data: bytes) -> bytes:
        if direction != "up":
            return data
        out = bytearray(data)
        i = 0
        while i < len(out):
            if self._left == 0:
                need = 5 - len(self._header)
                take = out[i:i + need]
                self._header += take
                i += len(take)
                if len(self._header) == 5:
                    kind, length = self._header[0], int.from_bytes(self._header[3:5], "big")
                    self._left, self._offset = length, 0
                    self._flip_at = length // 2 if kind == 23 and length >= self.min_length else -1
                    self._header.clear()
                continue
            take = min(self._left, len(out) - i)
            if 0 <= self._flip_at - self._offset < take:
                out[i + self._flip_at - self._offset] ^= 0x5A
                self.flipped += 1
            self._offset += take
            self._left -= take
            i += take
        return bytes(out)
