"""`swarm-peer status`: the swarm as seen from a few peers, and the probes containers need.

    swarm-peer status --initial-peers MADDR... [--prefix P]... [--key K]... [--json] [--timeout S]
        Joins in client mode and prints the peers that answer `Info` (PeerID, role, version,
        round-trip time, clock offset, addresses), the experts they serve grouped by prefix, and,
        once the peer has a DHT, the peers of its routing table and the DHT records named by
        --prefix (expert grid prefixes such as ``ffn.``) and --key (e.g. a training run's key).
        Exit status: 0 if at least one peer answered, 1 if none did, 2 on bad arguments.

    swarm-peer status --self [--port N] [--timeout S]
    swarm-peer status --resolve MADDR [--wait S]
        Probes for containers (HEALTHCHECK, docker/swarm-join.sh): see `swarm.cli.health`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from swarm.core.errors import ConfigError, SwarmError
from swarm.core.multiaddr import Multiaddr
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.handle import KeyValueStore, PeerHandle

if TYPE_CHECKING:
    from swarm.net.channels import ChannelPool

logger = logging.getLogger("swarm.cli.status")

DEFAULT_TIMEOUT = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer status",
        description="Show the swarm as a few of its peers see it; or probe this container's own peer.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--self", dest="probe_self", action="store_true",
                      help="health probe: exit 0 if the peer running here answers Info on its own port")
    mode.add_argument("--resolve", metavar="MADDR",
                      help="print MADDR with /p2p/<PeerID> of the peer answering there")
    parser.add_argument("--initial-peers", action="append", nargs="+", metavar="MADDR",
                        help="peers to ask (default: SWARM_INITIAL_PEERS)")
    parser.add_argument("--prefix", action="append", default=[],
                        help="expert grid prefix to list from the DHT, e.g. 'ffn.' (repeatable)")
    parser.add_argument("--key", action="append", default=[], help="DHT key to print (repeatable)")
    parser.add_argument("--port", type=int, help="with --self: the port to probe (default: the daemon's)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per call (default 5)")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="with --resolve: keep retrying this many seconds while the peer starts")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--insecure", action="store_true", default=_env_flag("SWARM_INSECURE"),
                        help="dial in plaintext, to peers started with --insecure (default: TLS; SWARM_INSECURE)")
    # flags only, never the daemon's SWARM_* variables: its key file is locked while it runs
    parser.add_argument("--identity", help="a key file to ask as: a private swarm's member of its own "
                                           "(not a running daemon's key), with --membership")
    parser.add_argument("--swarm-authority", help="a private swarm's authority public key (docs/security.md)")
    parser.add_argument("--membership", help="the certificate of --identity in that private swarm")
    parser.add_argument("--log-level", default=os.environ.get("SWARM_STATUS_LOG_LEVEL", "ERROR"),
                        help="log level (default ERROR)")
    return parser


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


# -- what the status shows --------------------------------------------------------------------


@dataclass
class PeerReport:
    """One peer that answered `Info`."""

    peer_id: str
    role: str
    version: str
    client_mode: bool
    addrs: list[str]
    experts: list[str]
    rtt_ms: float
    clock_offset_s: float
    dialed: str
    source: str = "initial"  # "initial" (named on the command line) or "dht" (from the routing table)
    encrypted: bool = True  # the connection was TLS and the peer proved its PeerID in it (False: --insecure)
    reachability: str = ""  # "public", "private" (reached through relays), "unknown"; "" from older peers


@dataclass
class Unreachable:
    addr: str
    error: str


Json = dict[str, "Json"] | list["Json"] | str | int | float | bool | None


@dataclass
class SwarmView:
    peers: list[PeerReport] = field(default_factory=list)
    unreachable: list[Unreachable] = field(default_factory=list)
    dht: bool = False
    dht_experts: dict[str, dict[str, str]] = field(default_factory=dict)  # prefix -> {uid: addr}
    records: dict[str, Json] = field(default_factory=dict)

    def experts_by_prefix(self) -> dict[str, dict[str, list[str]]]:
        """``{grid prefix: {expert uid: [peer ids serving it]}}`` from the peers' `Info`."""
        grids: dict[str, dict[str, list[str]]] = {}
        for peer in self.peers:
            for uid in peer.experts:
                grid = uid.split(".", 1)[0] + "."
                grids.setdefault(grid, {}).setdefault(uid, []).append(peer.peer_id)
        return {g: dict(sorted(uids.items())) for g, uids in sorted(grids.items())}


