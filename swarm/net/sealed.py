"""Sealed records for the bulk side channel: a TLS 1.3 handshake, then AES-256-GCM records of up
to 1 MiB with keys that only this handshake's two ends know (docs/security.md, "The bulk channel's
sealed records").

Python's `ssl` moves bulk data at a fraction of what AES-GCM itself costs: 16 KiB TLS records,
each copied through memory BIOs, several loop callbacks per record (BENCHMARKS.md, "Transport
security"). So the bulk channel uses TLS only to authenticate the callee and to agree on keys:

1. the caller runs a TLS 1.3 handshake over the TCP connection, verifying the callee's
   PeerID-bound certificate (`swarm.net.tls`), exactly as before;
2. inside that TLS session the caller sends 32 random bytes, then the callee sends 32 random
   bytes; nothing else ever travels as TLS;
3. both derive, with HKDF-SHA256 over both random strings and the SHA-256 of the callee's
   certificate, one AES-256-GCM key per direction;
4. from then on the TCP connection carries records: a 4-byte little-endian length `L`, then `L`
   bytes of AES-GCM ciphertext and tag. The nonce of a direction's n-th record is n (96 bits,
   big-endian), never sent: a record that was altered, replayed, reordered or dropped fails its
   tag, and the connection is aborted before any of its plaintext is handed on. The length
   prefix is the record's associated data.

`SealedProtocol` is the asyncio protocol on the TCP connection; it hands the plaintext on to an
inner `asyncio.BufferedProtocol` (the bulk channel's `FrameConnection`) and is that protocol's
transport, so the framing above it is the same with or without TLS. The end of a stream is the
sealed END or ERROR frame of that framing: a connection cut before it is an error to the reader.

Where the process may use more than 2 cores, records of at least 64 KiB are sealed and opened on
worker threads (`cryptography` releases the GIL inside AES-GCM), so a peer's loop keeps reading,
writing and answering while the cipher runs (`OFF_LOOP`; benchmarks/history/BENCHMARKS-2026-12-05.md, "Sealing and opening off
the event loop"); on 2 cores or fewer the loop's thread does it, which costs less CPU. The loop still
decides everything: it reserves each record's nonce in order, sends sealed records in that
order, hands an opened record to the inner protocol only after its tag verified, and opens one
record of a direction at a time, in the order received.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import os
import ssl
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.net.frames import FrameConnection

RECORD_BYTES = 1 << 20      # most plaintext bytes in one record
RANDOM_BYTES = 32           # each side's key material, sent inside TLS
_TAG = 16
_LENGTH = struct.Struct("<I")
_HANDSHAKE_READ = 1 << 14
_HANDSHAKE_LIMIT = 1 << 16  # bytes a peer may send before the keys are agreed
_KDF_INFO = b"swarm bulk sealed records v1"
T = TypeVar("T")
_MAX_RECORDS = 1 << 64      # nonces of one direction (never reached: 2^64 MiB)
_POOL = 8                   # record buffers kept for reuse per connection


def _spare_cores() -> bool:
    """Whether this process may run on more than 2 cores. The workers cost CPU (records change
    cores, threads wake): on 2 cores, where a trainer's loop and its training thread already keep
    both busy, a round on loopback took 0.41 s with records on the loop's thread against 0.49 s
    on workers (benchmarks/history/BENCHMARKS-2026-12-05.md, "Sealing and opening off the event loop"). A container's CPU quota
    is not seen here, only its affinity."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores > 2


OFF_LOOP = _spare_cores()   # seal and open large records on worker threads (SealedProtocol's default)
_OFF_LOOP_BYTES = 1 << 16   # smaller records are sealed and opened on the loop's thread
_SEAL_AHEAD = 2 * RECORD_BYTES  # bytes written but not yet sealed above which the writer pauses
_OPEN_AHEAD = 2             # received records waiting to be opened, at most, before reading pauses
_WORKERS = 2                # sealing and opening threads of the process
_FREE_BUFFERS = 16          # record buffers the process keeps for its connections' next records
_BUFFER_BYTES = RECORD_BYTES + 4 + _TAG
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_free: list[memoryview] = []
_free_lock = threading.Lock()


