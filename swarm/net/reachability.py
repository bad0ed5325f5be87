"""Reachability detection, AutoNAT's idea: a peer asks a few others to dial its advertised
addresses back, and concludes whether it is publicly reachable (docs/relay.md).

A peer answering `DialBack` dials only addresses on the IP address the request came from (so
it cannot be used to make connections to third parties), at most a few, one request at a time
per caller; it reports an address reachable when a TLS session there proves the caller's
PeerID. Its answer also says whether it relays, so the same round trips find the relays.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarm.core.errors import MultiaddrError, RPCError
from swarm.core.multiaddr import Multiaddr
from swarm.net.channels import ChannelPool
from swarm.net.server import CallContext, RPCServer
from swarm.net.tls import probe as tls_probe
from swarm.net.tls import prove as tls_prove
from swarm.proto import relay_pb2

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)

DIAL_BACK = "/swarm.Relay/DialBack"
MAX_DIALED = 4
PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"


def observed_ip(grpc_context: grpc.aio.ServicerContext | None) -> str | None:
    """The caller's IP as the transport saw it ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    if grpc_context is None:  # a call over the bulk side channel
        return None
    try:
        peer = grpc_context.peer()
    except Exception:  # noqa: BLE001 - no transport to ask (a bulk call)
        return None
    kind, _, rest = str(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]").split("%")[0]
    return None


class DialBackService:
    """Serves `DialBack` on a peer's server.

    Args:
        server: the peer's server.
        relay_addr: returns this peer's relay address, or "" when it does not relay.
        tls: dial back with TLS and check the PeerID (False: insecure peers, TCP reachability only).
        timeout: seconds per dial.
    """

    def __init__(self, server: RPCServer, relay_addr: Callable[[], str], tls: bool = True,
                 timeout: float = 3.0) -> None:
        self.relay_addr = relay_addr
        self.tls = tls
        self.timeout = timeout
        self._busy: set[str] = set()  # callers with a dial-back under way
        server.add_unary(DIAL_BACK, self.rpc_dial_back, relay_pb2.DialBackRequest)

    async def rpc_dial_back(self, request: relay_pb2.DialBackRequest, ctx: CallContext) -> relay_pb2.DialBackResponse:
        observed = observed_ip(ctx.grpc_context) or ""
        response = relay_pb2.DialBackResponse(observed=observed, relay=self.relay_addr())
        if not request.addrs or not ctx.peer_id:
            return response
        if ctx.peer_id in self._busy:
            response.results.add(addr="", reachable=False, error="a dial-back for you is under way")
            return response
        self._busy.add(ctx.peer_id)
        try:
            results = await asyncio.gather(*(self._dial(text, observed, ctx.peer_id)
                                             for text in request.addrs[:MAX_DIALED]))
        finally:
            self._busy.discard(ctx.peer_id)
        response.results.extend(results)
        return response

    async def _dial(self, text: str, observed: str, caller: str) -> relay_pb2.DialBackResult:
        result = relay_pb2.DialBackResult(addr=text[:256])
        try:
            addr = Multiaddr.parse(text)
        except MultiaddrError as e:
            result.error = str(e)
            return result
        host = addr.host
        if not addr.relay_id and observed and not _is_ip(host):
            # a name (`/dns4/expert/...`, a container's or a host's): dialed only if it names the
            # address the request came from, so a name never points the dial at a third party
            host = observed if observed in await self._resolve(host, addr.port) else host
        if addr.relay_id:
            result.error = "a relayed address"
        elif host != observed:
            # never dial a third party; a peer whose address is not the one it comes from is behind NAT
            result.error = f"your connection comes from {observed or 'an unknown address'}, not {addr.host}"
        else:
            found = await (tls_prove(host, addr.port, caller, self.timeout) if self.tls
                           else tls_probe(host, addr.port, self.timeout))
            if not found.reachable:
                result.error = f"cannot connect: {found.error}"
            elif self.tls and found.peer_id != caller:
                result.error = f"the peer there is not you: {found.error or 'no swarm peer'}"
            else:
                result.reachable = True
        return result

    async def _resolve(self, name: str, port: int) -> set[str]:
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM), self.timeout)
        except (OSError, TimeoutError, UnicodeError):
            return set()
        return {str(info[4][0]) for info in infos}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass
class Reachability:
    """What a peer found out about itself.

    Attributes:
        status: "public" (some peer dialed it back), "private" (peers answered, none could), or
            "unknown" (nobody answered, or nobody was asked).
        confirmed: PeerIDs that reached it.
        refuted: PeerIDs that could not, with their reason.
        relays: relays' addresses seen in the answers.
        observed: the addresses peers saw it come from.
    """

    status: str = UNKNOWN
    confirmed: list[str] = field(default_factory=list)
    refuted: dict[str, str] = field(default_factory=dict)
    relays: list[Multiaddr] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.confirmed and not self.refuted and self.status != UNKNOWN:
            return f"{self.status} (as configured; no dial-back asked)"
        if self.status == PUBLIC:
            return f"public: dialed back by {len(self.confirmed)} of {len(self.confirmed) + len(self.refuted)} peers"
        if self.status == PRIVATE:
            why = next(iter(self.refuted.values()), "")
            return f"private (behind NAT or a firewall): {len(self.refuted)} peers could not dial back ({why})"
        return "unknown: no peer answered a dial-back request"


async def call_dial_back(pool: ChannelPool, peer: Multiaddr, addrs: Sequence[str],
                         timeout: float) -> relay_pb2.DialBackResponse:
    """Asks `peer` to dial `addrs` back (empty: only asks whether it relays)."""
    channel = pool.get(peer) if peer.peer_id else await pool.dial_unknown(peer)
    return await channel.unary(DIAL_BACK, relay_pb2.DialBackRequest(addrs=list(addrs)),
                               relay_pb2.DialBackResponse, timeout=timeout)


async def detect(pool: ChannelPool, peers: Sequence[Multiaddr], addrs: Sequence[str], *, ask: int = 3,
                 timeout: float = 8.0) -> Reachability:
    """Asks up to `ask` of `peers` to dial `addrs` back, concurrently, and concludes."""
    me = pool.identity.peer_id
    asked = [p for p in peers if p.peer_id != me][:ask]
    found = Reachability()
    answers = await asyncio.gather(*(asyncio.wait_for(call_dial_back(pool, p, addrs, timeout), timeout)
                                     for p in asked), return_exceptions=True)
    for peer, answer in zip(asked, answers, strict=True):
        name = peer.peer_id or str(peer)
        if isinstance(answer, BaseException):
            if not isinstance(answer, RPCError | TimeoutError | MultiaddrError):
                raise answer
            logger.debug("dial-back by %s failed: %s", name, answer)
            continue
        if answer.relay:
            try:
                found.relays.append(Multiaddr.parse(answer.relay))
            except MultiaddrError:
                pass
        if answer.observed:
            found.observed.append(answer.observed)
        if any(r.reachable for r in answer.results):
            found.confirmed.append(name)
        else:
            found.refuted[name] = next((r.error for r in answer.results if r.error), "no address dialed")
    if found.confirmed:
        found.status = PUBLIC
    elif found.refuted:
        found.status = PRIVATE
    return found
