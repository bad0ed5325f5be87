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
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RECORD_BYTES = 1 << 20      # most plaintext bytes in one record
RANDOM_BYTES = 32           # each side's key material, sent inside TLS
_TAG = 16
_LENGTH = struct.Struct("<I")
_HANDSHAKE_READ = 1 << 14
_HANDSHAKE_LIMIT = 1 << 16  # bytes a peer may send before the keys are agreed
_KDF_INFO = b"swarm bulk sealed records v1"
_MAX_RECORDS = 1 << 64      # nonces of one direction (never reached: 2^64 MiB)
_POOL = 8                   # record buffers kept for reuse per connection


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


class Sealer:
    """One direction's sending side: seals plaintext into records with consecutive nonces."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._next = 0

    def seal(self, plaintext: Any, out: memoryview | bytearray | None = None) -> Any:
        """The record (length prefix, ciphertext, tag) of `plaintext`, written into `out` when it is
        given (at least `len(plaintext) + 20` bytes; the record is its prefix) or returned as bytes."""
        n = len(plaintext)
        if n > RECORD_BYTES:
            raise ValueError("record too large")
        if self._next >= _MAX_RECORDS:
            raise SealedError("nonces of this connection are used up")
        nonce, self._next = _nonce(self._next), self._next + 1
        header = _LENGTH.pack(n + _TAG)
        if out is None:
            return header + self._aead.encrypt(nonce, plaintext, header)
        view = memoryview(out)
        view[:4] = header
        self._aead.encrypt_into(nonce, plaintext, header, view[4:4 + n + _TAG])
        return view[:4 + n + _TAG]


class Opener:
    """One direction's receiving side: opens records in order, failing on anything else."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._next = 0

    def open_into(self, header: bytes, record: memoryview, out: memoryview) -> None:
        """Authenticates the ciphertext+tag `record` received after `header` and writes its
        plaintext into `out` (`len(record) - 16` bytes); raises `SealedError` on a bad tag."""
        nonce, self._next = _nonce(self._next), self._next + 1
        try:
            self._aead.decrypt_into(nonce, record, header, out)
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

    `ready` resolves once the handshake and the key agreement are done (the inner protocol is then
    connected), or fails with the handshake's error (`ssl.SSLCertVerificationError` when the
    callee does not prove the PeerID).
    """

    def __init__(self, inner: asyncio.BufferedProtocol, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None, certificate: bytes = b"") -> None:
        self.inner: Any = inner  # a FrameConnection; this object is its (duck-typed) transport
        self._certificate = certificate
        self.server_side = server_side
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved by whoever waits
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls: ssl.SSLObject | None = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                                           server_hostname=server_hostname)
        self._handshake_buffer = bytearray(_HANDSHAKE_READ)
        self._handshake_bytes = 0
        self._handshaken = False
        self._key_material = b"" if server_side else os.urandom(RANDOM_BYTES)
        self._transport: Any = None
        self._sealer: Sealer | None = None
        self._opener: Opener | None = None
        self._closing = False
        self._lost = False
        # receiving: the length prefix, then the record
        self._header = bytearray(4)
        self._record = bytearray()  # allocated once the keys are agreed (a stranger costs no MiB)
        self._record_view = memoryview(self._record)
        self._plain_buffer: memoryview | None = None  # for records bound for a consumer's buffer
        self._want = 0  # the record's length once its prefix is in; 0 while reading the prefix
        self._got = 0
        # sending: record buffers, reused once the socket took every byte of theirs
        self._pool: list[tuple[bytearray, int]] = []
        self._written = 0
        self._extra: dict[str, Any] = {}

    # -- the TCP side ------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
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
            return
        if self._got < self._want:
            return
        self._deliver(bytes(self._header), self._record_view[:self._want])
        self._want = self._got = 0

    def _deliver(self, header: bytes, record: memoryview) -> None:
        assert self._opener is not None
        size = len(record) - _TAG
        target = self.inner.get_buffer(size)
        # Straight into the inner protocol's buffer when the whole record fits: its own buffer is
        # handed out only once its frame is complete, and a consumer's (a sink's) frame is handed
        # out only once every byte of it arrived; a record that fails its tag aborts the
        # connection first, so its frame never completes (docs/security.md, "Failure"). Only a
        # record that spans two buffers goes through the scratch buffer.
        direct = len(target) >= size
        if not direct and self._plain_buffer is None:
            self._plain_buffer = memoryview(bytearray(RECORD_BYTES))
        out = target[:size] if direct else self._plain_buffer[:size]  # type: ignore[index]
        try:
            self._opener.open_into(header, record, out)
        except SealedError as e:
            self._fail(e)
            return
        if direct:
            self.inner.buffer_updated(size)
            return
        offset = 0
        while offset < size and not self.is_closing():  # the inner protocol may abort mid-record
            if offset:
                target = self.inner.get_buffer(size - offset)
            n = min(len(target), size - offset)
            if n == 0:
                break
            target[:n] = out[offset:offset + n]
            offset += n
            self.inner.buffer_updated(n)

    def eof_received(self) -> bool:
        if self._sealer is None:
            self._fail(SealedError("the connection closed during the bulk handshake"))
            return False
        return bool(self.inner.eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        lost, self._lost = self._lost, True
        if not self.ready.done():
            self.ready.set_exception(exc or SealedError("the connection closed during the bulk handshake"))
        elif self._sealer is not None and not lost:  # the inner protocol was connected
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._sealer is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._sealer is not None:
            self.inner.resume_writing()

    def _fail(self, error: BaseException) -> None:
        self._closing = True
        if not self.ready.done():
            self.ready.set_exception(error)
        elif not self._lost and self._sealer is not None:
            self._lost = True
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
        self._record = bytearray(RECORD_BYTES + _TAG)
        self._record_view = memoryview(self._record)
        self.ready.set_result(None)
        self.inner.connection_made(self)
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
        assert self._sealer is not None
        view = memoryview(data).cast("B")
        while view:
            chunk, view = view[:RECORD_BYTES], view[RECORD_BYTES:]
            if len(chunk) < 4096:
                record = self._sealer.seal(chunk)
                self._transport.write(record)
                self._written += len(record)
                continue
            buffer = self._buffer()
            record = self._sealer.seal(chunk, buffer)
            self._transport.write(record)
            self._written += len(record)
            # the socket holds (or copied) every byte of it once the unsent bytes are fewer than
            # the bytes written after it
            self._pool.append((buffer, self._written))

    def _buffer(self) -> bytearray:
        """A record buffer none of whose bytes are still waiting to be sent."""
        sent = self._written - self._transport.get_write_buffer_size()
        if self._pool and self._pool[0][1] <= sent:
            return self._pool.pop(0)[0]  # the pool is in writing order: the oldest is sent first
        if len(self._pool) >= _POOL:
            self._pool.pop(0)  # still referenced by the transport until sent; a fresh one instead
        return bytearray(RECORD_BYTES + 4 + _TAG)

    def trim(self) -> None:
        """Lets go of the spare record buffers (a kept-alive connection waiting for its next
        stream holds no more than its receive buffer); they are made again as needed."""
        self._pool.clear()  # a buffer the transport still sends from stays alive through it
        self._plain_buffer = None

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.write(part)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high=high, low=low)

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size())

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_closing(self) -> bool:
        return self._closing or self._lost or bool(self._transport.is_closing())

    def close(self) -> None:
        self._closing = True
        self._transport.close()

    def abort(self) -> None:
        self._closing = True
        self._transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)
