"""One averaging peer for the NAT lab tests: joins, prints its address, averages once with the
group it is given, and serves a state; or, as a newcomer, downloads that state.

    python nat_averager.py peer HOST INITIAL_PEER INDEX     # stdin: {"addrs": [...]}; prints JSON lines
    python nat_averager.py newcomer HOST STATE_PEER_ADDR    # prints {"equal": bool, ...}
"""

from __future__ import annotations

import json
import sys

import torch

from swarm.averaging import Averager, State, StateServer, load_state_from_peers
from swarm.peer import Peer

NUMEL = 100_000


def inputs(index: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(index))


def state() -> State:
    return State({"step": 3}, [torch.arange(300_000, dtype=torch.float32)])


def peer(host: str, initial: str, index: int) -> None:
    me = Peer(initial_peers=[initial] if initial else [], listen=f"/ip4/{host}/tcp/0")
    StateServer(me, "lab", state, chunk_bytes=1 << 16)
    print(json.dumps({"addr": me.addrs[0], "reachability": me.nat.status if me.nat else ""}), flush=True)
    command = json.loads(sys.stdin.readline())
    tensors = [inputs(index).clone()]
    averager = Averager(me, tensors, prefix="lab", target_group_size=len(command["addrs"]),
                        initial_group=command["addrs"])
    try:
        result = averager.step(timeout=60)
        exact = sum(inputs(i) for i in range(len(command["addrs"]))) / len(command["addrs"])
        print(json.dumps({"ok": True, "max_err": float((tensors[0] - exact).abs().max()),
                          "contributors": sorted(result.contributors)}), flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    sys.stdin.readline()  # serve the state until told to stop
    me.shutdown()


def newcomer(host: str, addr: str) -> None:
    with Peer(listen=f"/ip4/{host}/tcp/0", client_mode=True) as me:
        got = load_state_from_peers(me, "lab", [addr], timeout=60)
        expected = state()
        print(json.dumps({"equal": got.metadata == expected.metadata
                          and all(torch.equal(a, b) for a, b in zip(got.tensors, expected.tensors, strict=True)),
                          "sources": got.sources}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "peer":
        peer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        newcomer(sys.argv[2], sys.argv[3])
