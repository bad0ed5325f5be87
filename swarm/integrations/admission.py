"""The model check at the door of a run: peers publish their model's fingerprint and refuse another.

Every peer of a run stores its `ModelFingerprint` under the run's key `<run_id>.model`, in a subkey
only it can write (its `owner_marker`), and reads everyone's. A newcomer checks before it builds its
optimizer (so before any round or state download): if any peer of the run trains a different model,
it raises `ModelMismatchError` naming that peer and every field that differs. The peers already
training keep reading the key on a timer and log the same mismatch, from their side, once per
newcomer; they go on training, and `refused` lists whom they turned away. Neither side can average
with the other meanwhile: their averaging groups are scoped by the fingerprint
(`swarm.integrations.fingerprint.scoped_prefix`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

from swarm.core.errors import ConfigError, DHTError, SwarmError
from swarm.core.loop import spawn
from swarm.core.timeutil import get_dht_time
from swarm.dht.handle import PeerHandle
from swarm.dht.validation import marker_owner, owner_marker
from swarm.integrations.fingerprint import ModelFingerprint, ModelMismatchError, mismatch_message

logger = logging.getLogger(__name__)


def model_key(run_id: str) -> str:
    """The DHT key holding the fingerprints of a run's peers (subkey: each peer's `owner_marker`)."""
    return f"{run_id}.model"


@dataclass(frozen=True)
class AdmissionConfig:
    """How often a peer renews its fingerprint and reads the others'.

    Attributes:
        period: seconds between two renewals and reads while training.
        expiration: seconds a fingerprint record lives (a peer that stopped renewing it drops out).
        timeout: seconds one store or read may take.
    """

    period: float = 5.0
    expiration: float = 60.0
    timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("period", "expiration", "timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.expiration <= 2 * self.period:
            raise ConfigError("expiration must exceed two periods, so a live peer's record never lapses")


class ModelAdmission:
    """Publishes this peer's fingerprint and compares it with every other peer's of the run.

    Args:
        peer: the peer whose DHT is used.
        run_id: the run's name.
        fingerprint: this peer's model.
        config: renewal period, record lifetime, timeouts.
    """

    def __init__(self, peer: PeerHandle, run_id: str, fingerprint: ModelFingerprint,
                 config: AdmissionConfig | None = None) -> None:
        if peer.dht is None:
            raise ConfigError("the model check needs a peer whose DHT is running")
        self.peer = peer
        self.key = model_key(run_id)
        self.fingerprint = fingerprint
        self.config = config or AdmissionConfig()
        self.refused: dict[str, str] = {}  # peer ID -> why it was refused (logged once each)
        self._task: asyncio.Task[None] | None = None
        self._changed = threading.Condition()

    def admit(self) -> None:
        """Publishes this peer's fingerprint, then checks the run's; starts the renewals.

        Raises:
            ModelMismatchError: a peer of the run trains another model (the message names it).
        """
        self.peer.run(self._publish(), timeout=self.config.timeout + 5)
        mismatches = self.peer.run(self._read(), timeout=self.config.timeout + 5)
        if mismatches:
            # the record stays, marked refused, so the running peers learn of the refusal too; it does not
            # turn away the next peer, which may train the run's model
            self.peer.run(self._publish(refused_by=next(iter(mismatches))), timeout=self.config.timeout + 5)
            raise ModelMismatchError("; ".join(mismatches.values()))
        self.peer.run(self._start())

    async def _start(self) -> None:
        self._task = spawn(self._watch(), name=f"model-admission {self.key}")

    async def _publish(self, refused_by: str | None = None) -> None:
        dht = self.peer.dht
        assert dht is not None  # checked at construction
        expiration = get_dht_time() + self.config.expiration
        record = self.fingerprint.to_record() | ({"refused_by": refused_by} if refused_by is not None else {})
        stored = await asyncio.wait_for(dht.astore(self.key, record, expiration,
                                                   subkey=owner_marker(self.peer.peer_id)), self.config.timeout)
        if not stored:
            logger.debug("no DHT node took this peer's model fingerprint under %s", self.key)

    async def _withdraw(self) -> None:
        """Replaces this peer's fingerprint with a record that says it left (not a fingerprint)."""
        dht = self.peer.dht
        assert dht is not None
        try:
            await asyncio.wait_for(dht.astore(self.key, {"left": True}, get_dht_time() + self.config.expiration,
                                              subkey=owner_marker(self.peer.peer_id)), self.config.timeout)
        except (TimeoutError, DHTError, SwarmError, OSError) as e:
            logger.debug("withdrawing this peer's model fingerprint failed: %s", e)

    async def _read(self, refused_too: bool = False) -> dict[str, str]:
        """Peers whose fingerprint differs from this one, each with the message naming the difference
        (with `refused_too`, also those another peer refused already)."""
        dht = self.peer.dht
        assert dht is not None
        found = await asyncio.wait_for(dht.aget(self.key, latest=True), self.config.timeout)
        value = found.value if found is not None else None
        out: dict[str, str] = {}
        if not isinstance(value, dict):
            return out
        for subkey, item in value.items():
            peer_id = marker_owner(subkey)  # only that peer could write this subkey
            if peer_id is None or peer_id == self.peer.peer_id:
                continue
            theirs = ModelFingerprint.from_record(item.value)
            if not refused_too and isinstance(item.value, dict) and "refused_by" in item.value:
                continue
            if theirs is not None and theirs != self.fingerprint:
                out[peer_id] = mismatch_message(self.fingerprint, theirs, self.peer.peer_id, peer_id)
        return out

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.period)
            try:
                await self._publish()
                mismatches = await self._read(refused_too=True)
            except (TimeoutError, DHTError, SwarmError, OSError) as e:
                logger.debug("the model check of %s failed this time: %s", self.key, e)
                continue
            for peer_id, why in mismatches.items():
                if peer_id not in self.refused:
                    logger.error("refusing %s", why)
                    with self._changed:
                        self.refused[peer_id] = why
                        self._changed.notify_all()

    def wait_for_refusal(self, peer_id: str, timeout: float) -> bool:
        """Blocks until this peer has refused `peer_id` (at most `timeout` seconds); True if it has."""
        with self._changed:
            return self._changed.wait_for(lambda: peer_id in self.refused, timeout)

    async def ashutdown(self) -> None:
        """Stops the renewals and withdraws this peer's fingerprint."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            await self._withdraw()
