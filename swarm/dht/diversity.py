"""Network diversity of a node's contacts and of a key's replicas: a defence against Sybils.

Node IDs are hashes of PeerIDs, which cost nothing, so one machine can run thousands of
identities, fill a victim's k-buckets with them, or grind IDs near a key and take all of its
replicas. Addresses are not free: `PrefixDiversity` bounds what one *network prefix* (the host's
IPv4 /24 or IPv6 /64, as the server names sources) may hold:

- in a routing table, at most `per_bucket` contacts per prefix among the nodes that share the
  same number of leading ID bits with this node (one k-bucket of the unrelaxed table), and at
  most `per_table` in all (as libp2p's routing-table diversity filter does);
- among the nodes a record is stored on, at most `per_key` per prefix: a store skips the nearer
  nodes of a prefix that has its share and takes the next nearest of other networks.

Networks in `exempt` have no prefix (loopback, and the private ranges by default, so one-host
setups, LANs and the network lab behave as before; a node on the public Internet can set
`exempt=("127.0.0.0/8", "::1/128")`). A relayed address counts as its relay's network. What is
left to an attacker with many networks (a botnet) is in docs/threat-model.md.

Pure logic, no networking (`tests/dht/test_diversity.py`).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from swarm.core.errors import ConfigError
from swarm.dht.buckets import NodeInfo
from swarm.net.server import network_of

__all__ = ["DEFAULT_EXEMPT", "PrefixDiversity"]

DEFAULT_EXEMPT = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                  "169.254.0.0/16", "fc00::/7", "fe80::/10")


@dataclass(frozen=True)
class PrefixDiversity:
    """How many contacts and replicas one network prefix may have.

    Attributes:
        per_bucket: Contacts of one prefix among those sharing a common ID prefix length with this node.
        per_table: Contacts of one prefix in the whole routing table.
        per_key: Nodes of one prefix a record is stored on.
        prefix_v4: Bits of an IPv4 address that name its network.
        prefix_v6: Bits of an IPv6 address that name its network.
        exempt: Networks whose nodes are not limited.
    """

    per_bucket: int = 2
    per_table: int = 10
    per_key: int = 2
    prefix_v4: int = 24
    prefix_v6: int = 64
    exempt: tuple[str, ...] = DEFAULT_EXEMPT

    def __post_init__(self) -> None:
        if min(self.per_bucket, self.per_table, self.per_key) < 1:
            raise ConfigError("PrefixDiversity limits must be >= 1")
        if not (0 <= self.prefix_v4 <= 32 and 0 <= self.prefix_v6 <= 128):
            raise ConfigError("PrefixDiversity.prefix_v4 must be in 0..32 and prefix_v6 in 0..128")
        try:
            object.__setattr__(self, "exempt", tuple(str(ipaddress.ip_network(n, strict=False)) for n in self.exempt))
        except ValueError as e:
            raise ConfigError(f"PrefixDiversity.exempt: {e}") from None

    def prefix_of(self, addr: str) -> str:
        """The network of a node's multiaddr ("10.1.2.0/24", "dns:example.org"); "" if exempt or unknown."""
        return _prefix(addr, self.prefix_v4, self.prefix_v6, self.exempt)

    def pick(self, nodes: Iterable[NodeInfo], count: int, prior: Iterable[NodeInfo] = ()) -> list[NodeInfo]:
        """The first `count` of `nodes` (nearest first) with at most `per_key` of one prefix,
        counting the `prior` choices (nodes sent the record already) towards each prefix's share."""
        chosen: list[NodeInfo] = []
        taken: dict[str, int] = {}
        before = set()
        for node in prior:
            before.add(node.node_id)
            prefix = self.prefix_of(node.addr)
            if prefix:
                taken[prefix] = taken.get(prefix, 0) + 1
        for node in nodes:
            if len(chosen) >= count:
                break
            prefix = self.prefix_of(node.addr)
            if prefix and node.node_id not in before:
                if taken.get(prefix, 0) >= self.per_key:
                    continue
                taken[prefix] = taken.get(prefix, 0) + 1
            chosen.append(node)
        return chosen


@functools.lru_cache(maxsize=16384)
def _prefix(addr: str, bits_v4: int, bits_v6: int, exempt: tuple[str, ...]) -> str:
    parts = addr.split("/")
    if len(parts) < 3:
        return ""
    protocol, host = parts[1], parts[2]
    if protocol in ("dns", "dns4", "dns6"):
        return "dns:" + host.lower()
    if protocol not in ("ip4", "ip6"):
        return ""
    return network_of(host, exempt, bits_v4, bits_v6)