class SealedError(ConnectionError):
    """The other side's records failed authentication, or it broke the handshake."""


def derive_keys(key_material: bytes, callee_certificate: bytes) -> tuple[bytes, bytes]:
    """(caller->callee key, callee->caller key) of one connection, from the caller's fresh random
    bytes and the DER of the certificate the callee proved in this TLS session."""
    if len(key_material) != RANDOM_BYTES:
        raise ValueError("bad key material length")
    info = _KDF_INFO + hashlib.sha256(callee_certificate).digest()
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=info).derive(key_material)
    return okm[:32], okm[32:]


def _nonce(n: int) -> bytes:
    return n.to_bytes(12, "big")


def _workers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that seal and open large records, shared by every connection of the process;
    made on the first such record (a peer that never moves bulk data over TLS starts none)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="swarm-seal")
        return _executor


def stop_workers() -> None:
    """Stops the sealing threads once their work is done (the last peer of the process left: a
    notebook that leaves the swarm keeps no swarm thread). A later record starts them again."""
    global _executor
    with _executor_lock:
        executor, _executor = _executor, None
    if executor is not None:
        executor.shutdown(wait=True)  # jobs are pure cipher work: they end without the loop


def _submit(fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
    """`fn(*args)` on a worker; right here once the workers are gone (the interpreter is exiting)."""
    try:
        return _workers().submit(fn, *args)
    except RuntimeError:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - to whoever waits on it, as from a worker
            done.set_exception(e)
        return done


def _record_buffer() -> memoryview:
    """A buffer for one record, sent or received: a free one, or a new one that is not zero-filled
    first (every byte of a record is written before it is read)."""
    with _free_lock:
        if _free:
            return _free.pop()
    try:
        import numpy  # imported on the first record buffer: a peer that never needs one does not pay it
    except ImportError:  # an infrastructure install (numpy comes with the torch extra): zero-filled
        return memoryview(bytearray(_BUFFER_BYTES))
    return numpy.empty(_BUFFER_BYTES, dtype=numpy.uint8).data


def _recycle(buffers: list[memoryview]) -> None:
    """Keeps buffers that nothing refers to any more for later records (up to `_FREE_BUFFERS`)."""
    with _free_lock:
        _free.extend(buffers[:max(0, _FREE_BUFFERS - len(_free))])


class Sealer:
    """One direction's sending side: seals plaintext into records with consecutive nonces."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._next = 0

    def take(self) -> int:
        """The next record's nonce, reserved for `seal_at` (records are then sealed in any order,
        on any thread, but must be sent in the order of their nonces)."""
        if self._next >= _MAX_RECORDS:
            raise SealedError("nonces of this connection are used up")
        n, self._next = self._next, self._next + 1
        return n

    def seal(self, plaintext: bytes | memoryview, out: memoryview | bytearray | None = None) -> bytes | memoryview:
        """The record (length prefix, ciphertext, tag) of `plaintext`, written into `out` when it is
        given (at least `len(plaintext) + 20` bytes; the record is its prefix) or returned as bytes."""
        if len(plaintext) > RECORD_BYTES:
            raise ValueError("record too large")
        return self.seal_at(self.take(), plaintext, out)

    def seal_at(self, n: int, plaintext: bytes | memoryview, out: memoryview | bytearray | None = None,
                ) -> bytes | memoryview:
        """`seal` with the nonce `n` from `take` (runs on any thread: the cipher releases the GIL)."""
        size = len(plaintext)
        if size > RECORD_BYTES:
            raise ValueError("record too large")
        nonce = _nonce(n)
        header = _LENGTH.pack(size + _TAG)
        if out is None:
            return header + self._aead.encrypt(nonce, plaintext, header)
        view = memoryview(out)
        view[:4] = header
        self._aead.encrypt_into(nonce, plaintext, header, view[4:4 + size + _TAG])
        return view[:4 + size + _TAG]


class Opener:
    """One direction's receiving side: opens records in order, failing on anything else."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._next = 0

    def take(self) -> int:
        """The next record's nonce, for `open_at`."""
        n, self._next = self._next, self._next + 1
        return n

    def open_into(self, header: bytes, record: bytes | memoryview, out: memoryview) -> None:
        """Authenticates the ciphertext+tag `record` received after `header` and writes its
        plaintext into `out` (`len(record) - 16` bytes); raises `SealedError` on a bad tag."""
        self.open_at(self.take(), header, record, out)

    def open_at(self, n: int, header: bytes, record: bytes | memoryview, out: memoryview) -> None:
        """`open_into` with the nonce `n` from `take` (runs on any thread)."""
        try:
            self._aead.decrypt_into(_nonce(n), record, header, out)
        except InvalidTag:
            raise SealedError("a bulk record failed authentication (altered, replayed, reordered or cut)") from None


