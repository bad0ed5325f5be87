"""Sealed records opened and sealed off the event loop's thread (swarm.net.sealed, `off_loop`):
two real `SealedProtocol`s over a loopback TCP connection after a real TLS handshake carry many
records of every size both ways at once, in order, into a sink's buffers too; an altered or a cut
record still fails the stream before any of its bytes are handed on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import struct

import pytest
from sealed_pair import sealed_pair

from swarm.net import frames, sealed


class _Counted(concurrent.futures.ThreadPoolExecutor):
    """The workers, counting the records handed to them (so a test knows they did the work)."""

    def __init__(self) -> None:
        super().__init__(max_workers=2, thread_name_prefix="test-seal")
        self.jobs = 0

    def submit(self, *args, **kwargs):  # type: ignore[override]
        self.jobs += 1
        return super().submit(*args, **kwargs)


@pytest.fixture
def workers(monkeypatch):
    executor = _Counted()
    monkeypatch.setattr(sealed, "_workers", lambda: executor)
    yield executor
    executor.shutdown(wait=True)


async def _pair(off_loop: bool, sink=None):
    """(caller FrameConnection, caller SealedProtocol, callee FrameConnection, callee
    SealedProtocol, server) after the TLS handshake and the key agreement."""
    return await sealed_pair(sink=sink, off_loop=off_loop)


# sizes around the record size and the off-loop threshold, small frames in between
_SIZES = [5, 1 << 20, 0, 70_000, (1 << 20) + 1, 3, 3 << 20, 65_535, 65_536, 200_000, 1] * 4


@pytest.mark.parametrize("off_loop", [True, False])
def test_many_records_both_ways_arrive_intact_and_in_order(workers, off_loop):
    messages = [os.urandom(size) for size in _SIZES]

    async def send(conn: frames.FrameConnection) -> None:
        for message in messages:
            conn.write_frame(frames.DATA, message)
            await conn.drain()
        conn.write_frame(frames.END)

    async def receive(conn: frames.FrameConnection) -> list[bytes]:
        got = []
        while (frame := await conn.read_frame())[0] == frames.DATA:
            got.append(bytes(frame[1]))
        assert frame[0] == frames.END
        return got

    async def go():
        conn, protocol, callee_conn, callee_protocol, server = await _pair(off_loop)
        try:
            _, _, there, back = await asyncio.wait_for(asyncio.gather(
                send(conn), send(callee_conn), receive(callee_conn), receive(conn)), 60)
            assert there == messages and back == messages
            assert not protocol.pending and not callee_protocol.pending and conn.idle and callee_conn.idle
        finally:
            protocol.abort()
            server.close()

    asyncio.run(go())
    chunks = [min(size - i, sealed.RECORD_BYTES) for size in _SIZES for i in range(0, size, sealed.RECORD_BYTES)]
    large = sum(chunk >= sealed._OFF_LOOP_BYTES for chunk in chunks)
    medium = sum(4096 <= chunk < sealed._OFF_LOOP_BYTES for chunk in chunks)  # sealed there behind a large one
    # every large record sealed on one side and opened on the other by the workers, both ways
    if off_loop:
        assert 4 * large <= workers.jobs <= 4 * large + 2 * medium
    else:
        assert workers.jobs == 0


def test_records_are_opened_off_the_loop_straight_into_a_sinks_buffers(workers):
    size = 5 << 20
    target = bytearray(size)

    def choose(index, length):
        return (memoryview(target)[:length],) if length == size else None

    async def go():
        conn, protocol, callee_conn, _, server = await _pair(True, choose)
        try:
            data = os.urandom(size)
            conn.write_frame(frames.DATA, b"small first")
            conn.write_frame(frames.DATA, data)
            await conn.drain()
            assert await asyncio.wait_for(callee_conn.read_frame(), 10) == (frames.DATA, b"small first")
            _kind, sunk = await asyncio.wait_for(callee_conn.read_frame(), 10)
            assert isinstance(sunk, frames.Sunk) and not sunk.dropped and target == data
        finally:
            protocol.abort()
            server.close()

    asyncio.run(go())
    assert workers.jobs >= 10  # 5 records sealed, 5 opened, by the workers


async def _read_until_broken(conn: frames.FrameConnection) -> tuple[list[bytes], str]:
    got = []
    try:
        while True:
            _kind, payload = await asyncio.wait_for(conn.read_frame(), 10)
            got.append(bytes(payload))
    except frames.BulkProtocolError as e:
        return got, str(e)


def _records(sealer: sealed.Sealer, payload: bytes) -> list[bytes]:
    """One DATA frame as the sealed records a caller sends: the frame's header, then its payload."""
    wire = [sealer.seal(struct.pack("<BI", frames.DATA, len(payload)))]
    wire += [sealer.seal(payload[i:i + sealed.RECORD_BYTES]) for i in range(0, len(payload), sealed.RECORD_BYTES)]
    return wire


