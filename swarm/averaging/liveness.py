"""Whether a member is gone: its host refuses a TCP connection to its address.

A process that was killed leaves its port closed, and its host answers a connect with a refusal
(RST) at once; a stalled process's kernel still accepts, and a lost host does not answer. So a
refusal is proof enough to stop waiting for that member (`agreement.Coordinator`, the reducer's
senders), while anything else leaves the round's deadlines in charge.
"""

from __future__ import annotations

import asyncio

from swarm.core.multiaddr import Multiaddr

__all__ = ["refuses_connections"]


async def refuses_connections(addr: str) -> bool:
    """True when a TCP connect to the peer at `addr` is refused. False when it connects or fails
    otherwise; a connect that hangs lasts until the caller's timeout. Relayed and empty addresses
    cannot be probed: False."""
    try:
        target = Multiaddr.parse(addr)
    except ValueError:
        return False
    if target.relay_id or not target.port:
        return False
    try:
        _, writer = await asyncio.open_connection(target.host, target.port)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    writer.close()
    return False
