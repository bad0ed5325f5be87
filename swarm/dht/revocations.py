"""A private swarm's revocation lists, spread through the DHT (docs/security.md, "Revocation").

The authority's newest revocation list lives under one key, `REVOCATIONS_KEY`, and
`RevocationValidator` makes every DHT node refuse anything else there: a list not signed by the
authority, garbage (a member cannot fill the key with junk), or one that expires more than
`REVOCATION_TTL` ahead.

`RevocationWatcher` reads the key every `interval` seconds; a newer list goes to the membership
policy, the gate checks every cached member again (`MembershipGate.revalidate`), and a revoked
peer's calls are refused from then on and its channels closed. So a revoked peer is cut off at
most `interval` plus one DHT lookup after the list was stored. Every member that holds a newer
list than the DHT's, or one that expires within half of `REVOCATION_TTL`, stores it again,
expiring `REVOCATION_TTL` from now: the list stays alive while members run, and an older genuine
list that a member stores (a rollback, which cannot expire later than `REVOCATION_TTL` from its
store) is replaced by the next member's read, whose store expires later; no peer ever goes back
to an older list than one it applied.
"""

from __future__ import annotations

import asyncio
import logging

from swarm.core.errors import ConfigError, DHTError, RPCError, ValidationError
from swarm.core.loop import spawn
from swarm.core.membership import MAX_CLOCK_SKEW, CertificatePolicy, MembershipRefused, RevocationList
from swarm.core.serialization import pack, unpack
from swarm.core.timeutil import get_dht_time
from swarm.dht.handle import KeyValueStore
from swarm.dht.keys import serialize_key
from swarm.dht.validation import DHTRecord, RecordValidator
from swarm.net.membership import MembershipGate

logger = logging.getLogger(__name__)

REVOCATIONS_KEY = "_swarm.revocations"
REVOCATION_TTL = 12 * 3600.0
"""Seconds a stored list lives in the DHT unless a member stores it again (within the DHT's own
limit on how far ahead a record may expire)."""
_RAW_KEY = serialize_key(REVOCATIONS_KEY)


class RevocationValidator(RecordValidator):
    """Lets only the authority's revocation lists, at their own expiration, under `REVOCATIONS_KEY`."""

    priority = 5

    def __init__(self, authority: bytes) -> None:
        self.authority = authority

    def validate(self, record: DHTRecord) -> None:
        if record.raw_key != _RAW_KEY:
            return
        if record.subkey:
            raise ValidationError("the revocation list's key holds no subkeys")
        try:
            data = unpack(record.value)
            RevocationList.decode(data if isinstance(data, bytes) else b"", self.authority)
        except (ValueError, MembershipRefused) as e:
            raise ValidationError(f"not this swarm's revocation list: {e}") from None
        if record.expiration_time > get_dht_time() + REVOCATION_TTL + MAX_CLOCK_SKEW:
            # so that a member's next store of the newest list always expires later than a
            # rollback stored before it, and replaces it
            raise ValidationError(f"a revocation list may expire at most {REVOCATION_TTL:g} s ahead")


class RevocationWatcher:
    """Reads the swarm's revocation list from the DHT, applies newer ones, and publishes new ones.

    Args:
        dht: the peer's DHT.
        policy: the peer's certificate policy (holds the newest list known).
        gate: the peer's gate, which drops members a new list revokes.
        interval: seconds between two reads of the list (the cut-off bound, with one lookup).
    """

    def __init__(self, dht: KeyValueStore, policy: CertificatePolicy, gate: MembershipGate,
                 interval: float = 10.0) -> None:
        if interval <= 0:
            raise ConfigError(f"the revocation interval must be positive, got {interval}")
        self.dht = dht
        self.policy = policy
        self.gate = gate
        self.interval = interval
        self.applied = asyncio.Event()
        """Set each time a newer list was applied (tests wait on it)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = spawn(self._watch(), "revocation-watcher")

    def apply(self, revocations: RevocationList) -> set[str]:
        """Takes a verified list if it is newer; returns the PeerIDs it cut off."""
        if not self.policy.apply(revocations):
            return set()
        logger.info("private swarm: revocation list %d applied (%d peers, %d certificates revoked)",
                    revocations.number, len(revocations.peer_ids), len(revocations.serials))
        dropped = self.gate.revalidate()
        self.applied.set()
        return dropped

    async def publish(self, revocations: RevocationList) -> bool:
        """Applies `revocations` here and stores it in the DHT for every member to find."""
        RevocationList.decode(revocations.encode(), self.policy.authority)  # refuse a foreign list here
        self.apply(revocations)
        return await self._store(revocations)

    async def _store(self, revocations: RevocationList) -> bool:
        return await self.dht.astore(REVOCATIONS_KEY, revocations.encode(), get_dht_time() + REVOCATION_TTL)

    async def refresh(self) -> None:
        """One read of the list from the DHT."""
        found = await self.dht.aget(REVOCATIONS_KEY, latest=True)
        stored: RevocationList | None = None
        if found is not None and isinstance(found.value, bytes):
            try:
                stored = RevocationList.decode(found.value, self.policy.authority)
            except MembershipRefused as e:
                logger.warning("private swarm: ignored a revocation list from the DHT: %s", e)
        if stored is not None:
            self.apply(stored)
        held = self.policy.revocations
        if held is not None and (stored is None or stored.number < held.number or found is None
                                 or found.expiration_time < get_dht_time() + REVOCATION_TTL / 2):
            await self._store(held)  # keep the newest list alive, over an older one stored later

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except (DHTError, RPCError, TimeoutError) as e:
                logger.debug("reading the revocation list failed: %s", e)
            await asyncio.sleep(self.interval)  # a period, not a wait for an event

    async def ashutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def revocations_record_value(revocations: RevocationList) -> bytes:
    """The DHT value of a list as stores carry it (for tests of the validator)."""
    return pack(revocations.encode())
