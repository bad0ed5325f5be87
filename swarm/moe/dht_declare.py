"""Declaring experts in the DHT, and finding them there.

A server with PeerID P serving expert ``ffn.3.1`` at address A (ending in ``/p2p/P``) stores,
each with expiration now + T and signed with P's key:

- key ``ffn.``   subkey ``"3[owner:P]"`` -> ``["ffn.3.1", A]``  (something under ``ffn.3.`` is alive)
- key ``ffn.3.`` subkey ``"1[owner:P]"`` -> ``["ffn.3.1", A]``
- key ``ffn.3.1`` subkey ``"[owner:P]"``  -> ``A``

and re-announces every T/3 (`ExpertDeclarer`), so a client finds the live successors of any
prefix with one DHT read (`get_successors`, the step of the beam search) and an expert whose
server died disappears within T. Pairs (prefix, subkey) shared by several local experts are
stored once per round.

Every declaration names its server as owner (`swarm.dht.owner_marker`), so DHT nodes accept it
only with that server's signature and no one else can overwrite it; servers of the same expert
or coordinate hold separate subkeys. Values read back are checked: an entry counts only if its
subkey names an owner, the address it gives ends in that owner's PeerID, and it names an expert
under its prefix. A garbage or hostile writer can neither crash a client nor point an expert at
another address; where several servers declare one coordinate, the declaration expiring last
(the most recently renewed) wins.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Sequence

from swarm.core.errors import ValidationError
from swarm.core.loop import spawn
from swarm.core.timeutil import get_dht_time
from swarm.dht.expiring import ValueWithExpiration, subkey_entries
from swarm.dht.handle import KeyValueStore
from swarm.moe.uids import Successors, is_valid_prefix, is_valid_uid, parse_uid, successor_coord, uid_prefixes

__all__ = ["DHTExpertSource", "ExpertDeclarer", "declarations", "declare_experts", "get_experts", "get_replicas",
           "get_successors"]

logger = logging.getLogger(__name__)

Declaration = str | list[str]
"""A declaration's value: an expert's address, or ``[uid, address]`` under a prefix."""

_OWNED_SUBKEY = re.compile(r"(0|[1-9][0-9]*)?\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]")


def declarations(uids: Iterable[str], addr: str, owner: str) -> list[tuple[str, str, Declaration]]:
    """The (key, subkey, value) records that declare `uids` served at `addr` by the peer `owner`,
    deduplicated; each subkey names `owner` (`swarm.dht.owner_marker`), so only it can write them."""
    marker = f"[owner:{owner}]"
    records: dict[tuple[str, str], Declaration] = {}
    for uid in uids:
        _, coords = parse_uid(uid)
        for prefix, coord in zip(uid_prefixes(uid), coords):
            records.setdefault((prefix, f"{coord}{marker}"), [uid, addr])
        records[(uid, marker)] = addr
    return [(key, subkey, value) for (key, subkey), value in records.items()]


def _owned_entry(subkey: object, addr: object) -> tuple[int | None, str] | None:
    """(coordinate or None, owner) of a declaration's subkey, if it names an owner and `addr` is
    that owner's; else None."""
    if not isinstance(subkey, str) or not isinstance(addr, str):
        return None
    match = _OWNED_SUBKEY.fullmatch(subkey)
    if match is None or not addr.endswith(f"/p2p/{match.group(2)}"):
        return None
    coord = match.group(1)
    return (int(coord) if coord is not None else None), match.group(2)


async def declare_experts(dht: KeyValueStore, uids: Sequence[str], addr: str, expiration_time: float) -> int:
    """Stores the declarations of `uids` at `addr` until `expiration_time` (one batched store).

    Returns:
        How many records the DHT accepted (failures are logged at debug level).
    """
    records = declarations(uids, addr, dht.peer_id)
    try:
        results: list[object] = list(await dht.astore_many(
            [k for k, _, _ in records], [v for _, _, v in records], expiration_time, [s for _, s, _ in records]
        ))
    except ValidationError as e:  # some records refused: the others may be in
        logger.debug("declaring %d records: %s", len(records), e)
        results = list(e.results)
    except Exception as e:  # noqa: BLE001 - a failed round is retried by the caller
        logger.debug("declaring %d records failed: %s", len(records), e)
        results = []
    return sum(1 for r in results if r is True)


async def _get_all(dht: KeyValueStore, keys: list[str]) -> list[ValueWithExpiration | BaseException | None]:
    """Each key's record (None, or an exception when that read failed), in one batched read."""
    try:
        found = await dht.aget_many(keys)
    except Exception as e:  # noqa: BLE001 - reported per key below
        return [e] * len(keys)
    return [found.get(key) for key in keys]


def _alive(entry: ValueWithExpiration, now: float) -> bool:
    return entry.expiration_time >= now


async def get_successors(dht: KeyValueStore, prefixes: Sequence[str]) -> dict[str, Successors]:
    """Reads the live successors of each prefix (one batched DHT read for all of them).

    Returns:
        ``{prefix: {coordinate: (uid, address)}}``; ``{}`` for a prefix with no live successor.
        Malformed prefixes are left out.
    """
    prefixes = [p for p in dict.fromkeys(prefixes) if is_valid_prefix(p)]
    results = await _get_all(dht, prefixes)
    now = get_dht_time()
    found: dict[str, Successors] = {}
    for prefix, record in zip(prefixes, results):
        successors: Successors = {}
        if isinstance(record, BaseException):
            logger.debug("reading %s from the DHT failed: %s", prefix, record)
        else:
            newest: dict[int, float] = {}
            for subkey, entry in subkey_entries(record).items():
                value = entry.value
                if not _alive(entry, now) or not isinstance(value, list | tuple) or len(value) != 2:
                    continue
                uid, addr = value
                owned = _owned_entry(subkey, addr)
                if owned is None or owned[0] is None or not isinstance(uid, str):
                    continue
                coord = owned[0]
                expiration = entry.expiration_time
                if successor_coord(prefix, uid) == coord and expiration > newest.get(coord, -1.0):
                    newest[coord] = expiration
                    successors[coord] = (uid, addr)
        found[prefix] = successors
    return found