@pytest.mark.parametrize("where", [4 + 10, -1])  # a bit of the ciphertext, of the tag
def test_an_altered_large_record_fails_the_stream_before_its_frame_is_handed_on(workers, where):
    good = [os.urandom(1 << 20) for _ in range(3)]

    async def go():
        _conn, protocol, callee_conn, _, server = await _pair(True)
        try:
            # an on-path attacker flips one bit of the last frame's second record
            wire = [record for message in good for record in _records(protocol._sealer, message)]
            wire += _records(protocol._sealer, os.urandom(2 << 20))
            altered = bytearray(wire[-2])
            altered[where] ^= 1
            wire[-2] = bytes(altered)
            protocol._transport.write(b"".join(wire))
            got, error = await _read_until_broken(callee_conn)
            assert got == good  # the frames before it were handed on, nothing of the altered one
            assert error == "a bulk record failed authentication (altered, replayed, reordered or cut)"
        finally:
            protocol.abort()
            server.close()

    asyncio.run(go())
    assert workers.jobs > 0


def test_a_record_cut_short_fails_the_stream_after_the_whole_ones(workers):
    good = [os.urandom(1 << 20) for _ in range(4)]

    async def go():
        _conn, protocol, callee_conn, _, server = await _pair(True)
        try:
            wire = [record for message in good for record in _records(protocol._sealer, message)]
            last = _records(protocol._sealer, os.urandom(1 << 20))
            # the connection ends (the caller's half closed) in the middle of the last record
            protocol._transport.write(b"".join(wire) + last[0] + last[1][:len(last[1]) // 2])
            protocol._transport.write_eof()
            got, error = await _read_until_broken(callee_conn)
            assert got == good and error == "the connection closed mid-stream"
        finally:
            protocol.abort()
            server.close()

    asyncio.run(go())
    assert workers.jobs > 0


def test_records_still_move_once_the_workers_are_gone(monkeypatch):
    """At interpreter exit the workers refuse new records: they are then sealed and opened on the loop."""
    gone = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gone.shutdown()
    monkeypatch.setattr(sealed, "_workers", lambda: gone)
    message = os.urandom(3 << 20)

    async def go():
        conn, protocol, callee_conn, _, server = await _pair(True)
        try:
            conn.write_frame(frames.DATA, message)
            await conn.drain()
            kind, payload = await asyncio.wait_for(callee_conn.read_frame(), 10)
            assert kind == frames.DATA and bytes(payload) == message
        finally:
            protocol.abort()
            server.close()

    asyncio.run(go())


@pytest.mark.parametrize("cores, expected", [(1, False), (2, False), (3, True), (16, True)])
def test_records_go_to_workers_only_where_the_process_has_more_than_two_cores(monkeypatch, cores, expected):
    monkeypatch.setattr(sealed.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert sealed._spare_cores() is expected


def test_without_an_affinity_call_the_core_count_decides(monkeypatch):
    monkeypatch.delattr(sealed.os, "sched_getaffinity")
    monkeypatch.setattr(sealed.os, "cpu_count", lambda: 8)
    assert sealed._spare_cores() is True
    monkeypatch.setattr(sealed.os, "cpu_count", lambda: None)
    assert sealed._spare_cores() is False
