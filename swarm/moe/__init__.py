"""Mixture-of-experts over the swarm: experts served by peers, called as differentiable layers.

Server side: `ExpertServer` hosts experts (batching runtime, training on backward calls,
checkpoints, DHT declarations). Client side: `RemoteExpert` (one expert), and
`RemoteMixtureOfExperts` / `RemoteSwitchMixtureOfExperts` (layers that route each sample to
its best live experts, found in the DHT by beam search).

Names are resolved lazily, so importing a torch-free part (`swarm.moe.uids`, `swarm.moe.server.cli`'s
option checks) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from swarm.core.optional import torch_available, torch_missing

if TYPE_CHECKING:
    from swarm.moe.client.answer_checks import AnswerChecks
    from swarm.moe.client.expert import RemoteExpert
    from swarm.moe.client.mixture import RemoteMixtureOfExperts
    from swarm.moe.client.switch import RemoteSwitchMixtureOfExperts
    from swarm.moe.server.config import ExpertServerConfig
    from swarm.moe.server.expert_server import ExpertServer
    from swarm.moe.sources import ExpertSource, StaticExpertSource

_EXPORTS = {
    "AnswerChecks": "swarm.moe.client.answer_checks",
    "ExpertServer": "swarm.moe.server.expert_server",
    "ExpertServerConfig": "swarm.moe.server.config",
    "ExpertSource": "swarm.moe.sources",
    "RemoteExpert": "swarm.moe.client.expert",
    "RemoteMixtureOfExperts": "swarm.moe.client.mixture",
    "RemoteSwitchMixtureOfExperts": "swarm.moe.client.switch",
    "StaticExpertSource": "swarm.moe.sources",
}

__all__ = [
    "AnswerChecks",
    "ExpertServer",
    "ExpertServerConfig",
    "ExpertSource",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "StaticExpertSource",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm.moe' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as e:
        if torch_available():
            raise
        raise torch_missing(f"swarm.moe.{name}") from e
    globals()[name] = value
    return value
