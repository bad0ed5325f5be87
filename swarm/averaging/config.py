"""Configuration of the all-reduce: chunking, timeouts and the timeline of a round.

A round that may take `T` seconds (the group's timeout, capped by each member's own deadline)
runs on a fixed timeline, counted from when a member receives the group:

    0 ............ report_at ....... decide_at ....... give_up_decision ........ T
      senders send   reducers report   leader decides    reducers stop waiting    members give up

so a stalled or dead peer costs at most a known share of `T`, and every member returns by `T`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from swarm.core.errors import ConfigError

AGGREGATIONS = ("mean", "centered_clip")


@dataclass(frozen=True)
class AllReduceConfig:
    """Timeouts and sizes of the butterfly all-reduce.

    Attributes:
        chunk_bytes: target size of one stream message (1 MiB is best: BENCHMARKS.md, "Transport facts").
        sender_timeout: a sender (or a member expected to acknowledge a part) that makes no
            progress for this long is dropped from the round.
        report_at: fraction of the round's time after which reducers report without the senders
            still missing.
        decide_at: fraction after which the leader decides without the reports still missing.
        give_up_decision: fraction after which a reducer without a decision aborts its part.
        linger: seconds after the round's end that results stay available to members fetching a
            part they lost.
        join_grace: how long a stream for a round this peer has not heard of yet may wait for it.
        bulk: send parts over the reducers' bulk side channel (`swarm.net.bulk`) where it can be
            reached, else over gRPC streams (the same protocol either way).
        aggregation: how each part's reducer combines its contributors' chunks: "mean" (the
            exact weighted mean, streamed as chunks arrive) or "centered_clip" (byzantine-robust:
            `swarm.averaging.robust`, over the whole part once every chunk is in).
        clip_tau: CenteredClip's radius, the same for every part; None: `clip_tau_scale` times the
            median distance of the part's contributions from their coordinate median.
        clip_tau_scale: see `clip_tau`.
        clip_iterations: bound on CenteredClip's iterations per part.
        clip_tolerance: CenteredClip stops once an iteration moves the centre by less than
            `clip_tolerance * tau`.
        lockstep: how many chunks one of a member's part streams to their reducers may run ahead
            of the slowest, so they finish together (`swarm.averaging.lockstep`); 0: each stream
            as fast as its connection takes.
        verify: members check every part they receive against its reducer's published digest,
            clip scales and input sketches, and the leader compares what all members hold before
            anyone applies (`swarm.averaging.verification`); None: on in robust mode only.

    Peers average only with peers whose aggregation settings are the same (`aggregation_tag` is
    folded into the tensors' schema digest), so a group never mixes modes.
    """

    chunk_bytes: int = 1 << 20
    sender_timeout: float = 5.0
    report_at: float = 0.4
    decide_at: float = 0.55
    give_up_decision: float = 0.7
    linger: float = 2.0
    join_grace: float = 5.0
    bulk: bool = True
    aggregation: str = "mean"
    clip_tau: float | None = None
    clip_tau_scale: float = 1.0
    clip_iterations: int = 20
    clip_tolerance: float = 1e-3
    verify: bool | None = None
    lockstep: int = 2

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.clip_tau is not None and not (math.isfinite(self.clip_tau) and self.clip_tau > 0):
            raise ConfigError("clip_tau must be None or a finite number > 0")
        if not (math.isfinite(self.clip_tau_scale) and self.clip_tau_scale > 0):
            raise ConfigError("clip_tau_scale must be a finite number > 0")
        if not 1 <= self.clip_iterations <= 1000 or not 0 < self.clip_tolerance < 1:
            raise ConfigError("need 1 <= clip_iterations <= 1000 and 0 < clip_tolerance < 1")
        if not 4096 <= self.chunk_bytes <= 4 << 20:
            raise ConfigError("chunk_bytes must be within 4 KiB .. 4 MiB (grpc message limits)")
        if self.lockstep < 0:
            raise ConfigError("lockstep must be >= 0 (0: off)")
        if self.sender_timeout <= 0 or self.linger < 0 or self.join_grace <= 0:
            raise ConfigError("sender_timeout and join_grace must be > 0, linger >= 0")
        if not 0 < self.report_at < self.decide_at < self.give_up_decision < 1:
            raise ConfigError("need 0 < report_at < decide_at < give_up_decision < 1")

    @property
    def robust(self) -> bool:
        return self.aggregation != "mean"

    @property
    def verified(self) -> bool:
        return self.robust if self.verify is None else self.verify

    def aggregation_tag(self) -> bytes:
        """What peers must agree on to average together: empty in plain unverified mode (so such
        peers keep grouping with peers of earlier versions), else the settings' exact values."""
        if not self.robust and not self.verified:
            return b""
        spec = f"{self.aggregation};{self.clip_tau!r};{self.clip_tau_scale!r};{self.clip_iterations};" \
               f"{self.clip_tolerance!r};verify={self.verified}" + (f";checks={CHECKS_VERSION}" if self.verified else "")
        return spec.encode()


# what verified rounds publish and check (`verification`): peers of different versions do not group
CHECKS_VERSION = 4


def fold_schema(schema: bytes, tag: bytes) -> bytes:
    """The schema digest peers compare when grouping, with the aggregation settings folded in."""
    if not tag:
        return schema
    return hashlib.blake2b(schema + b"|" + tag, digest_size=len(schema) or 16).digest()
