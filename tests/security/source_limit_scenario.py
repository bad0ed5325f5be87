"""Many identities from one host against an expert server, run inside a network namespace of its
own (`test_source_limits.py` starts this with `unshare --net`, so the addresses below exist only
there and vanish with the process). Prints one JSON line with what happened.

Five attacker identities dial from 10.77.0.1, each opening 64 Forward streams (its per-caller
share) that send a header and stall: 320 streams, more than the server's 256 slots. An honest
client dials from 10.88.0.1, another /24, and calls an expert.
"""

from __future__ import annotations

import asyncio
import json
import threading

import torch
from netns import add_addresses
from torch import nn

ATTACKER_HOST = "10.77.0.1"
HONEST_HOST = "10.88.0.1"
IDENTITIES = 5
STREAMS = 64
HID = 8
HELD = 128  # the server's default max_inflight_per_source


class _Settled:
    """Counts the attack's streams that have their answer (a refusal comes at once; a held stream
    has none until released), across the attackers' loops, and says when every stream past the
    held ones has been answered. The gRPC server need not take up a connection's streams in the
    order they were opened, so the sentinel call alone does not show that all were taken up, and
    releasing the held streams before then would let a late one in."""

    def __init__(self, expected: int) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._expected = expected
        self.event = threading.Event()

    def answered(self) -> None:
        with self._lock:
            self._count += 1
            if self._count >= self._expected:
                self.event.set()


async def _held(stall: asyncio.Event, first: list[bytes]):
    for message in first:
        yield message
    await stall.wait()


def main() -> None:
    add_addresses(ATTACKER_HOST, HONEST_HOST)

    from swarm.core.errors import NotFound, ResourceExhausted, RPCError
    from swarm.core.multiaddr import Multiaddr
    from swarm.moe import ExpertServer, ExpertServerConfig, RemoteExpert
    from swarm.moe.protocol import FORWARD, call_forward
    from swarm.moe.schema import TensorSchema
    from swarm.net.streaming import tensors_to_messages
    from swarm.peer import Peer

    peers: list[Peer] = []
    try:
        server_peer = Peer(listen="/ip4/0.0.0.0/tcp/0")  # inside this namespace: its loopback only
        peers.append(server_peer)
        # a long body grace, so that only the limits per source and per caller hold the stalls back
        config = ExpertServerConfig(body_grace=120.0, body_timeout=120.0)
        server = ExpertServer(server_peer, {"ffn.0": nn.Linear(HID, HID)}, declare=False, config=config,
                              args_schema=[TensorSchema((HID,), torch.float32)])
        port = Multiaddr.parse(server_peer.addrs[0]).port
        attacker_addr = f"/ip4/{ATTACKER_HOST}/tcp/{port}/p2p/{server_peer.peer_id}"
        honest_addr = f"/ip4/{HONEST_HOST}/tcp/{port}/p2p/{server_peer.peer_id}"
        header = next(tensors_to_messages([torch.randn(2, HID)], {"uid": "ffn.0", "graph": None}))
        attackers = [Peer(client_mode=True) for _ in range(IDENTITIES)]
        honest_peer = Peer(client_mode=True)
        peers += [*attackers, honest_peer]
        settled = _Settled(IDENTITIES * STREAMS - HELD)

        def attack(attacker: Peer):
            async def go():
                held = asyncio.Event()
                channel = attacker.pool.get(attacker_addr)

                async def one():
                    try:
                        async for _ in channel.stream(FORWARD, _held(held, [header]), timeout=300):
                            pass
                    except RPCError as e:
                        settled.answered()
                        return e
                    return None

                tasks = [asyncio.ensure_future(one()) for _ in range(STREAMS)]
                try:  # answered once the server took up every stream opened before it on this connection
                    await call_forward(channel, "ffn.9", [torch.randn(2, HID)], timeout=60)
                except (NotFound, ResourceExhausted):
                    pass
                return tasks, held

            return attacker.run(go(), timeout=120)

        launched = [attack(a) for a in attackers]
        admission = server.admission
        from_attacker = dict(getattr(admission, "by_source", {}))
        in_flight = admission.requests
        try:
            output = RemoteExpert(honest_peer, "ffn.0", honest_addr, forward_timeout=30)(torch.randn(3, HID))
            honest = "ok" if tuple(output.shape) == (3, HID) else f"shape {tuple(output.shape)}"
        except RPCError as e:
            honest = f"{type(e).__name__}: {e}"
        all_answered = settled.event.wait(timeout=60)  # every stream past the held ones refused
        refusals: list[str] = []
        others: list[str] = []
        for attacker, (tasks, held) in zip(attackers, launched):
            attacker.loop.loop.call_soon_threadsafe(held.set)

            async def outcomes(tasks=tasks):
                return await asyncio.gather(*tasks)

            for outcome in attacker.run(outcomes(), timeout=120):
                if isinstance(outcome, ResourceExhausted):
                    refusals.append(str(outcome))
                elif outcome is not None:
                    others.append(f"{type(outcome).__name__}: {outcome}")
        print(json.dumps({
            "honest": honest,
            "in_flight": in_flight,
            "all_answered_before_release": all_answered,
            "by_source": from_attacker,
            "refused_per_source": sum("per source address" in r for r in refusals),
            "refused_per_caller": sum("per caller" in r for r in refusals),
            "refused_server_full": sum("requests in flight, its limit" in r for r in refusals),
            "other_errors": others[:5],
        }), flush=True)
    finally:
        for peer in reversed(peers):
            peer.shutdown()


if __name__ == "__main__":
    main()
