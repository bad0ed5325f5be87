"""`NetworkHandle`: what the layers above the network need of the peer they run on.

The identity and addresses, the channels out (`ChannelPool`), the server in (`RPCServer`, None
in client mode), the bridge from blocking code to the peer's event loop, and the peer's own
`Services`. `swarm.Peer` is the implementation; the DHT (`swarm.dht`) takes this interface,
and the layers above it take `swarm.dht.handle.PeerHandle`, which adds the DHT.
See docs/architecture.md, "Threads and loops".
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Protocol, TypeVar

from swarm.core.identity import Identity
from swarm.core.loop import LoopThread
from swarm.core.multiaddr import Multiaddr
from swarm.core.services import Component, Services
from swarm.net.channels import ChannelPool
from swarm.net.server import RPCServer

T = TypeVar("T")


class NetworkHandle(Protocol):
    """A peer as the network sees it (see the module docstring)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def identity(self) -> Identity: ...
    @property
    def addrs(self) -> Sequence[str]:
        """The multiaddrs (with /p2p/<PeerID>) others can dial; empty in client mode."""
        ...
    @property
    def initial_peers(self) -> Sequence[Multiaddr]: ...
    @property
    def client_mode(self) -> bool: ...
    @property
    def pool(self) -> ChannelPool: ...
    @property
    def server(self) -> RPCServer | None:
        """The server others call; None in client mode."""
        ...
    @property
    def loop(self) -> LoopThread:
        """The peer's event-loop thread; every coroutine of the peer runs there."""
        ...
    @property
    def services(self) -> Services: ...

    def run(self, coro: Coroutine[object, None, T], timeout: float | None = None) -> T:
        """Runs `coro` on the peer's loop and waits for it (from any other thread)."""
        ...

    def attach(self, component: Component) -> None:
        """Stops `component` when the peer shuts down (in reverse order of attaching)."""
        ...

    def detach(self, component: Component) -> None: ...
