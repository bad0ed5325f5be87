"""swarm's typed error tree.

Every failure a caller can meet is a subclass of `SwarmError`. Transport failures are
translated once, at the gRPC boundary (`swarm.net.errors`), into the `RPCError` branch,
so code above the network layer never sees a raw `grpc.RpcError`.
"""

from __future__ import annotations

from collections.abc import Sequence


class SwarmError(Exception):
    """Base class of every error swarm raises on purpose."""


class IdentityError(SwarmError):
    """A key or identity file is corrupt, foreign, or held by another running peer."""


class MultiaddrError(SwarmError, ValueError):
    """A multiaddr string could not be parsed or is not usable for dialing."""


class ConfigError(SwarmError, ValueError):
    """A configuration value is invalid."""


class RPCError(SwarmError):
    """A remote call failed. `peer_id` names the callee when known."""

    def __init__(self, message: str, *, peer_id: str | None = None) -> None:
        super().__init__(message)
        self.peer_id = peer_id


class PeerUnreachable(RPCError):
    """The callee could not be reached (connection refused, reset, or gone)."""


class DeadlineExceeded(RPCError):
    """The call did not complete before its deadline."""


class Unauthenticated(RPCError):
    """The caller or callee failed to prove the PeerID it claims."""


class PermissionDenied(Unauthenticated):
    """The peer proved who it is, but is not allowed in (not a member of a private swarm, or a
    member without the role the call needs)."""


class InvalidRequest(RPCError):
    """The callee rejected the request as malformed (bad shapes, dtypes, encodings, values)."""


class ResourceExhausted(RPCError):
    """The callee refused the call because of a size or concurrency limit."""


class NotFound(RPCError):
    """The callee does not host what was asked for (unknown method, expert, or key)."""


class RemoteError(RPCError):
    """The callee failed while handling a well-formed request."""


class DHTError(SwarmError):
    """A DHT operation failed (for example, no initial peer was reachable)."""


class ValidationError(DHTError):
    """A DHT record was rejected by a validator (bad signature, wrong owner, schema).

    Attributes:
        results: for a batch store, whether each record of the batch was stored (empty otherwise).
    """

    def __init__(self, message: str, results: Sequence[bool] = ()) -> None:
        super().__init__(message)
        self.results: tuple[bool, ...] = tuple(results)


class AveragingError(SwarmError):
    """An averaging round failed; every member of the group sees the same error."""


class MoEError(SwarmError):
    """A mixture-of-experts call could not be completed (for example, fewer than k_min experts)."""


class MissingDependency(SwarmError, ImportError):
    """A feature needs an optional package that is not installed; the message names the install command."""
