"""The one place where gRPC status codes and swarm's typed errors are translated into each other."""

from __future__ import annotations

import grpc

from swarm.core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PeerUnreachable,
    PermissionDenied,
    RemoteError,
    ResourceExhausted,
    RPCError,
    SwarmError,
    Unauthenticated,
)

_FROM_STATUS: dict[grpc.StatusCode, type[RPCError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNIMPLEMENTED: NotFound,
}

_TO_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PeerUnreachable, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (SwarmError, grpc.StatusCode.ABORTED),
]


def from_grpc_error(error: grpc.RpcError, peer_id: str | None = None, method: str = "") -> RPCError:
    """Translates a failed call into swarm's error tree, keeping the callee's message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.UNAVAILABLE and "handshake failed" in (details or "").lower():
        # a reconnect whose TLS handshake failed: the address no longer proves the PeerID (or the
        # peer there now runs with --insecure); never a transient network failure to retry blindly
        return Unauthenticated(f"TLS handshake failed: the peer does not prove its PeerID, or runs with "
                               f"--insecure ({details}){f' ({method} on {peer_id})' if peer_id else ''}",
                               peer_id=peer_id)
    return from_status(code, details, peer_id, method)


def from_status(code: grpc.StatusCode, details: str, peer_id: str | None = None, method: str = "") -> RPCError:
    """The typed error for a status and its message (a gRPC call's, or a bulk stream's ERROR frame)."""
    cls = _FROM_STATUS.get(code, RemoteError)
    where = f" ({method} on {peer_id})" if peer_id else (f" ({method})" if method else "")
    return cls(f"{details or code.name}{where}", peer_id=peer_id)


def to_status(error: BaseException) -> grpc.StatusCode | None:
    """Status for an expected error raised by a handler; None means an internal failure."""
    for cls, code in _TO_STATUS:
        if isinstance(error, cls):
            return code
    return None