async def call_info(pool: ChannelPool, addr: Multiaddr, timeout: float, source: str = "initial") -> PeerReport | Unreachable:
    """Dials `addr` (learning the PeerID if the address lacks one) and asks for `Info`."""
    try:
        channel = await asyncio.wait_for(pool.dial_unknown(addr), timeout) if not addr.peer_id else pool.get(addr)
        started = time.perf_counter()
        info = await channel.info(timeout)
        rtt = time.perf_counter() - started
    except (SwarmError, TimeoutError) as e:
        return Unreachable(str(addr), f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return PeerReport(
        peer_id=info.peer_id, role=info.role, version=info.version, client_mode=info.client_mode,
        addrs=list(info.addrs), experts=list(info.experts), rtt_ms=round(rtt * 1000, 3),
        clock_offset_s=round(info.time - (time.time() - rtt / 2), 3) if info.time else 0.0,
        dialed=str(addr), source=source, encrypted=channel.encrypted, reachability=info.reachability,
    )


async def survey(peer: PeerHandle, addrs: Sequence[Multiaddr], timeout: float, max_dht_peers: int = 256) -> SwarmView:
    """Asks every initial peer, then every peer of the DHT's routing table, for `Info`."""
    view = SwarmView(dht=peer.dht is not None)
    results = await asyncio.gather(*(call_info(peer.pool, a, timeout) for a in addrs))
    seen: set[str] = set()
    for result in results:
        if isinstance(result, PeerReport):
            if result.peer_id not in seen:
                seen.add(result.peer_id)
                view.peers.append(result)
        else:
            view.unreachable.append(result)
    # EXTENSION POINT (swarm/dht): peers found through the DHT, asked for Info like the initial ones.
    known = peer.dht.known_peers() if peer.dht is not None else []
    more = [Multiaddr.parse(n.addr) for n in known if n.peer_id not in seen][:max_dht_peers]
    for result in await asyncio.gather(*(call_info(peer.pool, a, timeout, "dht") for a in more)):
        if isinstance(result, PeerReport):
            if result.peer_id not in seen:
                seen.add(result.peer_id)
                view.peers.append(result)
        else:
            view.unreachable.append(result)
    return view


def _plain(value: object) -> Json:
    """A DHT value as JSON can hold it (bytes as hex, unknown objects as repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, ValueWithExpiration):
        return {"value": _plain(value.value), "expiration_time": value.expiration_time}
    return repr(value)


async def list_experts(dht: KeyValueStore, prefix: str, limit: int = 4096) -> dict[str, str]:
    """Every live expert declared under a grid prefix (``ffn.`` or ``ffn.3.``), walking its prefix tree.

    Uses swarm.moe's declarations (`swarm.moe.dht_declare.get_successors`: one read per prefix,
    breadth first, at most `limit` experts).
    """
    from swarm.moe.dht_declare import get_successors
    from swarm.moe.uids import UID_DELIMITER

    experts: dict[str, str] = {}
    level = [prefix if prefix.endswith(UID_DELIMITER) else prefix + UID_DELIMITER]
    while level and len(experts) < limit:
        found = await get_successors(dht, level)
        deeper: list[str] = []
        for parent, successors in found.items():
            for coord, (uid, addr) in sorted(successors.items()):
                if uid == f"{parent}{coord}":
                    experts[uid] = addr
                else:
                    deeper.append(f"{parent}{coord}{UID_DELIMITER}")
        level = deeper[: max(0, limit - len(experts))]
    return dict(sorted(experts.items())[:limit])


def read_records(dht: KeyValueStore, keys: Sequence[str], timeout: float) -> dict[str, Json]:
    """EXTENSION POINT (swarm/optim): the latest value of each DHT key given with --key (e.g. a run key).

    Uses ``dht.get(key, latest=True)`` (`swarm.dht.handle.KeyValueStore`), returning a
    `ValueWithExpiration` (a dict of subkeys for dictionary values) or None. Once swarm/moe and
    swarm/optim fix their key schemas (e.g. a run's progress key), decode them here.
    """
    records: dict[str, Json] = {}
    for key in keys:
        try:
            records[key] = _plain(dht.get(key, latest=True))
        except (SwarmError, TimeoutError) as e:
            records[key] = {"error": f"{type(e).__name__}: {e}"}
    return records


def format_text(view: SwarmView, prefixes: Sequence[str], keys: Sequence[str]) -> str:
    lines = [f"peers: {len(view.peers)} answered, {len(view.unreachable)} unreachable"
             + ("" if view.dht else " (no DHT in this version: only the peers named were asked)")]
    for p in view.peers:
        flags = (" client-mode" if p.client_mode else "") + (f" {p.reachability}" if p.reachability else "")
        via = " (via DHT)" if p.source == "dht" else ""
        transport = "tls1.3" if p.encrypted else "PLAINTEXT (--insecure)"
        lines.append(f"  {p.peer_id}  {p.role or '?'}{flags}  v{p.version or '?'}  rtt {p.rtt_ms:.1f} ms  "
                     f"clock {p.clock_offset_s:+.3f} s  {transport}{via}")
        lines.extend(f"      {a}" for a in (p.addrs or [p.dialed]))
    for u in view.unreachable:
        lines.append(f"  unreachable: {u.addr}  ({u.error})")
    grids = view.experts_by_prefix()
    if grids or not prefixes:
        lines.append(f"experts served by these peers: {sum(len(u) for u in grids.values())} in {len(grids)} grid(s)")
    for grid, uids in grids.items():
        lines.append(f"  {grid}  {len(uids)} expert(s): {', '.join(uids)}")
    for prefix, experts in view.dht_experts.items():
        lines.append(f"experts under {prefix!r} in the DHT: {len(experts)}")
        lines.extend(f"  {uid}  {addr}" for uid, addr in experts.items())
    if view.dht:
        for key in keys:
            lines.append(f"dht {key!r}: {json.dumps(view.records.get(key), sort_keys=True)}")
    elif prefixes or keys:
        lines.append("dht: not available (this peer has no DHT): --prefix and --key need it")
    # EXTENSION POINT (swarm/optim): training runs and their epochs, once runs publish them in the DHT.
    lines.append("training runs: " + ("see --key <run key>" if view.dht else "not available (needs the DHT)"))
    return "\n".join(lines)


def _initial_peers(args: argparse.Namespace) -> list[Multiaddr]:
    if args.initial_peers:
        raw = [a for group in args.initial_peers for item in group for a in item.replace(",", " ").split()]
    else:
        raw = os.environ.get("SWARM_INITIAL_PEERS", "").replace(",", " ").split()
    if not raw:
        raise ConfigError("name at least one peer: --initial-peers MADDR... (or set SWARM_INITIAL_PEERS)")
    return [Multiaddr.parse(a) for a in raw]


def run_status(args: argparse.Namespace) -> int:
    from swarm.peer import Peer

    addrs = _initial_peers(args)
    dialable = [str(a) for a in addrs if a.peer_id]
    private = {"identity_path": args.identity, "swarm_authority": args.swarm_authority, "membership": args.membership}
    try:
        peer = Peer(initial_peers=dialable, client_mode=True, insecure=args.insecure, **private)
    except ConfigError:
        raise
    except SwarmError as e:  # e.g. the DHT could not bootstrap: still ask the peers themselves
        logger.warning("could not join through the initial peers (%s); asking them directly", e)
        peer = Peer(client_mode=True, insecure=args.insecure, **private)
    try:
        view = peer.run(survey(peer, addrs, args.timeout), timeout=args.timeout * 4 + 10)
        dht = peer.dht
        if view.dht and dht is not None:
            for prefix in args.prefix:
                view.dht_experts[prefix] = peer.run(list_experts(dht, prefix), timeout=args.timeout * 4 + 10)
            view.records = read_records(dht, args.key, args.timeout)
    finally:
        peer.shutdown()
    if args.json:
        out = asdict(view)
        out["experts"] = view.experts_by_prefix()
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(format_text(view, args.prefix, args.key))
    return 0 if view.peers else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.probe_self:
            from swarm.cli.health import run_self

            return run_self(args.port, args.timeout)
        if args.resolve:
            from swarm.cli.health import run_resolve

            return run_resolve(args.resolve, args.wait, args.timeout, insecure=args.insecure)
        return run_status(args)
    except SwarmError as e:
        print(f"swarm-peer status: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
