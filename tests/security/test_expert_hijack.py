"""Attack 1: an anonymous writer points experts at its own address with unsigned stores that
expire in 1e300 s. Every declaration is signed by its server and readers trust only those, and a
node refuses records expiring past its horizon, so the real server keeps its experts."""

from __future__ import annotations

import msgpack
import pytest
import torch
from attacks import HID, nodes_for, raw_record, serve, store_raw

from swarm.core.identity import Identity
from swarm.dht.wire import STORED
from swarm.moe import RemoteExpert
from swarm.moe.dht_declare import DHTExpertSource

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_unsigned_far_future_stores_cannot_hijack_experts(make_peer) -> None:
    with serve("ffn.[0:2]") as server:
        real = server.addrs[0]
        owner = real.rsplit("/p2p/", 1)[1]
        attacker = make_peer(initial_peers=server.addrs, client_mode=True)
        fake = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"
        pack = msgpack.packb
        forever = 1e300
        records = []
        for coord, uid in enumerate(("ffn.0", "ffn.1")):
            # the declarations as they were before they were signed, and forged owned ones
            records += [
                raw_record("ffn.", pack([uid, fake]), forever, coord),
                raw_record(uid, pack(fake), forever),
                raw_record("ffn.", pack([uid, fake]), forever, f"{coord}[owner:{owner}]"),
                raw_record(uid, pack(fake), forever, f"[owner:{owner}]"),
                raw_record(uid, pack(real.replace("/tcp/", "/tcp/1")), forever, f"[owner:{owner}]"),
            ]
        answers = store_raw(attacker, records, nodes_for(attacker, "ffn."))
        refused = [result for results in answers for result in results if result.status != STORED]
        assert len(refused) == len(records) * len(answers), [r.reason for r in refused]
        assert all(("signature" in r.reason or "expires more than" in r.reason) for r in refused), refused

        client = make_peer(initial_peers=server.addrs, client_mode=True)
        source = DHTExpertSource(client.dht)
        experts = client.run(source.get_experts(["ffn.0", "ffn.1"]), timeout=30)
        successors = client.run(source.get_successors(["ffn."]), timeout=30)
        assert experts == {"ffn.0": real, "ffn.1": real}
        assert successors == {"ffn.": {0: ("ffn.0", real), 1: ("ffn.1", real)}}
        output = RemoteExpert(client, "ffn.1")(torch.randn(3, HID))  # the honest server keeps serving
        assert output.shape == (3, HID)
        assert server.proc.poll() is None