class SealedProtocol(asyncio.BufferedProtocol):
    """The TCP side of a sealed bulk connection; the transport of `inner` once the keys are agreed.

    Args:
        inner: the protocol that receives the plaintext (a `FrameConnection`).
        context: the TLS context (`swarm.net.tls.client_context` or `server_context`).
        server_side: the callee's end.
        server_hostname: the name the caller's context checks.
        certificate: the callee's own certificate (DER), on the callee's end.
        off_loop: seal and open records of at least `_OFF_LOOP_BYTES` on worker threads while
            the loop keeps moving bytes (None: the module's `OFF_LOOP`); False does every record
            on the loop's thread, as the channel did before.

    `ready` resolves once the handshake and the key agreement are done (the inner protocol is then
    connected), or fails with the handshake's error (`ssl.SSLCertVerificationError` when the
    callee does not prove the PeerID).

    Off the loop, records still go out in the order of their nonces and reach the inner protocol in
    the order they arrived, each only once its tag checked: a sending direction keeps at most
    `_SEAL_AHEAD` bytes written but not yet sealed (the inner protocol's writing pauses above
    that), a receiving one opens one record at a time while it reads up to `_OPEN_AHEAD` more
    (reading pauses when they are all full), and an end of the connection reaches the inner
    protocol after the records received before it.
    """

    def __init__(self, inner: FrameConnection, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | bytes | None = None, certificate: bytes = b"", off_loop: bool | None = None) -> None:
        self.inner = inner  # this object is its transport (a `swarm.net.frames.RecordLayer`)
        self._certificate = certificate
        self.server_side = server_side
        self.off_loop = OFF_LOOP if off_loop is None else off_loop
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved by whoever waits
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls: ssl.SSLObject | None = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                                           server_hostname=server_hostname)
        self._handshake_buffer = bytearray(_HANDSHAKE_READ)
        self._handshake_bytes = 0
        self._handshaken = False
        self._key_material = b"" if server_side else os.urandom(RANDOM_BYTES)
        self._transport: Any = None  # the TCP transport: asyncio's or uvloop's (no asyncio.Transport subclass)
        self._sealer: Sealer | None = None
        self._opener: Opener | None = None
        self._closing = False   # no more writes (the inner protocol closed or aborted, or a record failed)
        self._aborted = False   # what is still being sealed or opened is dropped
        self._lost = False      # the TCP connection is gone
        self._told = False      # the inner protocol got its connection_lost
        self._lost_error: Exception | None = None
        self._eof = False       # the other side's EOF, held back until the records before it are handed on
        self._close_sealed = False  # close the TCP connection once the records being sealed are sent
        # receiving: the length prefix, then the record
        self._header = bytearray(4)
        self._record: memoryview | None = memoryview(bytearray())  # allocated once the keys are agreed (a stranger costs no MiB)
        self._record_view = memoryview(self._record)
        self._plain_buffer: memoryview | None = None  # for records bound for a consumer's buffer
        self._want = 0  # the record's length once its prefix is in; 0 while reading the prefix
        self._got = 0
        # off the loop: records received and waiting (prefix, ciphertext, the buffer to reuse)
        self._opening: collections.deque[tuple[bytes, bytes | memoryview, memoryview | None]] = collections.deque()
        self._open_job: concurrent.futures.Future[None] | None = None
        self._open_target: tuple[bool, memoryview, int] = (True, memoryview(b""), 0)
        self._spare: list[memoryview] = []
        self._record_buffers = 0
        self._reading_full = False    # every record buffer waits to be opened
        self._inner_read_paused = False
        self._read_paused = False
        # sending: record buffers, reused once the socket took every byte of theirs
        self._pool: list[tuple[memoryview, int]] = []
        self._written = 0
        # off the loop: records in nonce order (the sealing job or the record, its buffer)
        self._sealing: collections.deque[
            tuple[concurrent.futures.Future[bytes | memoryview] | None, bytes | memoryview | None, memoryview | None]] = (
            collections.deque())
        self._unsealed = 0
        self._transport_write_paused = False
        self._inner_write_paused = False
        self._sealing_full = False  # more than _SEAL_AHEAD bytes unsealed, until half of them are sent
        self._woken = False  # a call of `_finished` is on its way to the loop
        self._extra: dict[str, object] = {}

    # -- the TCP side ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._extra = {"peername": transport.get_extra_info("peername"),
                       "sockname": transport.get_extra_info("sockname"),
                       "socket": transport.get_extra_info("socket")}
        if not self.server_side:
            self._step()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sealer is None:
            return memoryview(self._handshake_buffer)
        if self._want == 0:
            return memoryview(self._header)[self._got:]
        if self._record is None:  # read past a pause: one more buffer rather than lose the bytes
            self._new_record_buffer()
        return self._record_view[self._got:self._want]

    def buffer_updated(self, nbytes: int) -> None:
        if self._sealer is None:
            self._handshake_bytes += nbytes
            if self._handshake_bytes > _HANDSHAKE_LIMIT:
                self._fail(SealedError("too many bytes before the bulk keys were agreed"))
                return
            self._incoming.write(memoryview(self._handshake_buffer)[:nbytes])
            self._step()
            return
        self._got += nbytes
        self._records()

    def _records(self) -> None:
        if self._want == 0:
            if self._got < 4:
                return
            (length,) = _LENGTH.unpack(self._header)
            if not _TAG <= length <= RECORD_BYTES + _TAG:
                self._fail(SealedError(f"bulk record of {length} bytes"))
                return
            self._want, self._got = length, 0
            if self._record is None:
                self._new_record_buffer()
            return
        if self._got < self._want:
            return
        header, length = bytes(self._header), self._want
        self._want = self._got = 0
        record = self._record_view[:length]
        if not self.off_loop or (not self._opening and self._open_job is None and not self._inner_read_paused
                                 and length - _TAG < _OFF_LOOP_BYTES):
            self._deliver(header, record)  # on the loop's thread (off it, nothing waits before this one)
            return
        if length - _TAG < _OFF_LOOP_BYTES:
            self._opening.append((header, bytes(record), None))  # small: copied, the buffer stays
        else:
            self._opening.append((header, record, self._record))
            self._record = None
            if self._spare:
                self._record = self._spare.pop()
                self._record_view = memoryview(self._record)
            elif self._record_buffers >= _OPEN_AHEAD:
                self._reading_full = True  # the next buffer comes back from an opened record
                self._update_reading()
        self._open_next()

    def _new_record_buffer(self) -> None:
        self._record = _record_buffer()
        self._record_view = memoryview(self._record)
        self._record_buffers += 1

    def _target(self, size: int) -> tuple[bool, memoryview]:
        """Where a record of `size` plaintext bytes is opened: straight into the inner protocol's
        buffer when the whole record fits (True), else into the scratch buffer."""
        # The inner protocol's own buffer is handed out only once its frame is complete, and a
        # consumer's (a sink's) frame is handed out only once every byte of it arrived; a record
        # that fails its tag aborts the connection first, so its frame never completes
        # (docs/security.md, "Failure"). Only a record that spans two buffers goes through the
        # scratch buffer.
        target = self.inner.get_buffer(size)
        if len(target) >= size:
            return True, target[:size]
        if self._plain_buffer is None:
            self._plain_buffer = memoryview(bytearray(RECORD_BYTES))
        return False, self._plain_buffer[:size]

    def _deliver(self, header: bytes, record: bytes | memoryview) -> None:
        assert self._opener is not None
        size = len(record) - _TAG
        direct, out = self._target(size)
        try:
            self._opener.open_into(header, record, out)
        except SealedError as e:
            self._fail(e)
            return
        self._hand_on(direct, out, size)

    def _hand_on(self, direct: bool, out: memoryview, size: int) -> None:
        """Tells the inner protocol about a record opened into its buffer, or copies it there."""
        if direct:
            self.inner.buffer_updated(size)
            return
        offset = 0
        while offset < size and not self._closing:  # the inner protocol may abort mid-record
            target = self.inner.get_buffer(size - offset)
            n = min(len(target), size - offset)
            if n == 0:
                break
            target[:n] = out[offset:offset + n]
            offset += n
            self.inner.buffer_updated(n)

    # -- opening off the loop --------------------------------------------------------------------

    def _open_next(self) -> None:
        """Starts opening the oldest waiting record on a worker (the small ones right here)."""
        assert self._opener is not None
        while self._opening and self._open_job is None and not self._aborted and not self._inner_read_paused:
            header, record, _ = self._opening[0]
            size = len(record) - _TAG
            if size < _OFF_LOOP_BYTES:
                self._opening.popleft()
                self._deliver(header, record)
                continue
            direct, out = self._target(size)
            self._open_target = (direct, out, size)
            self._open_job = _submit(self._opener.open_at, self._opener.take(), header, record, out)
            self._open_job.add_done_callback(self._wake)
        if not self._opening and self._open_job is None:
            self._drained()

    def _wake(self, _: object) -> None:  # on a worker's thread, given the finished job's future
        """Has the loop take the finished records (once for the records that finish meanwhile: a
        job's future is done before this runs, so the loop sees it even when it skips the call)."""
        if self._woken:
            return
        self._woken = True
        try:
            self._loop.call_soon_threadsafe(self._finished)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this connection any more

    def _finished(self) -> None:
        self._woken = False
        if self._sealing:
            self._sealed()
        if self._open_job is not None:
            self._opened()

    def _opened(self) -> None:
        job = self._open_job
        if job is None or not job.done():
            return
        self._open_job = None
        if self._aborted:
            return
        _, _, buffer = self._opening.popleft()
        error = job.exception()
        if error is not None:
            self._fail(error if isinstance(error, SealedError) else SealedError(f"opening a bulk record failed: {error}"))
            return
        self._hand_on(*self._open_target)
        self._open_target = (True, memoryview(b""), 0)
        if buffer is not None:
            if self._record is None:
                self._record, self._record_view = buffer, memoryview(buffer)
            else:
                self._spare.append(buffer)
            if self._reading_full:
                self._reading_full = False
                self._update_reading()
        self._open_next()

    def _drained(self) -> None:
        """Every received record was handed on: now the end of the connection, if it came."""
        if self._aborted:
            return
        if self._eof:
            self._eof = False
            if not self.inner.eof_received() and not self._lost:
                self._transport.close()
        if self._lost and not self._told:
            self._told = True
            self.inner.connection_lost(self._lost_error)

    def settle(self) -> None:
        """Waits (on the loop's thread, one record's time at most) until no record is being opened
        into the inner protocol's buffers: called before a consumer takes its buffers back."""
        job = self._open_job
        if job is not None:
            concurrent.futures.wait([job])

    @property
    def pending(self) -> bool:
        """Bytes received that the inner protocol has not been handed yet."""
        return bool(self._opening or self._open_job is not None or self._want or self._got)

    def _update_reading(self) -> None:
        paused = self._inner_read_paused or self._reading_full
        if paused != self._read_paused and self._transport is not None and not self._lost:
            self._read_paused = paused
            self._transport.pause_reading() if paused else self._transport.resume_reading()

    # -- the end of the connection ---------------------------------------------------------------

    def eof_received(self) -> bool:
        if self._sealer is None:
            self._fail(SealedError("the connection closed during the bulk handshake"))
            return False
        if self._opening or self._open_job is not None:
            self._eof = True  # after the records before it (`_drained`)
            return True
        return bool(self.inner.eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost:  # nothing is sent from or received into these any more
            _recycle([buffer for buffer, _ in self._pool] + self._spare)
            self._pool.clear()
            self._spare.clear()
        self._lost, self._lost_error = True, exc
        self._sealing.clear()
        self._unsealed = 0
        if not self.ready.done():
            self.ready.set_exception(exc or SealedError("the connection closed during the bulk handshake"))
        elif self._sealer is not None and not self._told:  # the inner protocol was connected
            if (self._opening or self._open_job is not None) and not self._aborted:
                return  # told once the records received before it are handed on (`_drained`)
            self._told = True
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._transport_write_paused = True
        self._update_writing()

    def resume_writing(self) -> None:
        self._transport_write_paused = False
        self._update_writing()

    def _update_writing(self) -> None:
        if self._unsealed > _SEAL_AHEAD:
            self._sealing_full = True
        elif self._unsealed <= _SEAL_AHEAD // 2:
            self._sealing_full = False
        paused = self._transport_write_paused or self._sealing_full
        if paused != self._inner_write_paused and self._sealer is not None:
            self._inner_write_paused = paused
            self.inner.pause_writing() if paused else self.inner.resume_writing()

    def _fail(self, error: BaseException) -> None:
        self._closing = self._aborted = True
        self._opening.clear()
        self._sealing.clear()
        self._unsealed = 0
        if not self.ready.done():
            self.ready.set_exception(error)
        elif not self._told and self._sealer is not None:
            self._told = True
            self.inner.connection_lost(error if isinstance(error, Exception) else None)
        self._transport.abort()

    # -- the handshake and the key agreement ---------------------------------------------------

    def _step(self) -> None:
        tls = self._tls
        assert tls is not None
        try:
            if not self._handshaken:
                tls.do_handshake()
                self._handshaken = True
                if not self.server_side:
                    tls.write(self._key_material)  # travels with the caller's Finished: no extra round trip
            self._flush()
            if self.server_side:
                material = tls.read(RANDOM_BYTES)
                while len(material) < RANDOM_BYTES:  # one record from an honest caller
                    material += tls.read(RANDOM_BYTES - len(material))
                self._key_material = material
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            self._flush()
            return
        except (ssl.SSLError, ValueError) as e:
            self._flush()  # the alert, if any, so the other side learns why
            self._fail(e if isinstance(e, OSError) else SealedError(f"bulk handshake failed: {e}"))
            return
        der = self._certificate if self.server_side else tls.getpeercert(binary_form=True)
        to_callee, to_caller = derive_keys(self._key_material, der or b"")
        self._sealer = Sealer(to_caller if self.server_side else to_callee)
        self._opener = Opener(to_callee if self.server_side else to_caller)
        leftover = self._incoming.read()  # the records a caller sent right after its key material
        self._tls = None
        self._handshake_buffer = bytearray()
        self._new_record_buffer()
        self.ready.set_result(None)
        self.inner.sealed_by(self)
        view = memoryview(leftover)
        while view and not self.is_closing():
            target = self.get_buffer(len(view))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._transport.write(data)

    # -- the transport the inner protocol sees ------------------------------------------------

    def write(self, data: Any) -> None:
        if self._closing or self._lost:
            return
        sealer = self._sealer
        assert sealer is not None
        view = memoryview(data).cast("B")
        while view:
            chunk, view = view[:RECORD_BYTES], view[RECORD_BYTES:]
            if len(chunk) < 4096:
                record = sealer.seal(chunk)
                if self._sealing:
                    self._sealing.append((None, record, None))  # after the records still being sealed
                else:
                    self._send(record, None)
                continue
            buffer = self._buffer()
            if not self.off_loop or (len(chunk) < _OFF_LOOP_BYTES and not self._sealing):
                self._send(sealer.seal(chunk, buffer), buffer)
                continue
            job = _submit(sealer.seal_at, sealer.take(), chunk, buffer)
            self._sealing.append((job, None, buffer))
            self._unsealed += len(chunk)
            job.add_done_callback(self._wake)
        self._update_writing()

    def _send(self, record: bytes | memoryview, buffer: memoryview | None) -> None:
        self._transport.write(record)
        self._written += len(record)
        if buffer is not None:
            # the socket holds (or copied) every byte of it once the unsent bytes are fewer than
            # the bytes written after it
            self._pool.append((buffer, self._written))

    def _sealed(self) -> None:
        """Sends the records sealed so far, in the order of their nonces."""
        while self._sealing:
            job, record, buffer = self._sealing[0]
            if job is not None:
                if not job.done():
                    break
                error = job.exception()
                if error is not None:
                    self._fail(SealedError(f"sealing a bulk record failed: {error}"))
                    return
                record = job.result()
                self._unsealed -= len(record) - 4 - _TAG
            self._sealing.popleft()
            assert record is not None  # queued with its record, or its job (done) gave one
            self._send(record, buffer)
        if self._close_sealed and not self._sealing:
            self._close_sealed = False
            self._transport.close()
        self._update_writing()

    def _buffer(self) -> memoryview:
        """A record buffer none of whose bytes are still waiting to be sent."""
        sent = self._written - self._transport.get_write_buffer_size()
        if self._pool and self._pool[0][1] <= sent:
            return self._pool.pop(0)[0]  # the pool is in writing order: the oldest is sent first
        if len(self._pool) >= _POOL:
            self._pool.pop(0)  # still referenced by the transport until sent; a fresh one instead
        return _record_buffer()

    def trim(self) -> None:
        """Lets go of the spare record buffers (a kept-alive connection waiting for its next
        stream holds no more than its receive buffer); they are made again as needed."""
        sent = self._written - self._transport.get_write_buffer_size()
        # a buffer the transport still sends from stays alive through it, and is not reused
        _recycle([buffer for buffer, end in self._pool if end <= sent] + self._spare)
        self._pool.clear()
        self._plain_buffer = None
        self._record_buffers -= len(self._spare)
        self._spare.clear()

    def writelines(self, parts: Iterable[Any]) -> None:
        for part in parts:
            self.write(part)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high=high, low=low)

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + self._unsealed

    def pause_reading(self) -> None:
        self._inner_read_paused = True
        self._update_reading()

    def resume_reading(self) -> None:
        self._inner_read_paused = False
        self._update_reading()
        if self._opening and self._open_job is None:
            self._loop.call_soon(self._open_next)  # not from inside the inner protocol's read

    def is_closing(self) -> bool:
        return self._closing or self._lost or bool(self._transport.is_closing())

    def close(self) -> None:
        self._closing = True
        if self._sealing:
            self._close_sealed = True  # once the records being sealed are sent (`_sealed`)
            return
        self._transport.close()

    def abort(self) -> None:
        self._closing = self._aborted = True
        self._opening.clear()
        self._sealing.clear()
        self._unsealed = 0
        self.settle()  # nothing is written into the inner protocol's buffers after this
        self._transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)
