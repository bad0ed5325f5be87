"""A network of hosts on one machine: Linux network namespaces on a bridge, with per-link bandwidth,
latency, jitter and loss, hosts behind NAT, and partitions that come and heal.

    with Lab([HostSpec("a", LinkProfile(delay_ms=12.5)), HostSpec("b", nat=True)]) as lab:
        proc = lab.spawn("a", ["python", "-m", "swarm", "--listen", f"/ip4/{lab.address('a')}/tcp/0"])
        lab.partition({"a"}, {"b"}); ...; lab.heal()

Layout (docs/network-lab.md draws it): the bridge lives in its own namespace `<prefix>-br`; each
host is a namespace with `eth0` (10.10.0.N/16), a veth whose other end is a port of the bridge.
A host behind NAT is two namespaces: a home router on the bridge (MASQUERADE, outbound only) and
the host on the router's LAN (192.168.N.2). Nothing is added to the machine's own namespace but
the namespaces' names. Bandwidth is a `tbf` qdisc on each end of a host's veth (up: the host's
end, down: the bridge's end); delay, jitter and loss are made by the relay process
(`swarm.testing.relay`), which holds packets in NFQUEUEs; partitions are iptables DROP rules.
Everything is removed on exit, on exceptions, on SIGINT and SIGTERM; a lab killed outright is
cleaned by the next one (`clean_stale`).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import IO, Self

from swarm.testing.netns import (
    LabError,
    add_namespace,
    clean_stale,
    delete_namespace,
    ip_batch,
    iptables,
    iptables_restore,
    lab_namespaces,
    missing_requirements,
    new_prefix,
    run,
    sysctl,
    tc,
)

WAN_NET = "10.10.0.0/16"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_CHAIN = "LABPART"
# a home router: out through eth0 under its address; in only what answers a connection from inside
_HOME_ROUTER_RULES = """*nat
-A POSTROUTING -o eth0 -j MASQUERADE
COMMIT
*filter
:FORWARD DROP [0:0]
-A INPUT -i eth0 -p tcp --syn -m conntrack --ctstate NEW -j DROP
-A FORWARD -i lan0 -o eth0 -j ACCEPT
-A FORWARD -i eth0 -o lan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
COMMIT
"""


@dataclass(frozen=True)
class LinkProfile:
    """One host's access link to the bridge. Both directions get `delay_ms`, `jitter_ms` and
    `loss`, so two hosts with `delay_ms = d` see a round trip of 4 d (50 ms RTT: 12.5).

    Attributes:
        up_mbit: bandwidth host -> bridge (None: unlimited).
        down_mbit: bandwidth bridge -> host (None: unlimited).
        delay_ms: one-way latency of each direction of this link.
        jitter_ms: the delay varies uniformly by +-jitter_ms (packets keep their order).
        loss: fraction of packets lost in each direction of this link.
        queue_ms: how long a packet may wait in a bandwidth limiter before it is dropped.
    """

    up_mbit: float | None = None
    down_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    queue_ms: float = 100.0

    def __post_init__(self) -> None:
        for rate in (self.up_mbit, self.down_mbit):
            if rate is not None and not rate > 0:
                raise ValueError("bandwidth must be positive (or None for unlimited)")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.queue_ms <= 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0, queue_ms > 0")
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be within [0, 1)")

    @property
    def shaped(self) -> bool:
        """Whether packets into this host go through the relay."""
        return bool(self.delay_ms or self.jitter_ms or self.loss)


@dataclass(frozen=True)
class HostSpec:
    """A host of the lab.

    Attributes:
        name: lowercase letters and digits, at most 16 (it names the namespace).
        link: its access link.
        nat: behind a home router that masquerades: it can dial out, nobody can dial in.
        nat_type: "masquerade" (keeps the source port where it can, so one mapping serves every
            destination: a cone-like NAT) or "random" (`--random-fully`: a random port per
            connection, a symmetric-like NAT).
    """

    name: str
    link: LinkProfile = field(default_factory=LinkProfile)
    nat: bool = False
    nat_type: str = "masquerade"

    def __post_init__(self) -> None:
        if self.nat_type not in ("masquerade", "random"):
            raise ValueError(f"nat_type must be 'masquerade' or 'random', got {self.nat_type!r}")
        if not _NAME.match(self.name):
            raise ValueError(f"host name {self.name!r}: use 1-16 lowercase letters and digits, starting with a letter")


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Node:
    """A namespace on the bridge: a host, or the home router in front of a NAT host."""

    def __init__(self, index: int, namespace: str, spec: HostSpec) -> None:
        self.index = index
        self.namespace = namespace
        self.spec = spec
        self.address = f"10.10.0.{index + 1}" if index < 254 else f"10.10.{index // 254}.{index % 254 + 1}"
        self.port = f"p{index}"


class Lab:
    """Builds the hosts on enter, removes them on exit (see the module docstring).

    Args:
        hosts: the hosts; their names must be distinct.
        seed: seeds the relay's loss and jitter (None: random).
        clean_stale: first remove what labs killed outright left behind.
        realtime_relay: run the delay relay in the real-time scheduling class, so the links'
            delays hold however busy the hosts keep the CPUs (see `swarm.testing.relay`).
    """

    def __init__(self, hosts: Sequence[HostSpec], seed: int | None = None, clean_stale: bool = True,
                 realtime_relay: bool = True) -> None:
        names = [h.name for h in hosts]
        if not hosts or len(set(names)) != len(names):
            raise ValueError("a lab needs at least one host, with distinct names")
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts")
        self.specs = {h.name: h for h in hosts}
        self.seed = seed
        self.realtime_relay = realtime_relay
        self.prefix = new_prefix()
        self.bridge_ns = f"{self.prefix}-br"
        self.nodes: dict[str, _Node] = {}
        self.homes: dict[str, str] = {}  # NAT host name -> its own namespace (behind the router)
        self.profiles: dict[str, LinkProfile] = {h.name: h.link for h in hosts}
        self.relay: subprocess.Popen[str] | None = None
        self.processes: list[subprocess.Popen[bytes]] = []
        self.partitions: list[tuple[frozenset[str], frozenset[str]]] = []
        self._relay_lock = threading.Lock()
        self._clean_stale = clean_stale
        self._created: list[str] = []
        self._old_sigterm: object = None
        self._closed = False

    # -- building -----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        reason = missing_requirements()
        if reason:
            raise LabError(reason)
        if self._clean_stale:
            clean_stale()
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _on_sigterm(self, signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def _namespace(self, name: str) -> str:
        add_namespace(name)
        self._created.append(name)
        return name

    def _build(self) -> None:
        self._namespace(self.bridge_ns)
        ip_batch(self.bridge_ns, ["link set lo up", "link add br0 type bridge", "link set br0 up"])
        for index, spec in enumerate(self.specs.values()):
            suffix = f"{spec.name}-gw" if spec.nat else spec.name
            node = _Node(index, self._namespace(f"{self.prefix}-{suffix}"), spec)
            self.nodes[spec.name] = node
            ip_batch(self.bridge_ns, [
                f"link add {node.port} type veth peer name eth0 netns {node.namespace}",
                f"link set {node.port} master br0", f"link set {node.port} up"])
            ip_batch(node.namespace, ["link set lo up", f"addr add {node.address}/16 dev eth0",
                                            "link set eth0 up"])
            if spec.nat:
                self._build_home(node)
            self._shape_bandwidth(node, spec.link)
        for node in self.nodes.values():
            iptables_restore(node.namespace, self._node_rules(node))
        if any(p.shaped for p in self.profiles.values()):
            self._start_relay()

    def _build_home(self, router: _Node) -> None:
        home = self._namespace(f"{self.prefix}-{router.spec.name}")
        self.homes[router.spec.name] = home
        lan = f"192.168.{router.index % 250 + 1}"
        ip_batch(router.namespace, [f"link add lan0 type veth peer name eth0 netns {home}",
                                          f"addr add {lan}.1/24 dev lan0", "link set lan0 up"])
        ip_batch(home, ["link set lo up", f"addr add {lan}.2/24 dev eth0", "link set eth0 up",
                              f"route add default via {lan}.1"])
        sysctl(router.namespace, "net.ipv4.ip_forward", "1")
        rules = _HOME_ROUTER_RULES
        if router.spec.nat_type == "random":
            rules = rules.replace("-j MASQUERADE", "-j MASQUERADE --random-fully")
        iptables_restore(router.namespace, rules)

    def _shape_bandwidth(self, node: _Node, link: LinkProfile) -> None:
        for namespace, dev, rate in ((node.namespace, "eth0", link.up_mbit), (self.bridge_ns, node.port, link.down_mbit)):
            run(["tc", "-n", namespace, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:
                # burst: at least 4 ms of traffic, and room for a whole GSO packet (64 KiB and its
                # headers): tbf cuts a packet larger than its burst into segments, which costs the
                # relay one message per segment instead of one per GSO packet
                burst = max(2 * 65536, int(rate * 1e6 / 8 * 0.004))
                tc(namespace, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}mbit",
                         "burst", str(burst), "latency", f"{link.queue_ms}ms")

    def _node_rules(self, node: _Node) -> str:
        rules = ["*raw", f":{_CHAIN} - [0:0]", f"-A PREROUTING -i eth0 -j {_CHAIN}", "COMMIT"]
        if any(p.shaped for p in self.profiles.values()):
            rules.append("*mangle")
            rules += [f"-A PREROUTING -i eth0 -s {other.address} -j NFQUEUE --queue-num {other.index}"
                      for other in self.nodes.values() if other is not node]
            rules.append("COMMIT")
        return "\n".join(rules) + "\n"

    def _channel(self, sender: str, receiver: str) -> dict[str, float]:
        a, b = self.profiles[sender], self.profiles[receiver]
        return {"delay": (a.delay_ms + b.delay_ms) / 1000, "jitter": (a.jitter_ms + b.jitter_ms) / 1000,
                "loss": 1 - (1 - a.loss) * (1 - b.loss)}

    def _start_relay(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.seed is not None:
            env["SWARM_LAB_SEED"] = str(self.seed)
        env["SWARM_LAB_REALTIME"] = "1" if self.realtime_relay else "0"
        self.relay = subprocess.Popen([sys.executable, "-m", "swarm.testing.relay"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        for node in self.nodes.values():
            queues = {str(o.index): self._channel(o.spec.name, node.spec.name)
                      for o in self.nodes.values() if o is not node}
            self._relay_command({"op": "attach", "ns": node.namespace, "queues": queues})

    def _relay_command(self, command: dict[str, object]) -> dict[str, object]:
        relay = self.relay
        if relay is None or relay.stdin is None or relay.stdout is None:
            raise LabError("this lab has no relay: no host has delay, jitter or loss")
        with self._relay_lock:
            relay.stdin.write(json.dumps(command) + "\n")
            relay.stdin.flush()
            line = relay.stdout.readline()
        if not line:
            raise LabError(f"the delay relay exited ({relay.poll()})")
        answer: dict[str, object] = json.loads(line)
        if not answer.get("ok"):
            raise LabError(f"the delay relay refused {command.get('op')}: {answer.get('error')}")
        return answer

    # -- using --------------------------------------------------------------------------------

    def _node(self, host: str) -> _Node:
        try:
            return self.nodes[host]
        except KeyError:
            raise ValueError(f"no host {host!r} in this lab (hosts: {', '.join(self.nodes)})") from None

    def address(self, host: str) -> str:
        """The IPv4 address processes on `host` listen on (behind NAT: its LAN address)."""
        node = self._node(host)
        if host in self.homes:
            return f"192.168.{node.index % 250 + 1}.2"
        return node.address

    def public_address(self, host: str) -> str:
        """The address other hosts see `host`'s packets come from (its router's, behind NAT)."""
        return self._node(host).address

    def namespace(self, host: str) -> str:
        """The network namespace `host`'s processes run in."""
        return self.homes.get(host) or self._node(host).namespace

    def hosts(self) -> list[str]:
        return list(self.nodes)

    def exec(self, host: str, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Runs a command on `host` to completion."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(host), *argv], capture_output=True,
                              text=True, timeout=timeout, check=False)

    def spawn(self, host: str, argv: Sequence[str], *, stdout: int | IO[bytes] | None = subprocess.PIPE,
              stderr: int | IO[bytes] | None = None, stdin: int | IO[bytes] | None = None, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Starts a process on `host` in a session of its own (so `signal_group` reaches its
        children); it is killed when the lab closes, or when the process that owns the lab dies."""
        if self._closed:
            raise LabError("this lab is closed")
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], stdout=stdout,
                                stderr=stderr, stdin=stdin, env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.processes.append(proc)
        return proc

    def set_profile(self, host: str, link: LinkProfile) -> None:
        """Changes `host`'s access link while the lab runs (bandwidth at once, delay and loss for
        the packets that arrive from now on)."""
        node = self._node(host)
        if link.shaped and self.relay is None:
            raise LabError("delay, jitter and loss need the relay: give some host a shaped link when the lab is built")
        self.profiles[host] = link
        self._shape_bandwidth(node, link)
        if self.relay is not None:
            for other in self.nodes.values():
                if other is node:
                    continue
                for sender, receiver in ((other, node), (node, other)):
                    self._relay_command({"op": "set", "ns": receiver.namespace, "queue": sender.index,
                                         **self._channel(sender.spec.name, receiver.spec.name)})

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """Cuts every path between a host of `side_a` and a host of `side_b` (both ways) until `heal`."""
        a, b = frozenset(side_a), frozenset(side_b)
        if not a or not b or a & b:
            raise ValueError("a partition needs two non-empty, disjoint sides")
        for host in a | b:
            self._node(host)
        for mine, theirs in ((a, b), (b, a)):
            for host in mine:
                for other in theirs:
                    iptables(self._node(host).namespace, "-t", "raw", "-A", _CHAIN, "-s",
                                   self._node(other).address, "-j", "DROP")
        self.partitions.append((a, b))

    def heal(self) -> None:
        """Removes every partition."""
        for node in self.nodes.values():
            iptables(node.namespace, "-t", "raw", "-F", _CHAIN)
        self.partitions.clear()

    def relay_stats(self) -> dict[str, object]:
        """The relay's packet counts and CPU time (see `swarm.testing.relay`)."""
        stats = self._relay_command({"op": "stats"})["stats"]
        assert isinstance(stats, dict)
        return stats

    # -- cleaning up --------------------------------------------------------------------------

    def close(self) -> None:
        """Kills the lab's processes and removes its namespaces; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream:
                    stream.close()
        if self.relay is not None:
            if self.relay.stdin:
                self.relay.stdin.close()
            try:
                self.relay.wait(5)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                try:  # bounded: a process in an uninterruptible wait dies only when the kernel lets go
                    self.relay.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            if self.relay.stdout:
                self.relay.stdout.close()
        failed: list[LabError] = []

        def delete(name: str) -> None:
            try:
                delete_namespace(name)
            except LabError as e:  # one namespace that would not go keeps no other one
                failed.append(e)

        for name in reversed(self._created):
            delete(name)
        for name in lab_namespaces(self.prefix):  # anything half-made by an interrupted build
            delete(name)
        atexit.unregister(self.close)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]
        if failed:
            raise failed[0]
