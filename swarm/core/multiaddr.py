"""libp2p multiaddrs for the addresses swarm dials: `/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>[/p2p/<PeerID>]`,
and relayed ones, `<relay's address>/p2p/<relay>/p2p-circuit[/p2p/<PeerID>]` (docs/relay.md).

Only the text form is needed (CLI, DHT records); it follows the multiaddr spec, and tests hold
it against the `multiaddr` package of the libp2p project. Other protocols (quic, ws) are refused
with a clear message instead of being half-understood.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from swarm.core.errors import IdentityError, MultiaddrError
from swarm.core.identity import peer_id_to_public_key

_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


@dataclass(frozen=True)
class Multiaddr:
    """A TCP endpoint, optionally naming the peer expected there. A relayed address keeps the
    relay's endpoint in `protocol`, `host`, `port` and the relay's PeerID in `relay_id`; the peer
    behind it is `peer_id`."""

    protocol: str  # one of ip4, ip6, dns, dns4, dns6
    host: str
    port: int
    peer_id: str | None = None
    relay_id: str | None = None

    @classmethod
    def parse(cls, text: str) -> Multiaddr:
        """Parses `/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...`; raises `MultiaddrError` on anything else."""
        if not isinstance(text, str) or not text.startswith("/"):
            raise MultiaddrError(f"a multiaddr starts with '/', got {text!r}")
        return _parse_cached(text)  # a peer parses the same few addresses every round

    @classmethod
    def _parse(cls, text: str) -> Multiaddr:
        parts = text.rstrip("/").split("/")[1:]
        if (len(parts) - parts.count("p2p-circuit")) % 2:
            raise MultiaddrError(f"multiaddr {text!r}: protocol {parts[-1]!r} has no value")
        pairs = list(zip(parts[0::2], parts[1::2]))
        if len(pairs) < 2 or pairs[0][0] not in _HOST_PROTOCOLS or pairs[1][0] != "tcp":
            raise MultiaddrError(
                f"multiaddr {text!r}: swarm dials /ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>[/p2p/<PeerID>]"
            )
        (protocol, host), (_, port_text) = pairs[0], pairs[1]
        _check_host(protocol, host, text)
        try:
            port = int(port_text)
        except ValueError:
            raise MultiaddrError(f"multiaddr {text!r}: tcp port {port_text!r} is not a number") from None
        if not 0 <= port <= 65535:
            raise MultiaddrError(f"multiaddr {text!r}: tcp port {port} is out of range")
        relay_id = None
        rest = parts[4:]  # not pairs: "p2p-circuit" has no value
        if len(rest) >= 3 and rest[0] in ("p2p", "ipfs") and rest[2] == "p2p-circuit":
            relay_id = _check_peer_id(rest[1], text)
            rest = rest[3:]
        if rest and (len(rest) != 2 or rest[0] not in ("p2p", "ipfs")):
            raise MultiaddrError(f"multiaddr {text!r}: unsupported part /{rest[0]}")
        peer_id = _check_peer_id(rest[1], text) if rest else None
        if protocol == "ip6":
            host = str(ipaddress.IPv6Address(host))
        return cls(protocol, host, port, peer_id, relay_id)

    def __str__(self) -> str:
        circuit = f"/p2p/{self.relay_id}/p2p-circuit" if self.relay_id else ""
        tail = f"/p2p/{self.peer_id}" if self.peer_id else ""
        return f"/{self.protocol}/{self.host}/tcp/{self.port}{circuit}{tail}"

    @property
    def relay(self) -> Multiaddr | None:
        """For a relayed address, the relay's own address (`/.../tcp/P/p2p/<relay>`); else None."""
        return Multiaddr(self.protocol, self.host, self.port, self.relay_id) if self.relay_id else None

    @property
    def grpc_target(self) -> str:
        """The `host:port` string grpc dials."""
        host = f"[{self.host}]" if self.protocol == "ip6" else self.host
        return f"{host}:{self.port}"

    def with_peer_id(self, peer_id: str | None) -> Multiaddr:
        return Multiaddr(self.protocol, self.host, self.port, peer_id, self.relay_id)

    def with_port(self, port: int) -> Multiaddr:
        return Multiaddr(self.protocol, self.host, port, self.peer_id, self.relay_id)

    def circuit(self, peer_id: str) -> Multiaddr:
        """`peer_id`'s relayed address through the relay at this address (which names the relay)."""
        if not self.peer_id or self.relay_id:
            raise MultiaddrError(f"{self} is no relay's address: it must end in /p2p/<relay PeerID>")
        return Multiaddr(self.protocol, self.host, self.port, peer_id, self.peer_id)

    @property
    def is_unspecified(self) -> bool:
        """True for 0.0.0.0 / :: (a listen address, not one others can dial)."""
        return self.protocol in ("ip4", "ip6") and ipaddress.ip_address(self.host).is_unspecified


def is_relayed(addr: str) -> bool:
    """Whether a multiaddr's text is a relayed address (`.../p2p-circuit/...`), without parsing it."""
    return "/p2p-circuit" in addr


def _check_peer_id(peer_id: str, text: str) -> str:
    try:
        peer_id_to_public_key(peer_id)
    except IdentityError as e:
        raise MultiaddrError(f"multiaddr {text!r}: {e}") from None
    return peer_id


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> Multiaddr:
    """`Multiaddr.parse` of valid addresses, remembered: checking a PeerID decodes its key, and the
    channel pool and the averaging rounds parse the same addresses over and over (a refused text
    raises every time, so only valid ones are kept)."""
    return Multiaddr._parse(text)


def _check_host(protocol: str, host: str, text: str) -> None:
    try:
        if protocol == "ip4":
            ipaddress.IPv4Address(host)
        elif protocol == "ip6":
            ipaddress.IPv6Address(host)
        elif not host or len(host) > 253 or any(c in host for c in " :[]"):
            raise ValueError(host)
    except ValueError:
        raise MultiaddrError(f"multiaddr {text!r}: {host!r} is not a valid /{protocol} host") from None
