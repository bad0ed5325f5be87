"""The lab's network, for real: namespaces on a bridge, delay and loss through the relay, tbf,
NAT, partitions, and cleanup also when the owner is interrupted or killed (needs root)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swarm.testing import HostSpec, Lab, LabError, LinkProfile, clean_stale
from swarm.testing import lab as lab_module
from swarm.testing.netns import delete_namespace, lab_namespaces

pytestmark = pytest.mark.usefixtures("needs_lab")
PY = sys.executable


def probe_rtt(lab: Lab, src: str, dst: str, count: int = 20, address: str | None = None,
              timeout: float = 0.5) -> dict:
    """UDP round trips from `src` to an echo server on `dst`; a probe unanswered in `timeout` s is lost."""
    echo = lab.spawn(dst, [PY, "-m", "swarm.testing.probe", "echo", lab.address(dst), "9000"])
    assert echo.stdout.readline() == b"ready\n"
    done = lab.exec(src, [PY, "-m", "swarm.testing.probe", "rtt", address or lab.address(dst), "9000",
                          str(count), "0.005", str(timeout)], timeout=60)
    echo.kill()
    echo.wait()
    if done.returncode != 0:
        return {"error": done.stderr}
    return json.loads(done.stdout)


def root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_live_in_namespaces_that_are_removed_afterwards() -> None:
    links = root_links()
    with Lab([HostSpec("a"), HostSpec("b"), HostSpec("c", nat=True)]) as lab:
        names = lab_namespaces(lab.prefix)
        assert len(names) == 5  # the bridge, a, b, c's router and c itself
        assert root_links() == links  # the machine's own namespace gets no links, no addresses
        assert lab.address("a") != lab.address("b")
        assert probe_rtt(lab, "a", "b")["lost"] == 0
    assert lab_namespaces(lab.prefix) == []
    assert root_links() == links


def test_delay_makes_the_round_trip_at_least_what_was_asked() -> None:
    slow = LinkProfile(delay_ms=10)  # two such hosts: 4 x 10 ms a round trip
    with Lab([HostSpec("a", slow), HostSpec("b", slow)], seed=1) as lab:
        result = probe_rtt(lab, "a", "b", count=20)
        stats = lab.relay_stats()
    assert result["lost"] == 0
    assert result["p10_ms"] >= 40.0
    assert result["p50_ms"] < 200.0  # not lost in the relay either (a loose bound: the machine is shared)
    assert stats["overruns"] == 0


@pytest.mark.parametrize("realtime", [True, False])
def test_the_relay_runs_in_the_real_time_class_unless_told_not_to(realtime: bool) -> None:
    slow = LinkProfile(delay_ms=1)
    with Lab([HostSpec("a", slow), HostSpec("b", slow)], realtime_relay=realtime) as lab:
        assert lab.relay is not None
        policy = os.sched_getscheduler(lab.relay.pid)
        stats = lab.relay_stats()
    if realtime and not stats["realtime"]:
        probe = subprocess.run([PY, "-c", "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"],
                               capture_output=True, check=False)
        assert probe.returncode != 0, "this machine allows the real-time class, but the relay did not get it"
        pytest.skip("this machine refuses the real-time class (no CAP_SYS_NICE): the relay stays a normal process")
    assert stats["realtime"] is realtime
    assert policy == (os.SCHED_FIFO if realtime else os.SCHED_OTHER)


def test_loss_drops_packets_and_the_relay_counts_them() -> None:
    lossy = LinkProfile(loss=0.3)
    with Lab([HostSpec("a", lossy), HostSpec("b")], seed=3) as lab:
        result = probe_rtt(lab, "a", "b", count=60)
        queues = lab.relay_stats()["queues"]
    dropped = sum(q["dropped"] for per_ns in queues.values() for q in per_ns.values())
    assert 0 < result["lost"] < 60
    assert 10 <= dropped <= 90  # of ~120 packets through a's lossy link (a late answer counts as lost above)


def test_bandwidth_is_capped_by_tbf() -> None:
    capped = LinkProfile(up_mbit=20)
    with Lab([HostSpec("a", capped), HostSpec("b")]) as lab:
        sink = lab.spawn("b", [PY, "-m", "swarm.testing.probe", "sink", lab.address("b"), "9001"])
        assert sink.stdout.readline() == b"ready\n"
        lab.exec("a", [PY, "-m", "swarm.testing.probe", "source", lab.address("b"), "9001", "2"], timeout=60)
        got = json.loads(sink.stdout.readline())
    assert got["bytes"] > 0
    assert got["mbit_per_s"] < 20 * 1.15


def test_a_host_behind_nat_dials_out_but_nobody_dials_in() -> None:
    with Lab([HostSpec("a"), HostSpec("home", nat=True)]) as lab:
        assert lab.public_address("home") != lab.address("home")
        assert probe_rtt(lab, "home", "a", count=3)["lost"] == 0
        assert probe_rtt(lab, "a", "home", count=2, address=lab.public_address("home"))["lost"] == 2
        assert "unreachable" in probe_rtt(lab, "a", "home", count=1)["error"]


def test_a_partition_cuts_both_ways_until_healed() -> None:
    with Lab([HostSpec("a"), HostSpec("b"), HostSpec("c")]) as lab:
        lab.partition({"a"}, {"b", "c"})
        assert probe_rtt(lab, "a", "b", count=2)["lost"] == 2
        assert probe_rtt(lab, "c", "a", count=2)["lost"] == 2
        assert probe_rtt(lab, "b", "c", count=2)["lost"] == 0
        lab.heal()
        assert probe_rtt(lab, "a", "b", count=2)["lost"] == 0
        with pytest.raises(ValueError):
            lab.partition({"a"}, {"a"})
        with pytest.raises(ValueError):
            lab.partition({"a"}, {"nope"})



def test_a_namespace_that_will_not_go_keeps_no_other_one(monkeypatch: pytest.MonkeyPatch) -> None:
    lab = Lab([HostSpec("a"), HostSpec("b")])
    try:
        with pytest.raises(LabError, match="refused"), lab:
            stuck = lab.namespace("a")

            def delete(name: str) -> None:
                if name == stuck:
                    raise LabError(f"ip netns delete {name}: refused")
                delete_namespace(name)

            monkeypatch.setattr(lab_module, "delete_namespace", delete)
        assert lab_namespaces(lab.prefix) == [stuck]  # the bridge and b are gone all the same
    finally:
        for name in lab_namespaces(lab.prefix):
            delete_namespace(name)
    assert lab_namespaces(lab.prefix) == []


OWNER = textwrap.dedent("""
    import faulthandler, signal, sys, time
    # Ctrl+C and SIGTERM as a process started from a shell has them: a signal the test process
    # ignores or blocks (a library used in-process may ignore SIGINT) would reach this one so
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    faulthandler.register(signal.SIGUSR1)  # its stack on stderr, should it not exit when told
    from swarm.testing import Lab, HostSpec, LinkProfile
    with Lab([HostSpec("a", LinkProfile(delay_ms=1)), HostSpec("b")]) as lab:
        lab.spawn("a", ["sleep", "600"])
        print(lab.prefix, flush=True)
        time.sleep(600)
