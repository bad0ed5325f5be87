"""The lab's delay relay: latency, jitter and loss for packets between the lab's hosts.

This kernel has no `netem` (and no `fq` for departure-time pacing), so delay and loss are made
in userspace: every lab namespace sends the packets it receives from the bridge to an NFQUEUE,
one queue per sending host (`iptables ... -s HOST -j NFQUEUE --queue-num N`). This process holds
their ids, drops some (loss) and lets the rest go when their time comes, one batch verdict for
all the packets of a queue that are due. Packets never leave the kernel and are never copied;
per packet the relay does one `recv` of a ~100-byte message and a deque append. Where a channel
has no loss, a GSO packet (up to 64 KiB of TCP segments the sender's stack sends as one) is
queued whole, one id for all its segments; where it has loss the kernel cuts it into segments
first, so each segment is lost or kept on its own, as on a real link.

    python -m swarm.testing.relay

reads commands from stdin, one JSON object a line, and answers each with one line on stdout:

    {"op": "attach", "ns": NAME, "queues": {"3": {"delay": 0.0125, "jitter": 0.002, "loss": 0.005}}}
    {"op": "set", "ns": NAME, "queue": 3, "delay": ..., "jitter": ..., "loss": ...}
    {"op": "stats"}            -> {"ok": true, "stats": {NAME: {QUEUE: {"seen": .., "dropped": ..}}}}

and exits when stdin closes. See docs/network-lab.md for how faithful it is.

With `SWARM_LAB_REALTIME=1` in its environment (the lab's default) the relay asks for the
real-time scheduling class (`SCHED_FIFO`, priority 1) so that it runs the moment a packet is due,
however busy the hosts' processes keep the CPUs: a real network does not wait for the hosts'
CPU. Where that is not allowed (no `CAP_SYS_NICE`) it stays a normal process; `stats` says which.
The kernel's real-time throttling (`kernel.sched_rt_runtime_us`, 95% by default) still leaves
the other processes their share if the relay ever spun.
"""

from __future__ import annotations

import errno
import json
import os
import random
import selectors
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from swarm.testing.nfqueue import NF_ACCEPT, NF_DROP, QueueSocket, parse_packet


