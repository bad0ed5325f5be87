"""DHT request timeouts follow each node's measured round trip (real peers, real gRPC).

The link to one node is slowed by the fault plan (a delay before each request, as on a long
link): the caller measures the delay in its round trips, so that node's timeout grows with it,
while a fast node's stays near the floor. A fast node that then stops answering (its requests
are lost) costs its own short timeout, not the fixed `request_timeout`.
"""

from __future__ import annotations

import pytest
from localswarm import Swarm

from swarm.core.errors import DeadlineExceeded
from swarm.core.faults import FaultPlan, LinkFault
from swarm.dht import DHTConfig
from swarm.dht.buckets import NodeInfo
from swarm.dht.wire import node_id_of

DELAY = 0.3


@pytest.mark.timeout(60)
def test_request_timeouts_follow_each_nodes_round_trip_and_a_dead_fast_node_costs_little():
    plan = FaultPlan()
    config = DHTConfig(request_timeout=10.0, min_request_timeout=0.2, lookup_timeout=30.0, fault_plan=plan)
    swarm = Swarm()
    try:
        caller, slow, fast = (swarm.add(config=config) for _ in range(3))
        plan.set_link(caller.peer_id, slow.peer_id, LinkFault(delay=DELAY))
        protocol = caller.dht.node.protocol
        nodes = {p.peer_id: NodeInfo(node_id_of(p.peer_id), p.peer_id, p.addrs[0]) for p in (slow, fast)}

        async def ping_all(times: int) -> None:
            for _ in range(times):
                for node in nodes.values():
                    assert await protocol.call_ping(node, reraise=True)

        caller.run(ping_all(6), timeout=30)
        slow_timeout = protocol.request_timeout_for(nodes[slow.peer_id])
        fast_timeout = protocol.request_timeout_for(nodes[fast.peer_id])
        # the slow link's round trips include the delay: its timeout is a multiple of it, under the cap
        assert DELAY * config.request_timeout_multiple <= slow_timeout < config.request_timeout, slow_timeout
        # the fast node's is a small multiple of its own (loopback) round trip: the floor, or near it
        assert fast_timeout < DELAY, fast_timeout
        assert caller.pool.estimates.rtt(slow.peer_id) >= DELAY

        # the fast node stops answering: a request to it is lost after its own timeout
        plan.set_link(caller.peer_id, fast.peer_id, LinkFault(loss=1.0))
        lost_after: list[float] = []

        async def lost_ping() -> None:
            node = nodes[fast.peer_id]
            lost_after.append(protocol.request_timeout_for(node))
            with pytest.raises(DeadlineExceeded):
                await protocol.call_ping(node, reraise=True)

        caller.run(lost_ping(), timeout=30)
        assert lost_after[0] == fast_timeout < config.request_timeout
    finally:
        swarm.close()
