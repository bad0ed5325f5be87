"""The bulk side channel (swarm.net.bulk) between real peers: same results and errors as the gRPC
stream, authenticated through a one-time token, refusing strangers and broken framing, and
falling back to gRPC when the bulk port cannot be reached."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import threading
import time

import pytest
from sealed_pair import sealed_pair

from swarm.core.errors import DeadlineExceeded, InvalidRequest, NotFound, PeerUnreachable
from swarm.net import bulk, sealed, tls
from swarm.net.channels import ChannelConfig
from swarm.net.server import ServerConfig
from swarm.proto import peer_pb2

ECHO = "/test.Bulk/Echo"


def serve_echo(peer, seen: list | None = None, stopped: threading.Event | None = None) -> None:
    """A stream that answers every request with its bytes reversed, then one summary message."""

    async def echo(requests, ctx):
        count = 0
        async for message in requests:
            if bytes(message) == b"fail":
                raise InvalidRequest("asked to fail")
            if bytes(message) == b"stall":
                try:
                    await asyncio.Event().wait()
                finally:
                    if stopped is not None:
                        stopped.set()
            count += 1
            yield bytes(message)[::-1]
        if seen is not None:
            seen.append((ctx.peer_id, ctx.grpc_context is None))
        yield f"{count} from {ctx.peer_id[-6:]}".encode()

    peer.server.add_stream(ECHO, echo, bulk=True)


def call(peer, target, requests, *, bulk_=True, timeout=10.0) -> list[bytes]:
    async def go():
        channel = peer.pool.get(target.addrs[0])
        return [bytes(m) async for m in channel.stream(ECHO, requests, timeout=timeout, bulk=bulk_)]

    return peer.run(go(), timeout=timeout + 5)


def test_bulk_stream_gives_what_the_grpc_stream_gives(make_peer):
    a, b = make_peer(), make_peer()
    seen: list = []
    serve_echo(a, seen)
    big = bytes(range(256)) * 8192  # 2 MiB: larger than the read-ahead limit, so flow control runs
    requests = [b"abc", big, b"", b"xyz"]
    over_bulk = call(b, a, requests)
    over_grpc = call(b, a, requests, bulk_=False)
    assert over_bulk == over_grpc == [b"cba", big[::-1], b"", b"zyx", f"4 from {b.peer_id[-6:]}".encode()]
    # the first call ran on the side channel, the second through gRPC; both know the caller
    assert seen == [(b.peer_id, True), (b.peer_id, False)]
    assert b.pool.get(a.addrs[0]).bulk_reachable is True


def test_bulk_stream_carries_buffers_given_as_tuples_without_joining(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    parts = (b"head-", memoryview(b"0123456789"), bytearray(b"-tail"))
    assert call(b, a, [parts])[0] == b"head-0123456789-tail"[::-1]
    assert call(b, a, [parts], bulk_=False)[0] == b"head-0123456789-tail"[::-1]


def test_client_mode_peer_uses_the_bulk_channel_of_a_server(make_peer):
    a = make_peer()
    c = make_peer(client_mode=True)
    seen: list = []
    serve_echo(a, seen)
    assert call(c, a, [b"hi"]) == [b"ih", f"1 from {c.peer_id[-6:]}".encode()]
    assert seen == [(c.peer_id, True)]


def test_handler_errors_arrive_as_the_same_typed_errors(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    for bulk_ in (True, False):
        with pytest.raises(InvalidRequest, match="asked to fail"):
            call(b, a, [b"ok", b"fail"], bulk_=bulk_)


def test_a_stalled_stream_ends_at_its_deadline_on_both_sides(make_peer):
    a, b = make_peer(), make_peer()
    stopped = threading.Event()
    serve_echo(a, stopped=stopped)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        call(b, a, [b"stall"], timeout=0.5)
    assert time.monotonic() - started < 3.0
    assert stopped.wait(5), "the callee's handler still runs past the stream's deadline"
    assert call(b, a, [b"again"])[0] == b"niaga"  # and it serves the next stream


def test_request_iterator_failure_ends_the_stream_with_that_error(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)

    def requests():
        yield b"one"
        raise ValueError("the caller's data source broke")

    with pytest.raises(ValueError, match="data source broke"):
        call(b, a, requests())


def test_falls_back_to_grpc_when_the_bulk_port_is_unreachable(make_peer):
    a, b = make_peer(), make_peer()
    seen: list = []
    serve_echo(a, seen)
    a.run(a.server.bulk.stop())  # the port stays advertised but nobody listens (a firewall, a container)
    assert call(b, a, [b"hi"]) == [b"ih", f"1 from {b.peer_id[-6:]}".encode()]
    assert seen == [(b.peer_id, False)]
    assert b.pool.get(a.addrs[0]).bulk_reachable is False
    call(b, a, [b"hi"])  # later streams go straight to gRPC
    assert seen[-1] == (b.peer_id, False)


def test_a_bulk_port_that_failed_to_answer_is_tried_again_later(make_peer):
    """A dial lost once (congestion dropped the SYN, found by the network lab) does not send that
    peer's streams over gRPC for good: after `bulk_retry_after` they dial its bulk port again."""
    a = make_peer()
    b = make_peer(channel_config=ChannelConfig(bulk_retry_after=0.05))
    seen: list = []
    serve_echo(a, seen)
    a.run(a.server.bulk.stop())
    call(b, a, [b"hi"])
    assert seen == [(b.peer_id, False)] and b.pool.get(a.addrs[0]).bulk_reachable is False
    a.run(a.server.bulk.start("127.0.0.1", 0, tls.server_context(a.server.certificate)))
    for _ in range(200):  # bounded: each call takes milliseconds, the retry comes after 50 ms
        call(b, a, [b"hi"])
        if seen[-1] == (b.peer_id, True):
            break
    assert seen[-1] == (b.peer_id, True) and b.pool.get(a.addrs[0]).bulk_reachable is True


