"""swarm.averaging: fault-tolerant butterfly all-reduce over gRPC streams, matchmaking, state transfer.

    avg = Averager(peer, tensors, prefix="run", target_group_size=4, initial_group=[...])
    result = avg.step(timeout=30)     # AveragingResult, or raises AveragingError

Byzantine-robust mode: `AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip"))`
(docs/architecture.md, "Robust averaging"); a reducer caught lying raises `ReducerLied`.
"""

import swarm.core.needs_torch  # noqa: F401  (first: without torch, an error naming the install command)
from swarm.averaging.agreement import Decision
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.averager import Averager, AveragerConfig
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.faults import FaultPoint
from swarm.averaging.group import GroupInfo, MemberInfo
from swarm.averaging.matchmaking import MatchmakingConfig
from swarm.averaging.moshpit import moshpit_group_key
from swarm.averaging.parts import RoundFailed
from swarm.averaging.reputation import ReputationConfig
from swarm.averaging.round import AveragingResult
from swarm.averaging.state import State, StateServer, aload_state_from_peers, load_state_from_peers
from swarm.averaging.verification import ReducerLied
from swarm.core.faults import Action, FaultPlan

__all__ = [
    "Action",
    "AllReduceConfig",
    "Averager",
    "AveragerConfig",
    "AveragingResult",
    "ButterflyAllReduce",
    "Decision",
    "FaultPlan",
    "FaultPoint",
    "GroupInfo",
    "MatchmakingConfig",
    "MemberInfo",
    "ReducerLied",
    "ReputationConfig",
    "RoundFailed",
    "State",
    "StateServer",
    "aload_state_from_peers",
    "load_state_from_peers",
    "moshpit_group_key",
]
