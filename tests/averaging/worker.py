"""A peer process for the averaging tests: runs rounds on command, prints JSON lines.

    python tests/averaging/worker.py '{"index": 0, "seed": 1, "numel": 1000, ...}'

stdout, one JSON object per line:
    {"event": "ready", "addr": "/ip4/...", "peer_id": "..."}
    {"event": "result", "round": r, "ok": true, "contributors": [...], "weights": {...},
     "max_err": e, "digest": "...", "seconds": s}
    {"event": "result", "round": r, "ok": false, "error": "AveragingError", "message": "...",
     "untouched": true, "seconds": s}
stdin, one JSON object per line:
    {"cmd": "group", "addrs": [...], "peer_ids_inputs": {peer_id: index, ...}}
    {"cmd": "round", "round": r}
    {"cmd": "exit"}

Every peer's input for round r is a pure function of (seed, its index, r), so a worker can
recompute the exact weighted mean of whatever contributors a round reports and check its own
result against it (`max_err`); `digest` lets the test check that survivors hold identical bytes.
Faults come through the averager's `FaultPlan` (config "faults"), never by patching code.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback

import torch

from swarm.averaging import (
    Action,
    AllReduceConfig,
    Averager,
    AveragerConfig,
    FaultPlan,
    FaultPoint,
    MatchmakingConfig,
)
from swarm.core.errors import AveragingError
from swarm.peer import Peer

SHAPES = ((3, 7), (11,))


def inputs(seed: int, index: int, round_: int, numel: int) -> list[torch.Tensor]:
    """The tensors peer `index` averages in round `round_` (deterministic)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 1009 + round_)
    head = numel - 21 - 11
    flat = torch.randn(head + 21 + 11, generator=g) * (index + 1)
    return [flat[:head].clone(), flat[head:head + 21].clone().view(3, 7), flat[head + 21:].clone()]


def weight_of(index: int, round_: int) -> float:
    return float(1 + (index + round_) % 3)


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("debug_log"):  # the averaging's debug log on stderr, for a test to show when it fails
        import logging

        logging.basicConfig(stream=sys.stderr, format="%(relativeCreated)d %(name)s: %(message)s")
        logging.getLogger("swarm.averaging").setLevel(logging.DEBUG)
    index, seed, numel = cfg["index"], cfg["seed"], cfg["numel"]
    peer = Peer(client_mode=cfg.get("client_mode", False))
    plan = FaultPlan()

    def arm(faults: list[dict]) -> None:
        for f in faults:
            plan.add(FaultPoint(f["point"]), Action(f["action"]), after=f.get("after", 0),
                     rounds=set(f["rounds"]) if "rounds" in f else None, seconds=f.get("seconds", 0.0))

    arm(cfg.get("faults", []))
    config = AveragerConfig(
        allreduce=AllReduceConfig(sender_timeout=cfg.get("sender_timeout", 1.0), chunk_bytes=cfg.get("chunk_bytes", 1 << 20)),
        # a loaded test machine may start a peer's step late: wait for it rather than go without it
        matchmaking=MatchmakingConfig(join_window=cfg.get("join_window", 1.0),
                                      min_round_timeout=cfg.get("min_round_timeout", MatchmakingConfig.min_round_timeout)),
        compression=cfg.get("compression", 0),
    )
    if "serve_state" in cfg:
        serve_state(peer, cfg["serve_state"], plan)
    # ready once it serves what it was asked to: a test that downloads at "ready" found no State
    # method on a loaded machine when this came before the state server (a victim never asked, so never killed)
    emit(event="ready", addr=peer.addrs[0] if peer.addrs else "", peer_id=peer.peer_id)
    index_of: dict[str, int] = {}
    avg = None
    tensors: list[torch.Tensor] = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "arm":
            arm(cmd["faults"])
            continue
        if cmd["cmd"] == "group":
            index_of = cmd["indices"]
            tensors = inputs(seed, index, 0, numel)
            avg = Averager(peer, tensors, prefix="test", target_group_size=cmd["size"], min_group_size=cmd.get("min_size", 2),
                           initial_group=cmd["addrs"], auxiliary=cfg.get("auxiliary", False), config=config, faults=plan)
            continue
        assert avg is not None
        r = cmd["round"]
        fresh = inputs(seed, index, r, numel)
        with torch.no_grad():
            for t, v in zip(tensors, fresh):
                t.copy_(v)
        timeout = cmd.get("timeout", 5.0)
        start = time.monotonic()
        try:
            result = avg.step(timeout=timeout, weight=0.0 if cfg.get("auxiliary") else weight_of(index, r))
        except AveragingError as e:
            seconds = time.monotonic() - start
            untouched = all(torch.equal(t, v) for t, v in zip(tensors, fresh))
            emit(event="result", round=r, ok=False, error=type(e).__name__, message=str(e), untouched=untouched,
                 seconds=seconds, round_id=getattr(e, "round_id", b"").hex())
            continue
        except Exception as e:  # noqa: BLE001
            emit(event="result", round=r, ok=False, error=type(e).__name__, message=traceback.format_exc(),
                 untouched=False, seconds=time.monotonic() - start)
            continue
        seconds = time.monotonic() - start
        if cfg.get("auxiliary"):
            emit(event="result", round=r, ok=True, contributors=list(result.contributors), weights=result.weights,
                 round_id=result.round_id, seconds=seconds, max_err=0.0, digest="aux")
            continue
        expected = None
        total = sum(result.weights.values())
        for pid in result.contributors:
            contribution = [t * (result.weights[pid] / total) for t in inputs(seed, index_of[pid], r, numel)]
            expected = contribution if expected is None else [a + b for a, b in zip(expected, contribution)]
        assert expected is not None
        max_err = max(float((t - e).abs().max()) for t, e in zip(tensors, expected))
        digest = hashlib.sha256(b"".join(_raw(t) for t in tensors)).hexdigest()
        emit(event="result", round=r, ok=True, contributors=list(result.contributors), weights=result.weights,
             excluded=result.excluded, round_id=result.round_id, max_err=max_err, digest=digest, seconds=seconds)
    peer.shutdown()


def state_tensors(seed: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g), torch.randn(5, 3, generator=g).half(), torch.arange(7)]


def serve_state(peer: Peer, spec: dict, plan: FaultPlan) -> None:
    from swarm.averaging import State, StateServer

    tensors = state_tensors(spec["seed"], spec["numel"])
    version = bytes.fromhex(spec["version"]) if spec.get("version") else None
    StateServer(peer, "test", lambda: State({"step": spec["seed"], "name": "test"}, tensors, version),
                chunk_bytes=spec.get("chunk_bytes", 1 << 16), faults=plan)


def _raw(t: torch.Tensor) -> bytes:
    import ctypes

    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


if __name__ == "__main__":
    main()