def test_the_bulk_tls_context_is_made_when_the_first_connection_comes(make_peer):
    """A peer that never receives a bulk connection (a DHT-only daemon) never builds the listener's
    TLS context (OpenSSL's key and certificate code: ~0.9 MB of its memory); the first connection
    builds it, and every later one uses the same."""
    a, b, c = make_peer(), make_peer(), make_peer()
    assert not isinstance(a.server.bulk._ssl, ssl.SSLContext)  # the peer's own listener waits too
    serve_echo(a)
    made: list = []

    def context():
        made.append(1)
        return tls.server_context(a.server.certificate)

    a.run(a.server.bulk.stop())
    a.run(a.server.bulk.start("127.0.0.1", 0, context))
    assert made == []
    assert call(b, a, [b"hi"])[0] == b"ih" and call(c, a, [b"yo"])[0] == b"oy"  # two connections
    assert made == [1] and isinstance(a.server.bulk._ssl, ssl.SSLContext)


def serve_peername(peer, seen: list) -> None:
    """A stream that records the caller's address of its bulk connection, then echoes (reversed)."""

    async def echo(requests, ctx):
        seen.append(ctx.connection.transport.get_extra_info("peername") if ctx.connection is not None else None)
        async for message in requests:
            yield bytes(message)[::-1]

    peer.server.add_stream(ECHO, echo, bulk=True)


@pytest.mark.parametrize("pool", [True, False])
def test_a_clean_stream_leaves_its_connection_for_the_next_stream(make_peer, pool):
    """Streams to one peer reuse a bulk connection (no TCP or TLS handshake, a congestion window
    already open), with every message intact across them; `bulk_pool=False` dials one per stream."""
    a = make_peer()
    b = make_peer(channel_config=ChannelConfig(bulk_pool=pool))
    seen: list = []
    serve_peername(a, seen)
    big = os.urandom(3 << 20)  # several sealed records and frames, past the read-ahead limit
    for requests in ([b"one"], [big, b"x"], [], [b"two", big[:5000]]):
        assert call(b, a, requests) == [bytes(m)[::-1] for m in requests]
    assert None not in seen and len(seen) == 4
    assert len(set(seen)) == (1 if pool else 4)
    kept = b.pool.get(a.addrs[0])._bulk_idle
    assert len(kept) == (1 if pool else 0)
    if pool:  # waiting for its next stream, it holds no spare record buffers (3 MiB were sent)
        assert kept[0][0].transport._pool == [] and kept[0][0].transport._plain_buffer is None


def open_bulk_calls(peer) -> int:
    """OpenBulk calls this peer served so far."""
    stats = peer.server.metrics.methods.get(bulk.OPEN_BULK)
    return 0 if stats is None else int(stats.ok.value + stats.failed.value)


