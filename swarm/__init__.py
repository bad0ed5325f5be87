"""swarm: train one neural network on volunteers' machines, with no master node.

The public API: the classes users build, the configurations they pass, the results they get
and the errors they catch. Names are resolved on first use, so that a DHT-only peer never
imports torch; type checkers see them through the imports under ``TYPE_CHECKING``. Without
torch (`pip install swarm-peer`, an infrastructure node), a name that needs it raises
`MissingDependency`, which names the install command (`pip install "swarm-peer[torch]"`).
See docs/architecture.md for where each lives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from swarm.core.optional import torch_available, torch_missing
from swarm.core.version import __version__

if TYPE_CHECKING:
    from swarm.averaging.averager import Averager, AveragerConfig
    from swarm.averaging.config import AllReduceConfig
    from swarm.averaging.matchmaking import MatchmakingConfig
    from swarm.averaging.reputation import ReputationConfig
    from swarm.averaging.round import AveragingResult
    from swarm.compression.base import CompressionError, CompressionType
    from swarm.core.errors import (
        AveragingError,
        ConfigError,
        DeadlineExceeded,
        DHTError,
        IdentityError,
        InvalidRequest,
        MissingDependency,
        MoEError,
        MultiaddrError,
        NotFound,
        PeerUnreachable,
        RemoteError,
        ResourceExhausted,
        RPCError,
        SwarmError,
        Unauthenticated,
        ValidationError,
    )
    from swarm.core.identity import Identity
    from swarm.dht.config import DHTConfig
    from swarm.dht.dht import DHT
    from swarm.dht.expiring import ValueWithExpiration
    from swarm.moe.client.answer_checks import AnswerChecks
    from swarm.moe.client.expert import RemoteExpert
    from swarm.moe.client.mixture import MixtureConfig, RemoteMixtureOfExperts
    from swarm.moe.client.switch import RemoteSwitchMixtureOfExperts
    from swarm.moe.server.checkpoints import CheckpointError
    from swarm.moe.server.config import ExpertServerConfig
    from swarm.moe.server.expert_server import ExpertServer
    from swarm.moe.server.hosted import BatchingConfig
    from swarm.net.channels import ChannelConfig
    from swarm.net.holepunch import PunchConfig
    from swarm.net.nat import NatConfig
    from swarm.net.relay import RelayConfig, ReservationsConfig
    from swarm.net.server import ServerConfig
    from swarm.optim.checkpointing import CheckpointConfig
    from swarm.optim.config import CollaborationConfig, DiLoCoConfig
    from swarm.optim.distributed import DistributedOptimizer
    from swarm.optim.optimizer import Optimizer
    from swarm.optim.outcome import RoundOutcome, StepOutcome
    from swarm.optim.progress import PeerProgress, SwarmProgress
    from swarm.optim.state_transfer import StateTransferError
    from swarm.peer import Peer

_ERRORS = (
    "AveragingError", "ConfigError", "DeadlineExceeded", "DHTError", "IdentityError", "InvalidRequest", "MoEError",
    "MultiaddrError", "NotFound", "PeerUnreachable", "RemoteError", "ResourceExhausted", "RPCError", "SwarmError",
    "Unauthenticated", "ValidationError", "MissingDependency",
)

_EXPORTS = {
    "Peer": "swarm.peer",
    "Identity": "swarm.core.identity",
    "ChannelConfig": "swarm.net.channels",
    "ServerConfig": "swarm.net.server",
    "DHT": "swarm.dht.dht",
    "DHTConfig": "swarm.dht.config",
    "ValueWithExpiration": "swarm.dht.storage",
    "CompressionType": "swarm.compression.base",
    "CompressionError": "swarm.compression.base",
    "Averager": "swarm.averaging.averager",
    "AveragerConfig": "swarm.averaging.averager",
    "AveragingResult": "swarm.averaging.round",
    "AllReduceConfig": "swarm.averaging.config",
    "MatchmakingConfig": "swarm.averaging.matchmaking",
    "ExpertServer": "swarm.moe.server.expert_server",
    "ExpertServerConfig": "swarm.moe.server.config",
    "CheckpointError": "swarm.moe.server.checkpoints",
    "RemoteExpert": "swarm.moe.client.expert",
    "RemoteMixtureOfExperts": "swarm.moe.client.mixture",
    "RemoteSwitchMixtureOfExperts": "swarm.moe.client.switch",
    "Optimizer": "swarm.optim.optimizer",
    "RoundOutcome": "swarm.optim.optimizer",
    "StepOutcome": "swarm.optim.optimizer",
    "CollaborationConfig": "swarm.optim.config",
    "DiLoCoConfig": "swarm.optim.config",
    "DistributedOptimizer": "swarm.optim.distributed",
    "PeerProgress": "swarm.optim.progress",
    "SwarmProgress": "swarm.optim.progress",
    "StateTransferError": "swarm.optim.state_transfer",
    # the settings the constructors above take (docs/settings.md lists every one)
    "NatConfig": "swarm.net.nat",
    "RelayConfig": "swarm.net.relay",
    "ReservationsConfig": "swarm.net.relay",
    "PunchConfig": "swarm.net.holepunch",
    "ReputationConfig": "swarm.averaging.reputation",
    "MixtureConfig": "swarm.moe.client.mixture",
    "AnswerChecks": "swarm.moe.client.answer_checks",
    "BatchingConfig": "swarm.moe.server.hosted",
    "CheckpointConfig": "swarm.optim.checkpointing",
    **{name: "swarm.core.errors" for name in _ERRORS},
}

__all__ = [
    "DHT",
    "AllReduceConfig",
    "AnswerChecks",
    "Averager",
    "AveragerConfig",
    "AveragingError",
    "AveragingResult",
    "BatchingConfig",
    "ChannelConfig",
    "CheckpointConfig",
    "CheckpointError",
    "CollaborationConfig",
    "CompressionError",
    "CompressionType",
    "ConfigError",
    "DHTConfig",
    "DHTError",
    "DeadlineExceeded",
    "DiLoCoConfig",
    "DistributedOptimizer",
    "ExpertServer",
    "ExpertServerConfig",
    "Identity",
    "IdentityError",
    "InvalidRequest",
    "MatchmakingConfig",
    "MissingDependency",
    "MixtureConfig",
    "MoEError",
    "MultiaddrError",
    "NatConfig",
    "NotFound",
    "Optimizer",
    "Peer",
    "PeerProgress",
    "PeerUnreachable",
    "PunchConfig",
    "RPCError",
    "RelayConfig",
    "RemoteError",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "ReputationConfig",
    "ReservationsConfig",
    "ResourceExhausted",
    "RoundOutcome",
    "ServerConfig",
    "StateTransferError",
    "StepOutcome",
    "SwarmError",
    "SwarmProgress",
    "Unauthenticated",
    "ValidationError",
    "ValueWithExpiration",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as e:  # MissingDependency from a package that needs torch, or torch itself
        if torch_available():
            raise
        raise torch_missing(f"swarm.{name}") from e
    globals()[name] = value
    return value
