"""Probes a container needs, reached as `swarm-peer status --self` and `swarm-peer status --resolve`.

`run_self` is the image's HEALTHCHECK: it dials the peer's own port, proves the PeerID with the
handshake (and, when SWARM_IDENTITY names a readable key, that it is this container's identity),
and calls the authenticated `Info`; exit 0 if it answers, 1 if not. Without a port it reads the
daemon's options from /proc/1 (when PID 1 is `swarm-peer`), else from SWARM_* variables and
--config, exactly as the daemon would. A client-mode peer serves nothing and counts as healthy.

`run_resolve` prints a multiaddr with ``/p2p/<PeerID>`` appended, learning the PeerID from the
handshake of whoever answers there (retrying while the peer starts). docker/swarm-join.sh uses it
to join a bootstrap peer known only by host name; it trusts the first answer at that address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.core.errors import PermissionDenied, SwarmError
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.net.channels import ChannelConfig, ChannelPool

if TYPE_CHECKING:
    from swarm.cli.config import PeerOptions

logger = logging.getLogger("swarm.cli.health")

DEFAULT_TIMEOUT = 5.0


def _daemon_argv(pid: int = 1) -> list[str] | None:
    """The arguments `swarm-peer` was started with, if process `pid` is a `swarm-peer` daemon."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return None
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "swarm-peer" and i <= 1:
            rest = argv[i + 1:]
            break
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in ("swarm", "swarm.cli.peer"):
            rest = argv[i + 2:]
            break
    else:
        return None
    return None if rest[:1] == ["status"] else rest


def _daemon_options() -> PeerOptions:
    from swarm.cli.config import build_parser as daemon_parser
    from swarm.cli.config import resolve

    argv = _daemon_argv() or []
    known, _ = daemon_parser().parse_known_args(argv)
    return resolve(known)


async def _probe(target: Multiaddr, expected_peer_id: str | None, timeout: float, insecure: bool = False) -> str:
    pool = ChannelPool(Identity.generate(), ChannelConfig(tls=not insecure))
    try:
        addr = target.with_peer_id(expected_peer_id) if expected_peer_id else target
        channel = (await asyncio.wait_for(pool.dial_unknown(addr), timeout)) if not expected_peer_id \
            else pool.get(addr)
        try:
            info = await channel.info(timeout)
        except PermissionDenied:  # TLS proved its PeerID; it serves members only, and is up
            return f"ok {channel.peer_id} (a private swarm's peer: it refused this uninvited probe)"
        return f"ok {info.peer_id} {info.role} {' '.join(info.addrs)}"
    finally:
        await pool.close()


def _expected_peer_id(identity_path: str | None) -> str | None:
    """The PeerID in the daemon's key file, if this process may read it (the probe does not lock it)."""
    if not identity_path:
        return None
    try:
        return Identity.from_private_bytes(Path(identity_path).read_bytes()).peer_id
    except (OSError, SwarmError):
        return None


def run_self(port: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> int:
    """Probes the peer running here; prints why and returns 1 when it does not answer."""
    try:
        options = _daemon_options()
    except SwarmError as e:
        print(f"unhealthy: cannot read the peer's options: {e}", file=sys.stderr)
        return 1
    if options.client_mode and port is None:
        print("ok: client-mode peer (it serves nothing to probe)")
        return 0
    listen = Multiaddr.parse(options.listen)
    host = listen.host
    if listen.is_unspecified:
        host = "127.0.0.1" if listen.protocol == "ip4" else "::1"
    port = port if port is not None else listen.port
    if not port:
        print("unhealthy: the peer listens on port 0; pass --port", file=sys.stderr)
        return 1
    target = Multiaddr(listen.protocol if listen.protocol in ("ip4", "ip6") else "ip4", host, port)
    try:
        message = asyncio.run(asyncio.wait_for(
            _probe(target, _expected_peer_id(options.identity), timeout, options.insecure), timeout * 2))
    except (SwarmError, TimeoutError, OSError) as e:
        print(f"unhealthy: peer at {target} did not answer: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(message)
    return 0


def run_resolve(maddr: str, wait: float = 0.0, timeout: float = DEFAULT_TIMEOUT, insecure: bool = False) -> int:
    """Prints `maddr` with /p2p/<PeerID> of the peer answering there, retrying up to `wait` seconds."""
    addr = Multiaddr.parse(maddr)
    if addr.peer_id:
        print(addr)
        return 0

    async def resolve() -> str:
        pool = ChannelPool(Identity.generate(), ChannelConfig(tls=not insecure))
        deadline = time.monotonic() + wait
        try:
            while True:
                try:
                    channel = await asyncio.wait_for(pool.dial_unknown(addr), timeout)
                    return str(addr.with_peer_id(channel.peer_id))
                except (SwarmError, TimeoutError, OSError) as e:
                    if time.monotonic() >= deadline:
                        raise
                    logger.info("no peer at %s yet (%s); retrying", addr, e)
                    await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # polling a remote host
        finally:
            await pool.close()

    try:
        print(asyncio.run(resolve()))
    except (SwarmError, TimeoutError, OSError) as e:
        print(f"swarm-peer status: no peer answered at {addr}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