@pytest.mark.parametrize("reopen", [True, False])
def test_later_streams_on_a_kept_connection_start_without_an_openbulk_call(make_peer, reopen):
    """A callee that says so in its OpenBulk answer takes a kept connection's next streams from an
    in-band reopen frame: one OpenBulk call for four streams, one connection, every message intact.
    A callee that does not (`reopen=False`, as a peer of an earlier version answers) gets a token
    asked for every stream, on the same kept connection."""
    a, b = make_peer(), make_peer()
    a.server.bulk.reopen = reopen
    seen: list = []
    serve_peername(a, seen)
    big = os.urandom(3 << 20)
    for requests in ([b"one"], [big, b"x"], [], [b"two", big[:5000]]):
        assert call(b, a, requests) == [bytes(m)[::-1] for m in requests]
    assert len(set(seen)) == 1 and len(seen) == 4
    assert open_bulk_calls(a) == (1 if reopen else 4)


def test_a_reopen_frame_starts_a_stream_only_where_the_connection_carried_its_callers_stream(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    port, token = _token(b, a)
    reopen = bulk.REOPEN_TAG + struct.pack(">d", 5.0) + ECHO.encode()
    # as the first frame (no caller known yet): larger than a token, the connection is cut
    assert sealed_talk(port, [_frame(bulk.DATA, reopen) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b"")],
                       a.peer_id) == b""
    # after a stream of its caller: served, on the same connection
    caller = SealedCaller(port, a.peer_id)
    try:
        caller.send([_frame(bulk.DATA, token) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b"")])
        assert caller.read(streams=1).endswith(_frame(bulk.END, b""))
        caller.send([_frame(bulk.DATA, reopen) + _frame(bulk.DATA, b"yo") + _frame(bulk.END, b"")])
        answer = caller.read(streams=2)
        assert _frame(bulk.DATA, b"oy") in answer and answer.endswith(_frame(bulk.END, b""))
        # one naming a method not served over the bulk channel: closed without an answer
        bad = bulk.REOPEN_TAG + struct.pack(">d", 5.0) + b"/swarm.Peer/Info"
        caller.send([_frame(bulk.DATA, bad) + _frame(bulk.DATA, b"x") + _frame(bulk.END, b"")])
        assert caller.read(streams=3) == answer
    finally:
        caller.close()


