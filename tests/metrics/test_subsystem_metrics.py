"""Averaging rounds and expert batches show up in the metrics a peer serves."""

from __future__ import annotations

import threading

import torch

from swarm.averaging import Averager
from swarm.metrics import REGISTRY
from swarm.moe import ExpertServer, RemoteExpert
from swarm.peer import Peer


def test_averaging_rounds_are_counted():
    peers = [Peer(), Peer()]
    try:
        addrs = [p.addrs[0] for p in peers]
        avgs = [Averager(p, [torch.full((4,), float(i))], prefix="m", target_group_size=2, initial_group=addrs)
                for i, p in enumerate(peers)]
        before = REGISTRY.value("swarm_averaging_rounds_total", outcome="succeeded")
        threads = [threading.Thread(target=a.step, kwargs={"timeout": 10}) for a in avgs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert REGISTRY.value("swarm_averaging_rounds_total", outcome="succeeded") == before + 2
    finally:
        for p in peers:
            p.shutdown()


def test_expert_batches_and_queue_depth_are_exported():
    server_peer, client = Peer(), Peer(client_mode=True)
    try:
        module = torch.nn.Linear(8, 8)
        ExpertServer(server_peer, {"mx.0": module}, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
        before = REGISTRY.value("swarm_expert_batches_total", expert="mx.0")
        x = torch.randn(3, 8, requires_grad=True)
        RemoteExpert(client, "mx.0", addr=server_peer.addrs[0])(x).sum().backward()
        assert REGISTRY.value("swarm_expert_batches_total", expert="mx.0") == before + 2  # one forward, one backward
        assert REGISTRY.value("swarm_expert_queue_depth", expert="mx.0") == 0
    finally:
        client.shutdown()
        server_peer.shutdown()
