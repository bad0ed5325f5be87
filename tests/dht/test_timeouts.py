"""DHT request timeouts follow each node's measured round trip (real peers, real gRPC).

The link to one node is slowed by the fault plan (a delay before each request, as on a long
link): the caller measures the delay in its round trips, so that node's timeout grows with it,
while a fast node's stays near the floor. A fast node that then stops answering (its requests
are lost) costs its own short timeout, not the fixed `request_timeout`.
"""

from __future__ import annotations

import time

import pytest
from localswarm import Swarm

from swarm.core.errors import DeadlineExceeded
from swarm.core.faults import FaultPlan, LinkFault
from swarm.dht import DHTConfig
from swarm.dht.buckets import NodeInfo
from swarm.dht.wire import PING, node_id_of
from swarm.metrics import REGISTRY
from swarm.net.estimates import MAX_BACKOFF, LinkEstimates

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
        # One round trip stretched by a loaded machine (the suite's two workers on two cores) inflates
        # RFC 6298's variance term for a few dozen samples after it: once a 5.8 s timeout here, what a
        # first sample of ~0.5 s gives. More loopback samples let it decay; a timeout that did not
        # follow the fast node's round trips would not.
        for _ in range(40):
            if protocol.request_timeout_for(nodes[fast.peer_id]) < DELAY:
                break
            caller.run(protocol.call_ping(nodes[fast.peer_id], reraise=True), timeout=10)
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


def test_rto_doubles_per_timeout_until_a_fresh_sample():
    estimates = LinkEstimates()
    assert estimates.timed_out("never-seen") == 0  # nothing measured: the caller's cap applies anyway
    estimates.observe_rtt("a", 0.1)  # RFC 6298 §2.2: SRTT 0.1, RTTVAR 0.05, RTO 0.3
    link = estimates.get("a")
    assert link.rto() == pytest.approx(0.3)
    assert estimates.timed_out("a") == 1
    assert link.rto() == pytest.approx(0.6) and link.rto(backed_off=False) == pytest.approx(0.3)
    assert estimates.retransmit_after("a", floor=0.0, cap=10.0) == pytest.approx(0.6)  # the resend delay too
    for _ in range(20):
        estimates.timed_out("a")
    assert link.backoff_factor() == 1 << MAX_BACKOFF
    estimates.observe_rtt("a", 0.1)  # §5.7: an answer ends the backoff
    assert link.backoff == 0 and link.rto() < 0.3


@pytest.mark.timeout(60)
def test_a_link_that_slows_after_it_was_measured_gets_its_answer_from_the_backed_off_retry():
    """The default config: a node measured on loopback gets the 1 s floor, not the 3 s cap; when its
    link then takes 1.5 s, the request times out at 1 s, the node's timeout doubles, the request
    goes again with the doubled one, and the first answer (1.5 s) is taken. A dead node costs the
    floor and the backed-off timeout, within the cap."""
    plan = FaultPlan()
    config = DHTConfig(fault_plan=plan)
    assert config.min_request_timeout < config.request_timeout  # measured timeouts are on by default
    swarm = Swarm()
    try:
        caller, slowed, dead = (swarm.add(config=config) for _ in range(3))
        protocol = caller.dht.node.protocol
        nodes = {p.peer_id: NodeInfo(node_id_of(p.peer_id), p.peer_id, p.addrs[0]) for p in (slowed, dead)}

        async def ping(node: NodeInfo, times: int = 1) -> None:
            for _ in range(times):
                assert await protocol.call_ping(node, reraise=True)

        for node in nodes.values():
            caller.run(ping(node, 4), timeout=30)
            assert protocol.request_timeout_for(node) == config.min_request_timeout  # loopback: the floor

        plan.set_link(caller.peer_id, slowed.peer_id, LinkFault(delay=1.5))
        node = nodes[slowed.peer_id]
        timeouts_seen = REGISTRY.value("swarm_dht_request_timeouts_total", method="Ping") or 0.0
        sent = protocol.calls_sent[PING]
        started = time.monotonic()
        caller.run(ping(node), timeout=30)  # with the 1 s timeout alone: DeadlineExceeded
        took = time.monotonic() - started
        assert 1.5 <= took < config.request_timeout, took  # the first request's answer, not the retry's
        assert protocol.timeouts[PING] == 1 and protocol.calls_sent[PING] - sent == 2
        # what drove it is visible: the timeout counted (each request's timeout is in the debug log)
        assert REGISTRY.value("swarm_dht_request_timeouts_total", method="Ping") >= timeouts_seen + 1
        assert caller.pool.estimates.get(slowed.peer_id).backoff == 0  # the answer was a fresh sample
        assert protocol.request_timeout_for(node) > 1.5  # its RTT now includes the slow link

        plan.set_link(caller.peer_id, dead.peer_id, LinkFault(loss=1.0))
        node = nodes[dead.peer_id]
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            caller.run(ping(node), timeout=30)
        took = time.monotonic() - started
        assert 1.0 * config.min_request_timeout <= took <= config.request_timeout + 0.5, took
        # timed out twice (the floor, then the backed-off retry): 4x the floor, within the cap
        assert protocol.request_timeout_for(node) == min(config.request_timeout, 4 * config.min_request_timeout)
    finally:
        swarm.close()
