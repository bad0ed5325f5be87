"""Configuration of the all-reduce: chunking, timeouts and the timeline of a round.

A round that may take `T` seconds (the group's timeout, capped by each member's own deadline)
runs on a fixed timeline, counted from when a member receives the group:

    0 ............ report_at ....... decide_at ....... give_up_decision ........ T
      senders send   reducers report   leader decides    reducers stop waiting    members give up

so a stalled or dead peer costs at most a known share of `T`, and every member returns by `T`.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.core.errors import ConfigError


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
    """

    chunk_bytes: int = 1 << 20
    sender_timeout: float = 5.0
    report_at: float = 0.4
    decide_at: float = 0.55
    give_up_decision: float = 0.7
    linger: float = 2.0
    join_grace: float = 5.0
    bulk: bool = True

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= 4 << 20:
            raise ConfigError("chunk_bytes must be within 4 KiB .. 4 MiB (grpc message limits)")
        if self.sender_timeout <= 0 or self.linger < 0 or self.join_grace <= 0:
            raise ConfigError("sender_timeout and join_grace must be > 0, linger >= 0")
        if not 0 < self.report_at < self.decide_at < self.give_up_decision < 1:
            raise ConfigError("need 0 < report_at < decide_at < give_up_decision < 1")
