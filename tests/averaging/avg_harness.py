"""Runs averaging peers as real processes (tests/averaging/worker.py) and collects their JSON lines."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from swarm.core.timeutil import get_dht_time
from swarm.dht import ValueWithExpiration

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
DHT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dht_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Worker:
    """One peer process; `events` receives its stdout JSON lines."""

    def __init__(self, config: dict[str, Any], script: str = WORKER) -> None:
        self.config = config
        self.index = config["index"]
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, script, json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True, env=env,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.addr = ""
        self.peer_id = ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next line, or None if the process ended; raises TimeoutError when it says nothing."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.index} said nothing for {timeout} s:\n{self.log()}") from None

    def log(self, limit: int = 4000) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-limit:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"cmd": "exit"})
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGCONT)
                self.proc.kill()
                self.proc.wait(5)
        self.stderr.close()


class ProcessGroup:
    """N worker processes averaging as one static group."""

    def __init__(self, configs: list[dict[str, Any]], min_size: int = 2) -> None:
        self.workers = [Worker(c) for c in configs]
        try:
            for w in self.workers:
                ready = w.next_event(60)
                assert ready is not None and ready["event"] == "ready", w.log()
                w.addr, w.peer_id = ready["addr"], ready["peer_id"]
            addrs = [w.addr for w in self.workers if w.addr]
            indices = {w.peer_id: w.index for w in self.workers}
            for w in self.workers:
                w.send({"cmd": "group", "addrs": addrs, "indices": indices, "size": len(self.workers),
                        "min_size": min_size})
        except BaseException:
            self.close()
            raise

    def round(self, r: int, timeout: float, skip: set[int] = frozenset()) -> dict[int, dict[str, Any] | None]:
        """Starts round r on every live worker; returns index -> result (None: the process died).
        Workers in `skip` are started but their answer is not awaited (a stopped peer)."""
        live = [w for w in self.workers if w.proc.poll() is None]
        for w in live:
            w.send({"cmd": "round", "round": r, "timeout": timeout})
        results: dict[int, dict[str, Any] | None] = {}
        limit = time.monotonic() + timeout + 30
        for w in live:
            if w.index in skip:
                continue
            try:
                results[w.index] = w.next_event(max(0.1, limit - time.monotonic()))
            except TimeoutError:
                results[w.index] = {"event": "silent"}
        return results

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def __enter__(self) -> ProcessGroup:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_agreement(results: dict[int, dict[str, Any] | None], timeout: float, tol: float = 1e-5) -> str:
    """SPEC §4 for one round: survivors all hold the same exact mean of the same contributors, or
    all raised, with their tensors untouched; each within timeout + 1 s. Returns "ok" or "failed"."""
    survivors = {i: r for i, r in results.items() if r is not None and r.get("event") == "result"}
    assert survivors, f"no survivor reported: {results}"
    for i, r in survivors.items():
        assert r["seconds"] <= timeout + 1.0, f"peer {i} took {r['seconds']:.2f} s (timeout {timeout})"
    oks = [r for r in survivors.values() if r["ok"]]
    if oks:
        assert len(oks) == len(survivors), f"some survivors applied the round and some failed: {survivors}"
        assert len({r["digest"] for r in oks if r["digest"] != "aux"}) <= 1, f"survivors differ: {survivors}"
        assert len({tuple(r["contributors"]) for r in oks}) == 1, survivors
        assert len({r["round_id"] for r in oks}) == 1, survivors
        for i, r in survivors.items():
            assert r["max_err"] <= tol, f"peer {i} is {r['max_err']} away from the contributors' mean"
        return "ok"
    for i, r in survivors.items():
        assert r["error"] in ("RoundFailed", "AveragingError"), r
        assert r["untouched"], f"peer {i} raised but its tensors changed"
    assert len({r["round_id"] for r in survivors.values()}) == 1, f"survivors failed in different rounds: {survivors}"
    return "failed"


def run_steps(avgs: list[Any], weights: list[float] | None = None, timeout: float = 10.0, **step: Any) -> list[Any]:
    """Runs one `step` on every in-process averager at once (a thread each); returns each result or
    the exception it raised."""
    out: list[Any] = [None] * len(avgs)

    def run(i: int) -> None:
        try:
            out[i] = avgs[i].step(timeout=timeout, weight=1.0 if weights is None else weights[i], **step)
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(avgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


class FakeDHT:
    """In-memory `astore`/`aget` with subkeys and expirations, shared by several peers."""

    def __init__(self) -> None:
        self.data: dict[str, dict[Any, ValueWithExpiration]] = {}
        self.lock = threading.Lock()

    async def astore(self, key: str, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        with self.lock:
            entries = self.data.setdefault(key, {})
            old = entries.get(subkey)
            if old is not None and old.expiration_time > expiration_time and value is not None:
                return False
            entries[subkey] = ValueWithExpiration(value, expiration_time)
            return True

    def read_patience(self) -> float:
        return 0.0

    async def aget(self, key: str, latest: bool = False) -> ValueWithExpiration | None:
        now = get_dht_time()
        with self.lock:
            entries = {k: v for k, v in self.data.get(key, {}).items() if v.expiration_time > now}
        if not entries:
            return None
        return ValueWithExpiration(entries, max(v.expiration_time for v in entries.values()))