@dataclass
class Channel:
    """One direction of travel into a host (packets from one sender): its delay, jitter and loss,
    and the packets it holds, in arrival order.

    Jitter is uniform in [-jitter, +jitter] around `delay`, but packets keep their order (a
    packet never leaves before the one ahead of it), as on one real path.
    """

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    held: deque[tuple[float, int]] = field(default_factory=deque)
    last_release: float = 0.0
    seen: int = 0
    dropped: int = 0
    late_total: float = 0.0  # how late batches left, summed (the relay's own lag: faithfulness)
    late_max: float = 0.0
    batches: int = 0

    def __post_init__(self) -> None:
        self.configure(self.delay, self.jitter, self.loss)

    def configure(self, delay: float, jitter: float, loss: float) -> None:
        if delay < 0 or jitter < 0 or not 0 <= loss <= 1:
            raise ValueError("delay and jitter must be >= 0 and loss within [0, 1]")
        self.delay, self.jitter, self.loss = delay, jitter, loss

    def arrive(self, packet_id: int, now: float, rng: random.Random) -> bool:
        """Takes a packet: False if it is lost (drop it now), else it is held until its time."""
        self.seen += 1
        if self.loss and rng.random() < self.loss:
            self.dropped += 1
            return False
        release = now + self.delay + (rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
        release = max(release, self.last_release, now)
        self.last_release = release
        self.held.append((release, packet_id))
        return True

    def due(self, now: float) -> int | None:
        """Forgets the packets whose time has come and returns the last one's id (None if none)."""
        if not self.held or self.held[0][0] > now:
            return None
        late = now - self.held[0][0]
        self.late_total += late
        self.late_max = max(self.late_max, late)
        self.batches += 1
        last = None
        while self.held and self.held[0][0] <= now:
            last = self.held.popleft()[1]
        return last

    def next_release(self) -> float | None:
        return self.held[0][0] if self.held else None


class Relay:
    """Every lab namespace's queues in one process: a selector over their sockets and stdin."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.sockets: dict[str, QueueSocket] = {}
        self.channels: dict[str, dict[int, Channel]] = {}
        self.selector = selectors.DefaultSelector()
        self.overruns = 0
        self.realtime = False
        self.cpu_started = time.process_time()
        self.wall_started = time.monotonic()

    def attach(self, namespace: str, queues: dict[str, dict[str, float]]) -> None:
        qs = self.sockets.get(namespace)
        if qs is None:
            qs = QueueSocket.open(namespace)
            qs.sock.setblocking(False)
            self.sockets[namespace] = qs
            self.channels[namespace] = {}
            self.selector.register(qs.sock, selectors.EVENT_READ, namespace)
        for key, params in queues.items():
            queue = int(key)
            channel = Channel(float(params.get("delay", 0)), float(params.get("jitter", 0)),
                              float(params.get("loss", 0)))
            qs.sock.setblocking(True)
            try:
                qs.bind(queue)
            finally:
                qs.sock.setblocking(False)
            qs.set_gso(queue, whole=not channel.loss)
            self.channels[namespace][queue] = channel

    def command(self, line: str) -> dict[str, object]:
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "attach":
                self.attach(cmd["ns"], cmd["queues"])
            elif op == "set":
                queue = int(cmd["queue"])
                channel = self.channels[cmd["ns"]][queue]
                channel.configure(float(cmd["delay"]), float(cmd["jitter"]), float(cmd["loss"]))
                self.sockets[cmd["ns"]].set_gso(queue, whole=not channel.loss)
            elif op == "stats":
                return {"ok": True, "stats": self.stats()}
            else:
                raise ValueError(f"unknown op {op!r}")
        except (ValueError, KeyError, TypeError, OSError) as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True}

    def stats(self) -> dict[str, object]:
        wall = max(time.monotonic() - self.wall_started, 1e-9)
        return {
            "cpu_seconds": time.process_time() - self.cpu_started, "wall_seconds": wall,
            "overruns": self.overruns, "realtime": self.realtime,
            "late_ms_mean": 1000 * sum(c.late_total for chans in self.channels.values() for c in chans.values())
            / max(1, sum(c.batches for chans in self.channels.values() for c in chans.values())),
            "late_ms_max": 1000 * max((c.late_max for chans in self.channels.values() for c in chans.values()),
                                      default=0.0),
            "queues": {ns: {str(q): {"seen": c.seen, "dropped": c.dropped, "held": len(c.held)}
                            for q, c in chans.items()} for ns, chans in self.channels.items()},
        }

    def read_packets(self, namespace: str, now: float) -> None:
        qs = self.sockets[namespace]
        channels = self.channels[namespace]
        recv = qs.sock.recv
        for _ in range(512):  # bounded: let due packets go between bursts
            try:
                data = recv(512)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # the kernel dropped messages: those packets are lost
                    self.overruns += 1
                    continue
                raise
            parsed = parse_packet(data)
            if parsed is None:
                continue
            queue, packet_id = parsed
            channel = channels.get(queue)
            if channel is None or not channel.arrive(packet_id, now, self.rng):
                qs.verdict(queue, packet_id, NF_DROP)

    def release(self, now: float) -> float | None:
        """Lets every due packet go; returns when the next one is due."""
        soonest: float | None = None
        for namespace, channels in self.channels.items():
            qs = self.sockets[namespace]
            for queue, channel in channels.items():
                last = channel.due(now)
                if last is not None:
                    qs.verdict(queue, last, NF_ACCEPT, batch=True)
                nxt = channel.next_release()
                if nxt is not None and (soonest is None or nxt < soonest):
                    soonest = nxt
        return soonest

    def run(self, commands: socket.socket | int) -> None:
        os.set_blocking(commands if isinstance(commands, int) else commands.fileno(), False)
        self.selector.register(commands, selectors.EVENT_READ, None)
        pending = b""
        soonest: float | None = None
        while True:
            now = time.monotonic()
            timeout = None if soonest is None else max(0.0, soonest - now)
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    chunk = os.read(commands if isinstance(commands, int) else commands.fileno(), 65536)
                    if not chunk:
                        return
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        sys.stdout.write(json.dumps(self.command(line.decode())) + "\n")
                        sys.stdout.flush()
                else:
                    self.read_packets(key.data, time.monotonic())
            soonest = self.release(time.monotonic())

    def close(self) -> None:
        for qs in self.sockets.values():
            qs.close()


def _ask_realtime() -> bool:
    """Real-time scheduling for this process (see the module docstring); False if refused."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (AttributeError, PermissionError, OSError):
        return False
    return True


def main() -> int:
    relay = Relay(int(os.environ["SWARM_LAB_SEED"]) if os.environ.get("SWARM_LAB_SEED") else None)
    if os.environ.get("SWARM_LAB_REALTIME") == "1":
        relay.realtime = _ask_realtime()
    try:
        relay.run(sys.stdin.fileno())
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
