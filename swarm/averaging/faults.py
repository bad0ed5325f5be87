"""The named points of an averaging round at which a `swarm.core.faults.FaultPlan` can act.

Production code calls `await plan.hit(point, ...)` at each point; with an empty plan (the
default) that is a no-op. Tests build a plan and pass it to the `Averager`:

    plan = FaultPlan().add(FaultPoint.AFTER_CHUNKS_SENT, Action.KILL, after=3)

kills the process (SIGKILL, no cleanup) once it has sent 3 chunks in a round. The plan, its
actions and `FaultInjected` are `swarm.core.faults`'s, shared with the DHT's link faults.
"""

from __future__ import annotations

import enum


class FaultPoint(enum.Enum):
    """Where in a round a fault can be injected."""

    BEFORE_MATCHMAKING = "before_matchmaking"
    BEFORE_REDUCE_SCATTER = "before_reduce_scatter"    # member, group known, nothing sent yet
    AFTER_CHUNKS_SENT = "after_chunks_sent"            # member, count = chunks sent this round
    AFTER_CHUNKS_RECEIVED = "after_chunks_received"    # reducer, count = chunks received this round
    BEFORE_REPORT = "before_report"                    # reducer, all senders done or dropped
    BEFORE_DECISION = "before_decision"                # leader, reports collected
    BEFORE_ALL_GATHER = "before_all_gather"            # reducer, decision known, nothing sent back
    DURING_ALL_GATHER = "during_all_gather"            # reducer, count = result chunks sent
    AFTER_RESULTS_RECEIVED = "after_results_received"  # member, count = result chunks received
    BEFORE_APPLY = "before_apply"                      # member, every part held
    DURING_STATE_TRANSFER = "during_state_transfer"    # state server, count = chunks sent
