"""A trainer's view of a swarm, for the NAT lab tests and scripts/bench/lab_relay.py: every tick it
runs a mixture forward over the grid and calls one expert directly at its declared address, and
prints one JSON line: {"t", "mixture", "expert", "addr", "error"}.

    python nat_client.py INITIAL_PEER UID DURATION_S HIDDEN_DIM
"""

from __future__ import annotations

import json
import sys
import time

import torch

from swarm.moe.client.expert import RemoteExpert
from swarm.moe.client.mixture import RemoteMixtureOfExperts
from swarm.moe.dht_declare import get_experts
from swarm.net.nat import NatConfig
from swarm.peer import Peer


def main() -> None:
    initial, uid, duration, hidden = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    # a Colab-like client: dials out only; no hole punch, as the test is about relays failing over
    peer = Peer(initial_peers=[initial], client_mode=True, nat=NatConfig(holepunch=False))
    moe = RemoteMixtureOfExperts(peer, in_features=hidden, grid_size=(2, 2), uid_prefix="ffn.", k_best=4,
                                 k_min=1, forward_timeout=3.0, exclude_failed_for=2.0)
    x = torch.randn(4, hidden)
    end = time.monotonic() + duration
    try:
        while time.monotonic() < end:
            line: dict[str, object] = {"t": time.time(), "mixture": False, "expert": False, "addr": "", "error": ""}
            try:
                with torch.no_grad():
                    line["mixture"] = bool(torch.isfinite(moe(x)).all())
            except Exception as e:  # noqa: BLE001 - reported, the loop goes on
                line["error"] = f"mixture: {type(e).__name__}: {e}"
            try:
                addr = peer.run(get_experts(peer.dht, [uid]), timeout=5).get(uid, "")
                line["addr"] = addr
                if addr:
                    with torch.no_grad():
                        line["expert"] = bool(torch.isfinite(RemoteExpert(peer, uid, addr, forward_timeout=2.0)(x)).all())
            except Exception as e:  # noqa: BLE001
                line["error"] = f"{line['error']} expert: {type(e).__name__}: {e}".strip()
            print(json.dumps(line), flush=True)
            time.sleep(0.2)  # the probe's pace
    finally:
        peer.shutdown()


if __name__ == "__main__":
    main()
