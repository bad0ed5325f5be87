"""A peer process that finds its groups through the real DHT, for the matchmaking tests.

    python tests/averaging/dht_worker.py '{"index": 0, "numel": 1000, "target": 4, "initial_peers": [...]}'

stdout, one JSON object per line:
    {"event": "ready", "addr": "/ip4/...", "peer_id": "..."}
    {"event": "announced", "ok": true}
    {"event": "result", "ok": true, "group": [...], "round_id": "...", "seconds": s, "value": v}
    {"event": "result", "ok": false, "error": "AveragingError", "message": "...", "seconds": s}
stdin, one JSON object per line:
    {"cmd": "announce", "ready_in": s, "key": k}
    {"cmd": "step", "key": k, "timeout": t, "busy": s}   (busy: seconds of work before the step)
    {"cmd": "exit"}

Every peer averages a tensor filled with its index, so a result's value says who was in the mean.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from swarm.averaging import Averager, AveragerConfig, MatchmakingConfig
from swarm.core.errors import AveragingError
from swarm.peer import Peer


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    peer = Peer(initial_peers=cfg.get("initial_peers", []))
    tensor = torch.full((cfg.get("numel", 1000),), float(cfg["index"]))
    config = AveragerConfig(matchmaking=MatchmakingConfig(adaptive=cfg.get("adaptive", True)))
    avg = Averager(peer, [tensor], prefix="mm", target_group_size=cfg["target"], min_group_size=2, config=config)
    emit(event="ready", addr=peer.addrs[0], peer_id=peer.peer_id)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "exit":
                break
            if msg["cmd"] == "announce":
                emit(event="announced", ok=avg.announce(msg["ready_in"], group_key=msg["key"]))
                continue
            tensor.fill_(float(cfg["index"]))
            time.sleep(msg.get("busy", 0.0))  # the peer computes what it averages
            started = time.monotonic()
            try:
                result = avg.step(timeout=msg["timeout"], group_key=msg["key"])
            except AveragingError as e:
                emit(event="result", ok=False, error=type(e).__name__, message=str(e),
                     seconds=time.monotonic() - started)
                continue
            emit(event="result", ok=True, group=list(result.group), round_id=result.round_id,
                 seconds=time.monotonic() - started, value=float(tensor[0]))
    finally:
        avg.shutdown()
        peer.shutdown()


if __name__ == "__main__":
    main()