def test_both_ends_of_a_bulk_connection_keep_the_kernels_unsent_queue_small(make_peer):
    """TCP_NOTSENT_LOWAT (`bulk.NOTSENT_LOWAT`) on the caller's and the callee's socket, so that
    a stream's writer waits on its own flow's progress (what `swarm.averaging.lockstep` counts)."""
    a, b = make_peer(), make_peer()
    seen: list = []

    async def echo(requests, ctx):
        sock = ctx.connection.transport.get_extra_info("socket")
        seen.append(sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_NOTSENT_LOWAT", 25)))
        async for message in requests:
            yield bytes(message)

    a.server.add_stream(ECHO, echo, bulk=True)
    assert call(b, a, [b"x"]) == [b"x"]
    assert seen == [bulk.NOTSENT_LOWAT] and bulk.NOTSENT_LOWAT > 0
    kept = b.pool.get(a.addrs[0])._bulk_idle[0][0]
    sock = kept.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_NOTSENT_LOWAT", 25)) == bulk.NOTSENT_LOWAT


def test_a_next_stream_sent_right_behind_the_last_ones_end_is_served(make_peer):
    """A caller may send its next token and data in the same packet as the END of its last stream
    (before the callee finished that stream): the token limit applies to the frame after the END
    exactly, not to whatever frame the callee reads when it gets round to it."""
    a, b = make_peer(), make_peer()
    seen: list = []
    serve_echo(a, seen)
    (port, first), (_, second) = _token(b, a), _token(b, a)
    big = os.urandom(1 << 20)
    request = (_frame(bulk.DATA, first) + _frame(bulk.DATA, b"one") + _frame(bulk.END, b"")
               + _frame(bulk.DATA, second) + _frame(bulk.DATA, big) + _frame(bulk.END, b""))
    records = [request[i:i + sealed.RECORD_BYTES] for i in range(0, len(request), sealed.RECORD_BYTES)]
    answer = sealed_talk(port, records, a.peer_id, streams=2)
    assert answer.startswith(_frame(bulk.DATA, b"eno"))
    assert _frame(bulk.DATA, big[::-1]) in answer and answer.endswith(_frame(bulk.END, b""))
    assert len(seen) == 2
    # a frame larger than a token right after an END is refused like a stranger's first frame:
    # the connection is cut (here before the first stream's answer, which was still to come)
    (port, third) = _token(b, a)
    request = (_frame(bulk.DATA, third) + _frame(bulk.END, b"") + _frame(bulk.DATA, b"x" * 100))
    assert sealed_talk(port, [request], a.peer_id, streams=2) == b""


def test_a_failed_stream_does_not_leave_its_connection_for_the_next(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    with pytest.raises(InvalidRequest):
        call(b, a, [b"fail", b"more"])
    assert call(b, a, [b"ok"]) == [b"ko", f"1 from {b.peer_id[-6:]}".encode()]
    assert len(b.pool.get(a.addrs[0])._bulk_idle) == 1  # the one of the clean stream only


def test_a_kept_connection_to_a_restarted_callee_fails_over_to_a_fresh_dial(make_peer):
    """The callee's bulk listener goes away and comes back on the same port (as a restarted peer
    with a fixed `bulk_port`): the kept connection is dead, the next stream dials afresh and works."""
    a, b = make_peer(), make_peer()
    seen: list = []
    serve_peername(a, seen)
    assert call(b, a, [b"one"]) == [b"eno"]
    port = a.server.bulk.port
    a.run(a.server.bulk.stop())  # closes every connection, like a killed process's kernel does
    a.run(a.server.bulk.start("127.0.0.1", port, tls.server_context(a.server.certificate)))
    assert call(b, a, [b"two"]) == [b"owt"]
    assert len(seen) == 2 and seen[0] != seen[1]  # over the bulk channel both times, two connections
    assert b.pool.get(a.addrs[0]).bulk_reachable is True


def test_a_callee_closes_a_kept_connection_after_its_idle_timeout(make_peer):
    a, b = make_peer(), make_peer()
    seen: list = []
    serve_peername(a, seen)
    a.server.bulk.idle_timeout = 0.2
    assert call(b, a, [b"one"]) == [b"eno"]

    async def closed() -> bool:
        tasks = list(a.server.bulk._connections)
        done, _ = await asyncio.wait(tasks, timeout=5) if tasks else (set(), set())
        return len(done) == len(tasks)

    assert a.run(closed(), timeout=10), "the idle connection is still open on the callee"
    assert call(b, a, [b"two"]) == [b"owt"]
    assert len(seen) == 2 and seen[0] != seen[1]


def test_peer_without_a_bulk_channel_is_reached_over_grpc(make_peer):
    a = make_peer(server_config=ServerConfig(bulk=False))
    b = make_peer()
    seen: list = []
    serve_echo(a, seen)
    assert call(b, a, [b"x"])[0] == b"x"
    assert seen == [(b.peer_id, False)] and b.pool.get(a.addrs[0]).bulk_reachable is False


def test_only_registered_streams_get_tokens(make_peer):
    a, b = make_peer(), make_peer()

    async def go():
        channel = b.pool.get(a.addrs[0])
        await channel.unary(bulk.OPEN_BULK, peer_pb2.BulkOpenRequest(method="/swarm.Peer/Info", timeout=5.0))

    with pytest.raises(NotFound, match="not served over the bulk channel"):
        b.run(go())


def _token(b, a) -> tuple[int, bytes]:
    async def go():
        channel = b.pool.get(a.addrs[0])
        opened = await channel.unary(bulk.OPEN_BULK, peer_pb2.BulkOpenRequest(method=ECHO, timeout=5.0),
                                     peer_pb2.BulkOpenResponse)
        return opened.port, opened.token

    return b.run(go())


def _frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<BI", kind, len(payload)) + payload


def _talk(port: int, data: bytes, callee: str) -> bytes:
    """Runs the bulk port's handshake as a caller (TLS 1.3 checking `callee`'s certificate, then the
    key material, `swarm.net.sealed`), sends `data` as sealed records and returns the plaintext of
    every record it answers until it closes."""
    return sealed_talk(port, [data], callee)


class SealedCaller:
    """A caller's end of a bulk connection made by hand: the TLS 1.3 handshake checking `callee`'s
    certificate, then the key material (`swarm.net.sealed`); `send` seals records, `read` returns
    the plaintext the callee answered."""

    def __init__(self, port: int, callee: str) -> None:
        incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls_object = tls.client_context(callee).wrap_bio(incoming, self._outgoing, server_hostname=tls.SERVER_NAME)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        while True:
            try:
                tls_object.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self._outgoing.read())
                incoming.write(self.sock.recv(65536))
        material = os.urandom(sealed.RANDOM_BYTES)
        tls_object.write(material)
        to_callee, to_caller = sealed.derive_keys(material, tls_object.getpeercert(binary_form=True))
        self.sealer, self.opener = sealed.Sealer(to_callee), sealed.Opener(to_caller)
        self.answer = bytearray()
        self._received = bytearray()
        self._offset = 0

    def send(self, records: list[bytes], tamper=None, half_close: bool = False) -> None:
        wire = [self.sealer.seal(record) for record in records]
        if tamper is not None:
            wire = tamper(wire)
        self.sock.sendall(self._outgoing.read() + b"".join(wire))
        if half_close:
            self.sock.shutdown(socket.SHUT_WR)

    def read(self, streams: int = 1) -> bytes:
        """Everything answered so far, once the connection closed or `streams` response streams
        (counted from its start) have ended."""
        try:
            # until it closes, or until the answer's END or ERROR frame (the callee then keeps the
            # connection open for a next stream)
            while not _ended(self.answer, streams) and (chunk := self.sock.recv(65536)):
                self._received += chunk
                while self._offset + 4 <= len(self._received):
                    (length,) = struct.unpack_from("<I", self._received, self._offset)
                    if self._offset + 4 + length > len(self._received):
                        break
                    out = bytearray(length - 16)
                    start = self._offset
                    self.opener.open_into(bytes(self._received[start:start + 4]),
                                          memoryview(self._received)[start + 4:start + 4 + length], memoryview(out))
                    self.answer += out
                    self._offset += 4 + length
        except ConnectionResetError:
            pass  # refused by a reset: what arrived before it is the answer
        return bytes(self.answer)

    def close(self) -> None:
        self.sock.close()


def sealed_talk(port: int, records: list[bytes], callee: str, tamper=None, half_close: bool = False,
                streams: int = 1) -> bytes:
    """`_talk` with the request bytes cut into `records` (each sealed on its own); `tamper(list of
    sealed records)` may alter, drop, reorder or repeat them before they are sent; `half_close`
    ends the caller's side of the TCP connection after them (a cut stream); it reads until the
    connection closes or `streams` response streams have ended."""
    caller = SealedCaller(port, callee)
    try:
        caller.send(records, tamper, half_close)
        return caller.read(streams)
    finally:
        caller.close()


def _ended(answer: bytes, streams: int = 1) -> bool:
    """Whether `answer` holds `streams` whole response streams (each up to an END or ERROR frame)."""
    offset = 0
    while offset + 5 <= len(answer):
        kind, length = struct.unpack_from("<BI", answer, offset)
        if offset + 5 + length > len(answer):
            return False
        if kind in (bulk.END, bulk.ERROR):
            streams -= 1
            if streams == 0:
                return True
        offset += 5 + length
    return False


def test_strangers_and_replayed_tokens_get_nothing(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    port, token = _token(b, a)
    # a made-up token: the connection closes without an answer
    assert _talk(port, _frame(bulk.DATA, b"\x00" * 16) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b""), a.peer_id) == b""
    # the real token works once...
    answer = _talk(port, _frame(bulk.DATA, token) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b""), a.peer_id)
    assert answer.startswith(_frame(bulk.DATA, b"ih"))
    assert f"1 from {b.peer_id[-6:]}".encode() in answer and answer.endswith(_frame(bulk.END, b""))
    # ...and never again
    assert _talk(port, _frame(bulk.DATA, token) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b""), a.peer_id) == b""


