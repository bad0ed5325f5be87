"""A peer for the hole-punching lab test (docs/relay.md, "Hole punching"): a server behind NAT, or
a caller behind another NAT that reaches it (unary calls and a state download over the bulk side
channel) and says how: punched directly or through the relay.

    python nat_punch.py serve HOST INITIAL_PEER          # prints {"addr", "reachability"}; stdin: stop
    python nat_punch.py call HOST INITIAL_PEER TARGET [client]   # prints {"ok", "state", "direct", ...};
                                                         # stdin "again": one more call on the same channel
"""

from __future__ import annotations

import json
import sys

import torch

from swarm.averaging import State, StateServer, load_state_from_peers
from swarm.peer import Peer

TENSOR = torch.arange(200_000, dtype=torch.float32)


def serve(host: str, initial: str) -> None:
    me = Peer(initial_peers=[initial], listen=f"/ip4/{host}/tcp/0")
    StateServer(me, "lab", lambda: State({"step": 1}, [TENSOR]), chunk_bytes=1 << 16)
    print(json.dumps({"addr": me.addrs[0], "reachability": me.nat.status if me.nat else ""}), flush=True)
    sys.stdin.readline()
    me.shutdown()


def call(host: str, initial: str, target: str, client_mode: bool = False) -> None:
    me = Peer(initial_peers=[initial], listen=f"/ip4/{host}/tcp/0", client_mode=client_mode)
    paths = me.pool.direct_paths
    assert paths is not None

    async def info() -> str:
        return (await me.pool.get(target).info()).peer_id

    line: dict[str, object] = {"ok": False, "state": False, "reachability": me.nat.status if me.nat else "client", "my_ip": paths.my_ip()}
    try:
        line["ok"] = bool(me.run(info(), timeout=20))
        got = load_state_from_peers(me, "lab", [target], timeout=30)
        line["state"] = torch.equal(got.tensors[0], TENSOR)
    except Exception as e:  # noqa: BLE001 - reported to the test
        line["error"] = f"{type(e).__name__}: {e}"
    line.update(direct=sum(paths.direct.values()), relayed=sum(paths.relayed.values()), failed=len(paths.failed), why=paths.last_error)
    print(json.dumps(line), flush=True)
    if sys.stdin.readline().strip() == "again":
        try:
            print(json.dumps({"ok": bool(me.run(info(), timeout=10))}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    me.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        call(sys.argv[2], sys.argv[3], sys.argv[4], client_mode=sys.argv[5:6] == ["client"])