""")


def start_owner() -> tuple[subprocess.Popen, str]:
    owner = subprocess.Popen([PY, "-c", OWNER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    prefix = owner.stdout.readline().strip()
    assert prefix.startswith("swlab-"), prefix or owner.stderr.read()
    assert len(lab_namespaces(prefix)) == 3
    return owner, prefix


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_lab_removes_everything(signum: int) -> None:
    owner, prefix = start_owner()
    owner.send_signal(signum)
    wait_or_explain(owner, 60)
    assert lab_namespaces(prefix) == []


def wait_or_explain(owner: subprocess.Popen, seconds: float) -> None:
    """Waits for the owner to exit; if it does not in `seconds` (it exits in ~0.1 s here, also
    with every core busy), fails with what it and its children were doing: the owner's Python
    stack, each process's state and kernel wait channel, and the owner's signal masks."""
    try:
        owner.wait(seconds)
        return
    except subprocess.TimeoutExpired:
        pass
    tree = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:32,etime,args", "--pid", str(owner.pid),
                           "--ppid", str(owner.pid)], check=False, capture_output=True, text=True).stdout
    status = Path(f"/proc/{owner.pid}/status").read_text()
    tree += "".join(line + "\n" for line in status.splitlines() if line.startswith("Sig"))
    owner.send_signal(signal.SIGUSR1)
    try:  # gathers the stack it prints; the owner still does not exit
        owner.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    owner.kill()
    _, stderr = owner.communicate(timeout=30)
    clean_stale()
    pytest.fail(f"the lab's owner had not exited {seconds} s after the signal\n{tree}\n{stderr}")


def test_the_stale_cleaner_removes_what_a_killed_lab_left() -> None:
    owner, prefix = start_owner()
    owner.kill()
    owner.wait(30)
    left = lab_namespaces(prefix)
    assert len(left) == 3  # SIGKILL: nothing could clean up
    assert set(left) <= set(clean_stale())
    assert lab_namespaces(prefix) == []
