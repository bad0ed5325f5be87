"""Whether a member is gone: its host refuses a TCP connection to its address.

A process that was killed leaves its port closed, and its host answers a connect with a refusal
(RST) at once; a stalled process's kernel still accepts, and a lost host does not answer. So a
refusal is proof enough to stop waiting for that member (`agreement.Coordinator`, the reducer's
senders), while anything else leaves the round's deadlines in charge.

A process on its way out may close its connections before its listening port: a member whose
stream broke then probes a port that still accepts, and the kernel resets that connection a
moment later, when the port closes. So a connection that is closed or reset within `SETTLE`
seconds, without a byte, is asked again; a peer that holds it open (or speaks) is there.
"""

from __future__ import annotations

import asyncio

from swarm.core.multiaddr import Multiaddr

__all__ = ["SETTLE", "refuses_connections"]

SETTLE = 0.5       # seconds a live peer holds a probe's connection open before the probe believes it
_ATTEMPTS = 8      # connects at most, while each is closed at once


async def refuses_connections(addr: str, settle: float = SETTLE) -> bool:
    """True when a TCP connect to the peer at `addr` is refused. False when a connection stays open
    for `settle` seconds (or the peer sends on it) or the connect fails otherwise; a connect that
    hangs lasts until the caller's timeout. Relayed and empty addresses cannot be probed: False."""
    try:
        target = Multiaddr.parse(addr)
    except ValueError:
        return False
    if target.relay_id or not target.port:
        return False
    loop = asyncio.get_running_loop()
    end = loop.time() + settle
    for _ in range(_ATTEMPTS):
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        try:
            spoke = await asyncio.wait_for(reader.read(1), max(0.0, end - loop.time()))
        except TimeoutError:
            return False  # held open: a live (or stalled) process
        except OSError:  # reset: a port closing under its queued connections
            spoke = b""
        finally:
            writer.close()
        if spoke or loop.time() >= end:
            return False
    return False
