"""Local reputation: contributors that robust rounds clipped hard, kept out of this peer's groups a while.

Each peer keeps its own record (no gossip: one peer's opinion cannot be forged into another's).
After every robust round the averager calls `Reputation.observe` with the round's result; a
contributor whose input was cut by at least `clip_threshold` (`AveragingResult.clipped`) gets a
strike, and one with `strikes` strikes within its last `window` observed rounds is kept out of
this peer's averaging for `exclusion` seconds (`Matchmaking.refuse`): as a leader this peer refuses
its join; as a follower it does not join a group it leads, names it in every join request
(`JoinRequest.excludes`: the leader keeps the two apart, keeping the side fewer peers object to),
and leaves a group that holds it all the same (a leader that ignores the field; it avoids that
leader while the exclusion lasts). Then its record starts over. This peer never excludes itself.

A round that failed because a reducer was caught lying (`ReducerLied`) is a lie strike against
that reducer, but only when this peer's own checks caught it: an accusation relayed in the
leader's verdict could come from a lying member (or leader), and counting it would let one liar
get honest peers excluded everywhere. `lies` lie strikes within the reducer's last `window`
observed rounds exclude it as above. At least two are needed: each check fails an honest reducer
with odds below 1e-9 per part (docs/security.md), so one false accusation, however unlucky,
never excludes an honest peer.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from swarm.averaging.verification import ReducerLied
from swarm.core.errors import ConfigError


@dataclass(frozen=True)
class ReputationConfig:
    """When a contributor is excluded.

    Attributes:
        clip_threshold: share of a contributor's input clipped away that counts as a strike.
        strikes: strikes within `window` rounds it took part in that exclude it; 0 turns it off.
        window: rounds remembered per contributor.
        exclusion: seconds it stays excluded.
        lies: lies caught by this peer's own checks, within `window` rounds, that exclude a
            reducer; 0 turns it off, else at least 2 (one false accusation never excludes; more
            than `window` never excludes).
    """

    clip_threshold: float = 0.5
    strikes: int = 3
    window: int = 10
    exclusion: float = 600.0
    lies: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.clip_threshold <= 1:
            raise ConfigError("clip_threshold must be within (0, 1]")
        if not 0 <= self.strikes <= self.window or self.window < 1:
            raise ConfigError("need 0 <= strikes <= window and window >= 1")
        if self.lies == 1 or self.lies < 0:
            raise ConfigError("lies must be 0 (off) or at least 2: one false accusation must never exclude")
        if not (math.isfinite(self.exclusion) and self.exclusion >= 0):
            raise ConfigError("exclusion must be a finite number of seconds >= 0")


@dataclass
class Reputation:
    """This peer's record of other peers' clipping. `clock` is injectable for tests."""

    me: str
    config: ReputationConfig = field(default_factory=ReputationConfig)
    clock: Callable[[], float] = time.monotonic
    _history: dict[str, deque[bool]] = field(default_factory=dict)
    _lies: dict[str, deque[bool]] = field(default_factory=dict)
    _excluded_until: dict[str, float] = field(default_factory=dict)

    def observe(self, clipped: Mapping[str, float]) -> list[str]:
        """Records one round's clipping (PeerID -> share clipped); returns the peers excluded by it."""
        for peer_id in clipped:
            if peer_id != self.me and self.config.lies:
                self._lies.setdefault(peer_id, deque(maxlen=self.config.window)).append(False)
        if not self.config.strikes:
            return []
        now = self.clock()
        newly = []
        for peer_id, share in clipped.items():
            if peer_id == self.me:
                continue
            history = self._history.setdefault(peer_id, deque(maxlen=self.config.window))
            history.append(share >= self.config.clip_threshold)
            if sum(history) >= self.config.strikes and not self.excluded(peer_id):
                self._excluded_until[peer_id] = now + self.config.exclusion
                history.clear()
                newly.append(peer_id)
        return newly

    def observe_lie(self, error: ReducerLied) -> bool:
        """Records a round that failed with `error`; returns whether it excluded the reducer now.
        Only a lie this peer's own checks caught is a strike (see above)."""
        peer_id = error.peer_id
        if not self.config.lies or error.reported_by != self.me or peer_id == self.me:
            return False
        history = self._lies.setdefault(peer_id, deque(maxlen=self.config.window))
        history.append(True)
        if sum(history) < self.config.lies or self.excluded(peer_id):
            return False
        self._excluded_until[peer_id] = self.clock() + self.config.exclusion
        history.clear()
        return True

    def excluded(self, peer_id: str) -> bool:
        until = self._excluded_until.get(peer_id)
        if until is None:
            return False
        if self.clock() >= until:
            del self._excluded_until[peer_id]
            return False
        return True

    def excluded_peers(self) -> list[str]:
        """The peers excluded now, sorted (what a follower tells a leader: `JoinRequest.excludes`)."""
        return sorted(p for p in list(self._excluded_until) if self.excluded(p))

    def refusal(self, peer_id: str) -> str | None:
        """Why this peer refuses `peer_id` in its groups now, or None."""
        if not self.excluded(peer_id):
            return None
        left = self._excluded_until[peer_id] - self.clock()
        return f"excluded by this peer for {left:.0f} s more: clipped hard, or caught lying, in recent rounds"
