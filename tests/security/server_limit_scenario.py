"""Many identities from one network against a peer's DHT node and averaging service, run inside a
network namespace of its own (`test_server_source_limits.py` starts it with `unshare --net`, so
the addresses below exist only there and vanish with the process). Prints one JSON line.

Five attacker identities dial the victim at 10.77.0.1 (so they come from 10.77.0.0/24); an honest
peer dials it at 10.88.0.1, another /24. The attackers

1. store 10 records each (raw Store requests): past the victim's quota per source network;
2. send 200 Finds at once: past its Find rate per source network;
3. open 32 Reduce streams each that send nothing (each identity within its share per caller):
   160 stalled streams, past the averaging service's 128 per source network.

While the streams are held, the honest peer stores, finds and joins, and must be served.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from netns import add_addresses

ATTACKER_HOST = "10.77.0.1"
HONEST_HOST = "10.88.0.1"
IDENTITIES = 5
STORES = 10
FINDS = 200
STREAMS = 32
SOURCE_RECORDS = 20  # the victim's max_source_records
FIND_RATE = 5.0  # the victim's source_find_rate (bursts of 10)


async def _held(stall: asyncio.Event) -> Any:
    await stall.wait()  # sends nothing, then ends the request stream
    return
    yield b""  # an async generator that yields nothing


def main() -> None:
    add_addresses(ATTACKER_HOST, HONEST_HOST)

    from swarm.averaging.service import AVERAGING_LIMIT, JOIN, REDUCE, AveragingService
    from swarm.core.errors import ResourceExhausted, RPCError
    from swarm.core.multiaddr import Multiaddr
    from swarm.core.timeutil import get_dht_time
    from swarm.dht import DHTConfig
    from swarm.dht.keys import hash_serialized_key, serialize_key
    from swarm.dht.wire import FIND, STORE
    from swarm.peer import Peer
    from swarm.proto import averaging_pb2, dht_pb2

    peers: list[Peer] = []
    try:
        victim = Peer(listen="/ip4/0.0.0.0/tcp/0",
                      dht_config=DHTConfig(max_source_records=SOURCE_RECORDS, source_find_rate=FIND_RATE))
        peers.append(victim)
        victim.run(_create_service(victim, AveragingService), timeout=30)
        port = Multiaddr.parse(victim.addrs[0]).port
        attacker_addr = f"/ip4/{ATTACKER_HOST}/tcp/{port}/p2p/{victim.peer_id}"
        honest_addr = f"/ip4/{HONEST_HOST}/tcp/{port}/p2p/{victim.peer_id}"
        attackers = [Peer(client_mode=True) for _ in range(IDENTITIES)]
        honest = Peer(client_mode=True)
        peers += [*attackers, honest]
        expiration = get_dht_time() + 600

        def store_request(name: str) -> bytes:
            raw_key = serialize_key(name)
            item = dht_pb2.DHTStoreItem(raw_key=raw_key, value=os.urandom(1024), expiration_time=expiration)
            return dht_pb2.DHTStoreRequest(items=[item]).SerializeToString()

        def find_request(name: str) -> bytes:
            return dht_pb2.DHTFindRequest(keys=[hash_serialized_key(serialize_key(name))]).SerializeToString()

        async def stores(peer: Peer, addr: str, tag: str) -> list[str]:
            channel = peer.pool.get(addr)
            outcomes = []
            for i in range(STORES):
                answer = await channel.unary(STORE, store_request(f"{tag}-{i}"), dht_pb2.DHTStoreResponse, timeout=30)
                outcomes.append(answer.results[0].reason or "stored")
            return outcomes

        stored = [r for i, a in enumerate(attackers) for r in a.run(stores(a, attacker_addr, f"sybil{i}"), timeout=60)]
        honest_stores = honest.run(stores(honest, honest_addr, "honest"), timeout=60)

        async def finds(peer: Peer, addr: str, count: int) -> list[str]:
            channel = peer.pool.get(addr)

            async def one(i: int) -> str:
                try:
                    await channel.unary(FIND, find_request(f"k{i}"), dht_pb2.DHTFindResponse, timeout=30)
                except ResourceExhausted as e:
                    return str(e)
                return "found"

            return list(await asyncio.gather(*(one(i) for i in range(count))))

        flood = attackers[0].run(finds(attackers[0], attacker_addr, FINDS), timeout=60)
        honest_finds = honest.run(finds(honest, honest_addr, 3), timeout=60)

        def open_streams(attacker: Peer) -> tuple[list[asyncio.Future[Any]], asyncio.Event]:
            async def go() -> tuple[list[asyncio.Future[Any]], asyncio.Event]:
                stall = asyncio.Event()
                channel = attacker.pool.get(attacker_addr)

                async def one() -> Exception | None:
                    try:
                        async for _ in channel.stream(REDUCE, _held(stall), timeout=300):
                            pass
                    except RPCError as e:
                        return e
                    return None

                return [asyncio.ensure_future(one()) for _ in range(STREAMS)], stall

            return attacker.run(go(), timeout=60)

        launched = [open_streams(a) for a in attackers]
        limiter = victim.server.limiter  # type: ignore[union-attr]
        group, source = AVERAGING_LIMIT.group, "10.77.0.0/24"

        async def all_answered() -> int:  # every stream the attackers opened was admitted or refused
            async with asyncio.timeout(60):
                while limiter.in_flight(group, source=source) + limiter.refused.get(f"{group} source", 0) < \
                        IDENTITIES * STREAMS:
                    await asyncio.sleep(0.01)
            return limiter.in_flight(group, source=source)

        held = victim.run(all_answered(), timeout=90)

        async def join() -> str:
            channel = honest.pool.get(honest_addr)
            request = averaging_pb2.JoinRequest(prefix="nobody-averages-this")
            answer = await channel.unary(JOIN, request, averaging_pb2.JoinResponse, timeout=30)
            return answer.reason

        try:
            honest_join = honest.run(join(), timeout=60)
        except RPCError as e:
            honest_join = f"{type(e).__name__}: {e}"
        refused_streams: list[str] = []
        for attacker, (tasks, stall) in zip(attackers, launched):
            attacker.loop.loop.call_soon_threadsafe(stall.set)

            async def ended(tasks: list[asyncio.Future[Any]] = tasks) -> list[Any]:
                return list(await asyncio.gather(*tasks))

            refused_streams += [str(e) for e in attacker.run(ended(), timeout=60) if isinstance(e, ResourceExhausted)]
        print(json.dumps({
            "sybil_stored": stored.count("stored"),
            "sybil_refused_per_source": sum("limit per source network" in r for r in stored),
            "honest_stores": honest_stores,
            "flood_found": flood.count("found"),
            "flood_refused_rate": sum("per second" in r for r in flood),
            "honest_finds": honest_finds,
            "streams_held": held,
            "streams_refused_per_source": sum("per source address" in r for r in refused_streams),
            "honest_join": honest_join,
        }), flush=True)
    finally:
        for peer in reversed(peers):
            peer.shutdown()


async def _create_service(peer: Any, service: Any) -> None:
    service.of(peer)


if __name__ == "__main__":
    main()
