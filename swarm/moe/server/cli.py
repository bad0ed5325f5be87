"""`swarm-peer --experts PATTERN`: serve experts from the daemon (docs/operations.md).

The options are checked before torch is imported, so a typo fails in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from swarm.core.errors import ConfigError
from swarm.core.optional import require_torch
from swarm.dht.handle import PeerHandle
from swarm.moe.uids import expand_pattern

if TYPE_CHECKING:
    from swarm.moe.server.expert_server import ExpertServer


class ExpertOptions(Protocol):
    """What `serve_experts` reads of the daemon's options (`swarm.cli.config.PeerOptions` has it)."""

    @property
    def experts(self) -> str | None: ...
    @property
    def expert_cls(self) -> str: ...
    @property
    def hidden_dim(self) -> int: ...
    @property
    def checkpoint_dir(self) -> str | None: ...
    @property
    def expert_hostile(self) -> str | None: ...


def serve_experts(peer: PeerHandle, options: ExpertOptions) -> ExpertServer:
    """Serves the experts the daemon's options name; the server shuts down (and saves) with the peer.

    Args:
        peer: the daemon's `swarm.Peer`.
        options: has ``experts`` (a pattern such as ``"ffn.[0:4].[0:4]"``), ``expert_cls``,
            ``hidden_dim``, ``checkpoint_dir`` (None: no checkpoints) and ``expert_hostile`` (None: an
            honest server; else a fault for tests and demos, `swarm.moe.server.hostile`).

    Returns:
        The running server (attached to `peer`).

    Raises:
        ConfigError: a malformed pattern, an unknown expert class or an invalid hidden size.
        MissingDependency: torch is not installed (an infrastructure install).
        CheckpointError: a checkpoint in ``checkpoint_dir`` exists but does not fit.
    """
    if options.experts is None:
        raise ConfigError("--experts: no pattern given")
    try:
        expand_pattern(options.experts)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--experts: {e}") from None
    require_torch("swarm-peer --experts")
    from swarm.moe.server.hostile import HOSTILE_MODES

    hostile = options.expert_hostile
    if hostile is not None and hostile not in HOSTILE_MODES:
        raise ConfigError(f"--expert-hostile must be one of {', '.join(HOSTILE_MODES)}, got {hostile!r}")
    from swarm.moe.server.config import ExpertServerConfig
    from swarm.moe.server.expert_server import ExpertServer

    try:
        return ExpertServer.from_pattern(
            peer, options.experts, options.expert_cls, options.hidden_dim, checkpoint_dir=options.checkpoint_dir,
            config=ExpertServerConfig(hostile=hostile),
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--experts {options.experts!r} --expert-cls {options.expert_cls!r}: {e}") from None
