"""A peer's long-lived objects leave the garbage collector's full collections (swarm/core/collector.py).

Each case runs in a fresh interpreter: the freeze is once per process, and the test workers'
own processes may have frozen already.
"""

import os
import subprocess
import sys
import textwrap


def run_script(source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          check=False, timeout=60, env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def test_objects_alive_at_the_freeze_leave_collections_and_garbage_then_is_freed_first():
    result = run_script("""
        import gc, weakref
        from swarm.core.collector import freeze_long_lived

        class Node:
            pass

        kept = [Node()]          # alive at the freeze: full collections stop visiting it
        cycle = Node()
        cycle.self = cycle       # garbage already, reachable only through its own cycle
        gone = weakref.ref(cycle)
        del cycle
        gc.disable()             # so only the freeze's own collection can free the cycle
        assert gone() is not None

        assert freeze_long_lived() is True
        assert gone() is None, "the cycle was frozen instead of freed"
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "a frozen object is still collected"
        later = [Node()]
        assert any(o is later for o in gc.get_objects()), "objects made after the freeze are collected"
        assert freeze_long_lived() is False   # once per process
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_peer_that_averages_freezes_what_it_imported():
    result = run_script("""
        import gc
        import torch
        import swarm
        from swarm.averaging import Averager

        assert gc.get_freeze_count() == 0   # importing swarm freezes nothing
        peer = swarm.Peer(listen="/ip4/127.0.0.1/tcp/0")
        try:
            assert gc.get_freeze_count() == 0   # a peer that does not average freezes nothing
            Averager(peer, [torch.zeros(4)], prefix="collector-test")
            assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()
        finally:
            peer.shutdown()
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"



def pollers_at_exit(averages: bool) -> subprocess.CompletedProcess[str]:
    """Two peers talk over a call stream; with `averages`, one of them then averages (so the
    freeze runs while the stream is open); both shut down. The stream's objects then sit in
    reference cycles (frozen ones with `averages`). Freed during finalization, they would shut
    down grpc.aio's completion queue there, and its poller thread, taking the GIL, would abort
    the process. The exit hook below is registered before swarm's, so it runs after it: it
    prints the poller threads still running."""
    return run_script(f"""
        import atexit, threading

        def at_exit():
            pollers = [t.name for t in threading.enumerate() if "_poll_wrapper" in t.name]
            print("pollers at exit:", pollers)

        atexit.register(at_exit)

        import swarm

        a = swarm.Peer(listen="/ip4/127.0.0.1/tcp/0")
        b = swarm.Peer(initial_peers=[str(a.addrs[0])], listen="/ip4/127.0.0.1/tcp/0")
        assert b.dht.get("no-such-key") is None   # a call on b's stream to a
        if {averages}:
            import torch
            swarm.Averager(b, [torch.zeros(4)], prefix="collector-exit-test", target_group_size=2)
        b.shutdown()
        a.shutdown()
        assert any("_poll_wrapper" in t.name for t in threading.enumerate()), "the case no longer holds gRPC objects"
    """)


def test_grpc_objects_left_in_reference_cycles_are_freed_before_the_interpreter_finalizes():
    result = pollers_at_exit(averages=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pollers at exit: []", result.stdout


def test_grpc_objects_the_freeze_holds_are_freed_before_the_interpreter_finalizes():
    result = pollers_at_exit(averages=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pollers at exit: []", result.stdout