async def get_experts(dht: KeyValueStore, uids: Sequence[str]) -> dict[str, str]:
    """Reads the address of each live expert among `uids` (unknown, dead or malformed ones left out);
    where several servers declare one, the most recently renewed declaration wins."""
    return {uid: addrs[0] for uid, addrs in (await get_replicas(dht, uids)).items()}


async def get_replicas(dht: KeyValueStore, uids: Sequence[str]) -> dict[str, list[str]]:
    """Reads every live server of each expert among `uids`, the most recently renewed first
    (unknown, dead or malformed ones left out)."""
    uids = [u for u in dict.fromkeys(uids) if is_valid_uid(u)]
    results = await _get_all(dht, uids)
    now = get_dht_time()
    found: dict[str, list[str]] = {}
    for uid, record in zip(uids, results):
        if isinstance(record, BaseException):
            logger.debug("reading %s from the DHT failed: %s", uid, record)
            continue
        servers: dict[str, float] = {}
        for subkey, entry in subkey_entries(record).items():
            addr = entry.value
            owned = _owned_entry(subkey, addr)
            if owned is None or owned[0] is not None or not isinstance(addr, str) or not _alive(entry, now):
                continue
            servers[addr] = max(servers.get(addr, -1.0), entry.expiration_time)
        if servers:
            found[uid] = sorted(servers, key=lambda a: -servers[a])
    return found


class DHTExpertSource:
    """An `swarm.moe.sources.ExpertSource` backed by the DHT (`peer.dht`).

    It meets that protocol by its methods; this module does not import `swarm.moe.sources` (the
    DHT records are shared by servers and clients, the sources are the client's view of them)."""

    def __init__(self, dht: KeyValueStore) -> None:
        if dht is None:
            raise ValueError("this peer has no DHT; pass an ExpertSource (e.g. StaticExpertSource) instead")
        self.dht = dht

    async def get_successors(self, prefixes: Sequence[str]) -> dict[str, Successors]:
        return await get_successors(self.dht, prefixes)

    async def get_experts(self, uids: Sequence[str]) -> dict[str, str]:
        return await get_experts(self.dht, uids)

    async def get_replicas(self, uids: Sequence[str]) -> dict[str, list[str]]:
        return await get_replicas(self.dht, uids)


class ExpertDeclarer:
    """Re-announces a server's experts every `ttl / 3` seconds, each time valid for `ttl` seconds.

    Args:
        dht: the peer's DHT.
        uids: the experts.
        addr: the server's multiaddr (ending in /p2p/<PeerID>).
        ttl: seconds a declaration stays valid without renewal.
    """

    def __init__(self, dht: KeyValueStore, uids: Sequence[str], addr: str, ttl: float) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive, got {ttl!r}")
        self.dht = dht
        self.uids = list(uids)
        self.addr = addr
        self.ttl = ttl
        self.rounds = 0
        """Completed declaration rounds."""
        self._task: asyncio.Task[None] | None = None
        self._round_done: asyncio.Condition | None = None
        self._readdressed: asyncio.Task[None] | None = None

    async def astart(self) -> None:
        """Declares once, then keeps declaring.

        The first round returns once every replica holds the declarations (or its write failed or
        timed out), not only the nearest, as a plain store would: so when this returns, a reader
        anywhere in the swarm finds the experts, including a full peer that answers from its own
        replica. A server prints its addresses after this; a client that reads the grid at once
        would otherwise see a partial dictionary and cache it (MoEBeamSearcher's `cache_ttl`).
        """
        await self._declare()
        await self.dht.wait_for_stores()  # bounded by each store's own deadline
        self._task = spawn(self._run(), name=f"moe-declare-{len(self.uids)}-experts")

    async def _declare(self) -> None:
        stored = await declare_experts(self.dht, self.uids, self.addr, get_dht_time() + self.ttl)
        if stored == 0 and self.uids:
            logger.warning("no DHT node accepted the declarations of %d experts; retrying", len(self.uids))
        self.rounds += 1
        if self._round_done is not None:
            async with self._round_done:
                self._round_done.notify_all()

    async def wait_rounds(self, rounds: int) -> None:
        """Returns once `rounds` declaration rounds have completed."""
        if self._round_done is None:
            self._round_done = asyncio.Condition()
        async with self._round_done:
            await self._round_done.wait_for(lambda: self.rounds >= rounds)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self._declare()
            except Exception:
                logger.warning("declaring experts in the DHT failed", exc_info=True)

    def readdress(self, addr: str) -> None:
        """Declares at once under a new address (a server behind NAT that moved to another relay)."""
        if addr == self.addr or self._task is None:
            return
        self.addr = addr
        if self._readdressed is None or self._readdressed.done():
            self._readdressed = spawn(self._declare(), name="moe-declare-new-address")

    async def aclose(self) -> None:
        """Stops re-announcing (declarations expire on their own within `ttl`)."""
        for task in (self._task, self._readdressed):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._readdressed = None