def _plain_talk(port: int, data: bytes) -> bytes:
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def test_the_bulk_port_is_tls_only_and_proves_the_callee(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    port, token = _token(b, a)
    # a valid token sent in plaintext is never read: the TLS port answers no frame (a TLS alert at most)
    answer = _plain_talk(port, _frame(bulk.DATA, token) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b""))
    assert _frame(bulk.DATA, b"ih") not in answer and b"from" not in answer
    # a caller that expects another PeerID there refuses the port before sending the token
    async def dial_as_if_b_served_it():
        return await bulk.connect("127.0.0.1", port, token, 5.0, 1 << 20, b.peer_id)

    with pytest.raises(PeerUnreachable, match="is not"):
        b.run(dial_as_if_b_served_it())
    # the token was never presented, so it still works over TLS to the right PeerID
    answer = _talk(port, _frame(bulk.DATA, token) + _frame(bulk.DATA, b"hi") + _frame(bulk.END, b""), a.peer_id)
    assert answer.startswith(_frame(bulk.DATA, b"ih"))


def test_oversized_or_malformed_frames_close_the_connection(make_peer):
    a, b = make_peer(), make_peer()
    serve_echo(a)
    port, _ = _token(b, a)
    # a stranger's first frame may be no larger than a token: 1 GiB is refused before allocating
    assert _talk(port, struct.pack("<BI", bulk.DATA, 1 << 30), a.peer_id) == b""
    # after a valid token: an unknown frame kind, then a frame above the message limit
    port, token = _token(b, a)
    assert _talk(port, _frame(bulk.DATA, token) + _frame(7, b"??"), a.peer_id) == b""
    port, token = _token(b, a)
    assert _talk(port, _frame(bulk.DATA, token) + struct.pack("<BI", bulk.DATA, 1 << 30), a.peer_id) == b""
    # the peer is unharmed
    assert call(b, a, [b"ok"])[0] == b"ko"


