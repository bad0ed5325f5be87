"""The `swarm.Peer` service every peer hosts: `Info` (who and where am I) and `Handshake`."""

from __future__ import annotations

import time
from collections.abc import Callable

from swarm.core.errors import InvalidRequest
from swarm.net.auth import handshake_payload
from swarm.net.channels import HANDSHAKE, INFO
from swarm.net.server import CallContext, RPCServer
from swarm.proto import peer_pb2


class PeerService:
    """Answers `Info` from a callable the composition root provides (addresses change after start)."""

    def __init__(self, server: RPCServer, describe: Callable[[], peer_pb2.PeerInfo]) -> None:
        self.server = server
        self.describe = describe
        server.add_unary(HANDSHAKE, self.rpc_handshake, peer_pb2.HandshakeRequest, authenticated=False)
        server.add_unary(INFO, self.rpc_info, peer_pb2.InfoRequest)

    async def rpc_handshake(self, request: peer_pb2.HandshakeRequest, ctx: CallContext) -> peer_pb2.HandshakeResponse:
        if not 16 <= len(request.challenge) <= 64 or len(request.caller_peer_id) > 128:
            raise InvalidRequest("handshake challenge must be 16..64 bytes")
        identity = self.server.identity
        payload = handshake_payload(request.challenge, request.caller_peer_id, identity.peer_id)
        return peer_pb2.HandshakeResponse(public_key=identity.public_key, signature=identity.sign(payload))

    async def rpc_info(self, request: peer_pb2.InfoRequest, ctx: CallContext) -> peer_pb2.PeerInfo:
        info = self.describe()
        info.time = time.time()
        return info
