"""State transfer: a newcomer downloads the current tensors (and metadata) from a peer that has them.

`StateServer` serves a snapshot of whatever `get_state()` returns: msgpack-able metadata and a
list of tensors (parameters, optimizer state, ...). `load_state_from_peers` downloads it from one
of several peers into buffers allocated once from the header, and when its source dies
mid-download it continues with another: from the same byte offset if that peer serves the same
`version` of the state (peers that just averaged together hold identical tensors), else from the
start.

Wire: ``State`` (server stream), request `StateRequest(prefix, version, offset)`, answer one
`StateHeader` then the snapshot's bytes from `offset` in ~1 MiB raw chunks.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.averaging.faults import FaultPoint
from swarm.averaging.service import STATE, AveragingService
from swarm.core.errors import AveragingError, ConfigError, InvalidRequest, ResourceExhausted, RPCError
from swarm.core.faults import FaultPlan
from swarm.core.malloc import tune_malloc
from swarm.core.serialization import pack, unpack
from swarm.core.timeutil import get_dht_time
from swarm.dht.expiring import subkey_entries
from swarm.dht.handle import PeerHandle
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

logger = logging.getLogger(__name__)

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
)}


@dataclass(frozen=True)
class State:
    """What a peer serves: metadata (msgpack-able), tensors, and an optional version.

    Peers whose states carry the same `version` must hold identical bytes (for example the id of
    the averaging round they last completed together); a download resumes across them.
    """

    metadata: object
    tensors: Sequence[torch.Tensor]
    version: bytes | None = None


@dataclass(frozen=True)
class DownloadedState:
    """The result of `load_state_from_peers`.

    Attributes:
        metadata: the source's metadata.
        tensors: freshly allocated CPU tensors.
        version: the version downloaded.
        sources: PeerIDs the bytes came from, in order (more than one after a source failed).
    """

    metadata: Any
    tensors: list[torch.Tensor]
    version: bytes
    sources: list[str] = field(default_factory=list)


@dataclass
class _Snapshot:
    version: bytes
    metadata: bytes
    tensors: list[torch.Tensor]
    taken: float

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class StateServer:
    """Serves this peer's state to newcomers under `prefix`.

    Args:
        peer: the local peer (must accept connections).
        prefix: names the state (usually the averager's prefix).
        get_state: returns the current `State`; called in a worker thread (it may take a lock the
            training thread holds, without stalling the peer's loop).
        snapshot_ttl: a snapshot is reused for new downloads for this long (seconds).
        chunk_bytes: size of one stream message.
        announce_ttl: when the peer has a DHT, it declares itself under ``{prefix}.state`` for this long.
        faults: fault plan (`FaultPoint.DURING_STATE_TRANSFER`, count = chunks sent).
    """

    def __init__(
        self, peer: PeerHandle, prefix: str, get_state: Callable[[], State], *, snapshot_ttl: float = 30.0,
        chunk_bytes: int = 1 << 20, announce_ttl: float = 60.0, faults: FaultPlan | None = None,
    ) -> None:
        if peer.server is None:
            raise ConfigError("a client-mode peer cannot serve state")
        if snapshot_ttl < 0 or chunk_bytes < 4096:
            raise ConfigError("need snapshot_ttl >= 0 and chunk_bytes >= 4096")
        self.peer, self.prefix, self.get_state = peer, prefix, get_state
        self.snapshot_ttl, self.chunk_bytes, self.announce_ttl = snapshot_ttl, chunk_bytes, announce_ttl
        self.faults = faults or FaultPlan()
        self._snapshot: _Snapshot | None = None
        self._sent = 0
        AveragingService.of(peer).state_handlers[prefix] = self.rpc_state
        peer.attach(self)

    async def announce(self) -> bool:
        """Declares this peer as a state source in the DHT (no-op without one)."""
        dht = self.peer.dht
        if dht is None or not self.peer.addrs:
            return False
        return bool(await dht.astore(f"{self.prefix}.state", {"addr": self.peer.addrs[0]},
                                     expiration_time=get_dht_time() + self.announce_ttl, subkey=self.peer.peer_id))

    async def ashutdown(self) -> None:
        AveragingService.of(self.peer).state_handlers.pop(self.prefix, None)

    def _take_snapshot(self) -> _Snapshot:
        state = self.get_state()
        tensors = [t.detach().to("cpu", copy=True).contiguous() for t in state.tensors]
        version = state.version or os.urandom(16)
        return _Snapshot(version, pack(state.metadata), tensors, time.monotonic())

    async def _snapshot_for(self, version: bytes) -> _Snapshot | None:
        snap = self._snapshot
        if version:
            return snap if snap is not None and snap.version == version else None
        if snap is None or time.monotonic() - snap.taken > self.snapshot_ttl:
            snap = self._snapshot = await asyncio.to_thread(self._take_snapshot)
        return snap

    async def rpc_state(self, request: averaging_pb2.StateRequest, ctx: CallContext) -> AsyncIterator[bytes]:
        snap = await self._snapshot_for(request.version)
        if snap is None and request.version:
            # the caller resumes a version we do not hold: maybe our current state is that version
            current = await asyncio.to_thread(self._take_snapshot)
            if current.version == request.version:
                snap = self._snapshot = current
        offset = request.offset if snap is not None and request.version == snap.version else 0
        if snap is None:
            snap = await self._snapshot_for(b"")
            assert snap is not None
        if not 0 <= offset <= snap.total_bytes:
            raise InvalidRequest(f"offset {offset} outside a state of {snap.total_bytes} bytes")
        yield averaging_pb2.StateHeader(
            version=snap.version, metadata=snap.metadata, total_bytes=snap.total_bytes, offset=offset,
            tensors=[averaging_pb2.StateTensor(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                     for t in snap.tensors],
        ).SerializeToString()
        for chunk in _chunks(snap.tensors, offset, self.chunk_bytes):
            yield chunk
            self._sent += 1
            await self.faults.hit(FaultPoint.DURING_STATE_TRANSFER, self._sent)


def _views(tensors: Sequence[torch.Tensor]) -> list[memoryview]:
    views = []
    for t in tensors:
        size = t.numel() * t.element_size()
        views.append(memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B") if size else
                     memoryview(b""))
    return views


def _chunks(tensors: Sequence[torch.Tensor], offset: int, chunk_bytes: int) -> Iterator[bytes]:
    """The tensors' bytes back to back from `offset`, in messages of `chunk_bytes` (one copy each)."""
    pending = bytearray()
    position = 0
    for view in _views(tensors):
        start = max(0, offset - position)
        position += len(view)
        if start >= len(view):
            continue
        view = view[start:]
        while view:
            take = min(chunk_bytes - len(pending), len(view))
            if not pending and take == chunk_bytes:
                yield bytes(view[:take])
            else:
                pending += view[:take]
                if len(pending) == chunk_bytes:
                    yield bytes(pending)
                    pending.clear()
            view = view[take:]
    if pending:
        yield bytes(pending)


class _Receiver:
    """Buffers for one version of the state, filled at byte offsets; kept across sources."""

    def __init__(self, header: averaging_pb2.StateHeader, max_bytes: int) -> None:
        self.version = header.version
        self.metadata = unpack(header.metadata, max_bytes=1 << 26) if header.metadata else None
        self.tensors = []
        total = 0
        for meta in header.tensors:
            dtype = _DTYPES.get(meta.dtype)
            if dtype is None or any(d < 0 for d in meta.shape):
                raise InvalidRequest(f"bad tensor in state header: {meta.dtype}{list(meta.shape)}")
            t = torch.empty(tuple(meta.shape), dtype=dtype)
            total += t.numel() * t.element_size()
            if total > max_bytes:
                raise ResourceExhausted(f"state of over {max_bytes} bytes refused")
            self.tensors.append(t)
        if total != header.total_bytes:
            raise InvalidRequest("state header's sizes do not add up")
        self.total = total
        self.offset = 0
        self._views = _views(self.tensors)
        self._starts = [0]
        for v in self._views:
            self._starts.append(self._starts[-1] + len(v))

    def feed(self, chunk: bytes | memoryview) -> None:
        if self.offset + len(chunk) > self.total:
            raise InvalidRequest("state stream carries more bytes than its header declared")
        src = memoryview(chunk)
        pos = self.offset
        i = 0
        while src:
            while self._starts[i + 1] <= pos:
                i += 1
            local = pos - self._starts[i]
            take = min(len(self._views[i]) - local, len(src))
            self._views[i][local:local + take] = src[:take]
            src = src[take:]
            pos += take
        self.offset = pos


async def _discover(peer: PeerHandle, prefix: str) -> list[str]:
    dht = peer.dht
    if dht is None:
        return []
    found = await dht.aget(f"{prefix}.state", latest=True)
    now = get_dht_time()
    addrs = []
    for subkey, item in subkey_entries(found).items():
        value = item.value
        if subkey != peer.peer_id and isinstance(value, dict) and value.get("addr") and item.expiration_time > now:
            addrs.append(str(value["addr"]))
    random.shuffle(addrs)
    return addrs


async def aload_state_from_peers(
    peer: PeerHandle, prefix: str, sources: Sequence[str] | None = None, *, timeout: float = 60.0,
    max_bytes: int = 16 << 30,
) -> DownloadedState:
    """Downloads the state served under `prefix`, trying `sources` in order (or DHT-announced ones).

    Args:
        peer: the local peer (client mode is fine).
        prefix: the state's name.
        sources: multiaddrs of peers serving it; None: those announced under ``{prefix}.state``.
        timeout: seconds for the whole download, retries included.
        max_bytes: refuse states larger than this.

    Returns:
        The state.

    Raises:
        AveragingError: no source could provide it in time.
    """
    tune_malloc()  # states are large: the heap thresholds of a peer that moves tensors
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    candidates = list(sources) if sources is not None else await _discover(peer, prefix)
    if not candidates:
        raise AveragingError(f"no peer serves state {prefix!r}")
    receiver: _Receiver | None = None
    used: list[str] = []
    errors: list[str] = []
    for addr in candidates:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        channel = peer.pool.get(addr)
        request = averaging_pb2.StateRequest(
            prefix=prefix, version=receiver.version if receiver else b"", offset=receiver.offset if receiver else 0
        )
        try:
            header: averaging_pb2.StateHeader | None = None
            async for message in channel.stream(STATE, [request.SerializeToString()], timeout=remaining, bulk=True):
                if header is None:
                    header = averaging_pb2.StateHeader.FromString(message)
                    if receiver is None or header.version != receiver.version or header.offset != receiver.offset:
                        if header.offset != 0:
                            raise InvalidRequest("source resumed a version we do not hold")
                        receiver = _Receiver(header, max_bytes)  # another version: start over
                    used.append(channel.peer_id)
                    continue
                assert receiver is not None
                receiver.feed(message)
            if header is not None and receiver is not None and receiver.offset == receiver.total:
                return DownloadedState(receiver.metadata, receiver.tensors, receiver.version, used)
            errors.append(f"{addr}: stream ended early")
        except (RPCError, InvalidRequest) as e:
            logger.info("state download from %s failed at byte %d: %s", addr, receiver.offset if receiver else 0, e)
            errors.append(f"{addr}: {e}")
    raise AveragingError(f"could not download state {prefix!r}: {'; '.join(errors) or 'timed out'}")


def load_state_from_peers(
    peer: PeerHandle, prefix: str, sources: Sequence[str] | None = None, *, timeout: float = 60.0,
    max_bytes: int = 16 << 30,
) -> DownloadedState:
    """Blocking form of `aload_state_from_peers`."""
    return peer.run(aload_state_from_peers(peer, prefix, sources, timeout=timeout, max_bytes=max_bytes),
                    timeout=timeout + 5)