class _Watched(bulk.FrameConnection):
    """A FrameConnection that wakes `arrived` whenever bytes land (so a test waits on an event)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.arrived = asyncio.Event()

    def buffer_updated(self, nbytes):
        super().buffer_updated(nbytes)
        self.arrived.set()


async def _connected_pair(sink_choose=None):
    """Two FrameConnections over a real loopback TCP connection; the server's has the sink."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future = loop.create_future()

    def make_server_side():
        conn = _Watched(1 << 20)
        if sink_choose is not None:
            conn.set_sink(sink_choose)
        accepted.set_result(conn)
        return conn

    server = await loop.create_server(make_server_side, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, client = await loop.create_connection(lambda: bulk.FrameConnection(1 << 20), "127.0.0.1", port)
    return server, client, await accepted


def test_sink_receives_payloads_in_place_and_stops_mid_frame_when_detached():
    async def go():
        target = bytearray(8192)
        head = bytearray(4)
        chosen = []

        def choose(index, length):
            chosen.append((index, length))
            return (head, memoryview(target)[: length - 4]) if index in (1, 2) else None

        server, client, conn = await _connected_pair(choose)
        try:
            client.write_frame(bulk.DATA, b"plain message")               # index 0: an ordinary payload
            client.write_frame(bulk.DATA, (b"HDR1", b"\x01" * 8192))       # index 1: into head + target
            assert await conn.read_frame() == (bulk.DATA, b"plain message")
            kind, sunk = await conn.read_frame()
            assert kind == bulk.DATA and isinstance(sunk, bulk.Sunk) and not sunk.dropped and len(sunk) == 8196
            assert bytes(head) == b"HDR1" and target == b"\x01" * 8192
            # index 2: half of it arrives, then the sink is detached: the rest goes nowhere
            payload = b"HDR2" + b"\x02" * 8192
            client.transport.write(struct.pack("<BI", bulk.DATA, len(payload)) + payload[:4100])
            while target[4095] != 2:  # wait until the first half has landed
                conn.arrived.clear()
                await asyncio.wait_for(conn.arrived.wait(), 10)
            conn.detach_sink()
            client.transport.write(payload[4100:])
            client.write_frame(bulk.DATA, b"after")
            kind, sunk = await conn.read_frame()
            assert isinstance(sunk, bulk.Sunk) and sunk.dropped
            assert target[:4096] == b"\x02" * 4096 and target[4096:] == b"\x01" * 4096  # untouched
            assert await conn.read_frame() == (bulk.DATA, b"after")
            assert chosen == [(0, 13), (1, 8196), (2, 8196)]  # detached: not asked about later frames
        finally:
            client.abort()
            server.close()

    asyncio.run(go())


def test_a_sink_that_returns_the_wrong_size_costs_a_copy_not_the_data():
    async def go():
        server, client, conn = await _connected_pair(lambda index, length: (bytearray(length - 1),))
        try:
            client.write_frame(bulk.DATA, b"x" * 5000)
            kind, payload = await conn.read_frame()
            assert kind == bulk.DATA and bytes(payload) == b"x" * 5000
        finally:
            client.abort()
            server.close()

    asyncio.run(go())


# -- sealed records (swarm.net.sealed): what an on-path attacker can do to them ----------------------

def test_sealed_records_open_only_in_order_in_their_direction_and_connection():
    to_callee, to_caller = sealed.derive_keys(b"k" * 32, b"certificate")
    assert to_callee != to_caller  # one key per direction: a record reflected back never opens
    assert sealed.derive_keys(b"k" * 32, b"another certificate") != (to_callee, to_caller)
    sealer = sealed.Sealer(to_callee)
    records = [sealer.seal(m) for m in (b"first", b"second", b"x" * 5000)]

    def opened(key: bytes, wire: list[bytes]) -> list[bytes]:
        opener, out = sealed.Opener(key), []
        for record in wire:
            plain = bytearray(len(record) - 20)
            opener.open_into(record[:4], memoryview(record)[4:], memoryview(plain))
            out.append(bytes(plain))
        return out

    assert opened(to_callee, records) == [b"first", b"second", b"x" * 5000]
    flipped = bytearray(records[1])
    flipped[7] ^= 1
    bad_length = sealed.Sealer(to_callee).seal(b"first")
    bad_length = (len(bad_length) - 3).to_bytes(4, "little") + bad_length[4:]  # the prefix is authenticated too
    for wire in ([records[1], records[0]], [records[0], records[0]], [records[0], bytes(flipped)],
                 [records[0], records[2]], [bad_length]):
        with pytest.raises(sealed.SealedError, match="failed authentication"):
            opened(to_callee, wire)
    with pytest.raises(sealed.SealedError):
        opened(to_caller, records[:1])  # the other direction's key
    with pytest.raises(sealed.SealedError):  # another connection's keys
        opened(sealed.derive_keys(b"j" * 32, b"certificate")[0], records[:1])


def _bulk_records(token: bytes) -> list[bytes]:
    return [_frame(bulk.DATA, token), _frame(bulk.DATA, b"hi"), _frame(bulk.DATA, b"yo"), _frame(bulk.END, b"")]


def test_altered_reordered_replayed_or_cut_records_end_the_stream_and_nothing_is_applied(make_peer):
    a, b = make_peer(), make_peer()
    seen: list = []
    serve_echo(a, seen)
    summary = f"2 from {b.peer_id[-6:]}".encode()
    port, token = _token(b, a)
    answer = sealed_talk(port, _bulk_records(token), a.peer_id)  # untouched: the whole stream
    assert answer == _frame(bulk.DATA, b"ih") + _frame(bulk.DATA, b"oy") + _frame(bulk.DATA, summary) + _frame(bulk.END, b"")
    assert len(seen) == 1

    def flip(wire):
        record = bytearray(wire[1])
        record[-3] ^= 0x40  # one bit of the tag of "hi"
        return [wire[0], bytes(record), *wire[2:]]

    captured: list = []
    attacks = {
        "altered": flip,
        "reordered": lambda wire: [wire[0], wire[2], wire[1], wire[3]],
        "replayed": lambda wire: [wire[0], wire[1], wire[1], wire[2], wire[3]],
        "dropped": lambda wire: [wire[0], wire[2], wire[3]],
        "from another connection": lambda wire: [wire[0], captured[0], wire[2], wire[3]],
    }
    for name, attack in attacks.items():
        port, token = _token(b, a)
        if name == "from another connection":  # a record of an earlier, complete connection
            sealed_talk(port, _bulk_records(token), a.peer_id, tamper=lambda wire: captured.append(wire[1]) or wire)
            port, token = _token(b, a)
        answer = sealed_talk(port, _bulk_records(token), a.peer_id, tamper=attack)
        # the callee aborted at the bad record: nothing of it or after it reached the handler
        assert _frame(bulk.DATA, b"oy") not in answer and summary not in answer, name
        assert answer in (b"", _frame(bulk.DATA, b"ih")), name
    # cut: the END frame's record never comes, or a record stops halfway; the stream does not complete
    for cut in (lambda wire: wire[:3], lambda wire: [wire[0], wire[1][:9]]):
        port, token = _token(b, a)
        answer = sealed_talk(port, _bulk_records(token), a.peer_id, tamper=cut, half_close=True)
        assert summary not in answer and not answer.endswith(_frame(bulk.END, b""))
    assert len(seen) == 2  # the two complete streams only (the untouched one and the one captured)
    assert call(b, a, [b"ok"])[0] == b"ko"  # the peer is unharmed


def test_a_record_altered_on_the_way_back_fails_the_callers_stream(make_peer):
    """The callee's records are checked by the caller as strictly: a proxy on the bulk port that
    flips one byte of what the callee sends makes the caller's call fail, with no response."""
    from proxy import LoopbackProxy

    a, b = make_peer(), make_peer()
    serve_echo(a)
    port, token = _token(b, a)
    passed = 0
    flip_at = 4096  # past the TLS handshake (~1.5 KB), inside the 20 kB echo record

    def flip_down(direction: str, data: bytes) -> bytes:
        nonlocal passed
        if direction == "down" and passed <= flip_at < passed + len(data):
            data = data[:flip_at - passed] + bytes([data[flip_at - passed] ^ 1]) + data[flip_at - passed + 1:]
        passed += len(data) if direction == "down" else 0
        return data

    proxy = LoopbackProxy(("127.0.0.1", port), tamper=flip_down)
    try:
        async def go():
            conn = await bulk.connect("127.0.0.1", proxy.port, token, 5.0, 1 << 20, a.peer_id)
            loop = asyncio.get_running_loop()
            return [bytes(m) async for m in bulk.exchange(conn, [b"x" * 20000], loop.time() + 10, a.peer_id, ECHO)]

        with pytest.raises(PeerUnreachable, match="failed authentication"):
            b.run(go())
    finally:
        proxy.close()


async def _sealed_pair(sink_choose):
    """A caller's and a callee's FrameConnection over a real loopback TCP connection with the TLS
    handshake and sealed records (swarm.net.sealed); the callee's has the sink."""
    caller, caller_side, conn, callee_side, server = await sealed_pair(sink=sink_choose, capacity=1 << 23)
    return server, caller, caller_side, conn, callee_side


def test_sealed_records_bound_for_a_sink_are_opened_straight_into_it():
    """A record that fits the sink's buffer is decrypted there, with no scratch copy; one that
    spans two of its buffers still arrives whole; the sink's frame is handed out only when done."""
    async def go():
        target = bytearray(3 << 20)
        head = bytearray(4)
        server, caller, caller_side, conn, callee_side = await _sealed_pair(
            lambda index, length: (head, memoryview(target)[:length - 4]) if index == 0 else None)
        try:
            payload = os.urandom(3 << 20)
            caller.write_frame(bulk.DATA, (b"HDR1", payload))  # records: header, head, 3 x 1 MiB of payload
            kind, sunk = await asyncio.wait_for(conn.read_frame(), 10)
            assert kind == bulk.DATA and isinstance(sunk, bulk.Sunk) and not sunk.dropped
            assert bytes(head) == b"HDR1" and target == payload
            assert callee_side._plain_buffer is None  # no record went through the scratch buffer
            caller.write_frame(bulk.DATA, b"HDR2" + payload[:100])  # one record for head and target
            _, sunk = await asyncio.wait_for(conn.read_frame(), 10)  # index 1: not sunk
            assert bytes(sunk) == b"HDR2" + payload[:100]
        finally:
            caller_side.abort()
            server.close()

    asyncio.run(go())


def test_a_sealed_record_that_fails_its_tag_never_completes_the_sinks_frame():
    async def go():
        target = bytearray(1 << 20)
        head = bytearray(4)
        server, _, caller_side, conn, _ = await _sealed_pair(
            lambda index, length: (head, memoryview(target)) if index == 0 else None)
        try:
            sealer = caller_side._sealer
            frame_header = struct.pack("<BI", bulk.DATA, 4 + len(target))
            wire = [sealer.seal(frame_header), sealer.seal(b"HDR1"), bytearray(sealer.seal(b"\x07" * len(target)))]
            wire[2][-1] ^= 1  # the tag of the payload's record
            caller_side._transport.write(b"".join(bytes(w) for w in wire))
            with pytest.raises(bulk.BulkProtocolError, match="failed authentication"):
                await asyncio.wait_for(conn.read_frame(), 10)
        finally:
            caller_side.abort()
            server.close()

    asyncio.run(go())
