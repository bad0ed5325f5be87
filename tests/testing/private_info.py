"""A private swarm member that calls `Info` on one address and prints one JSON line (the lab test
of a NAT'd member behind an invited relay): {"ok", "peer_id", "error"}.

    python private_info.py AUTHORITY MEMBERSHIP_FILE IDENTITY_FILE ADDRESS
"""

from __future__ import annotations

import json
import sys

from swarm.core.errors import RPCError
from swarm.peer import Peer


def main() -> None:
    authority, membership, identity, address = sys.argv[1:5]
    peer = Peer(client_mode=True, identity_path=identity, swarm_authority=authority, membership=membership)
    try:
        async def call() -> str:
            return (await peer.pool.get(address).info(timeout=20)).peer_id

        print(json.dumps({"ok": True, "peer_id": peer.run(call(), timeout=60), "error": ""}), flush=True)
    except RPCError as e:
        print(json.dumps({"ok": False, "peer_id": "", "error": str(e)}), flush=True)
    finally:
        peer.shutdown()


if __name__ == "__main__":
    main()
