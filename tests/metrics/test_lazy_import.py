"""A DHT-only daemon without `--metrics-port` never loads prometheus_client (~4.5 MB of its
memory, BENCHMARKS.md "Transport security"), nor `cryptography.x509` (~3 MB: the certificates it
makes are written by `swarm.net.der`), nor standard-library modules it has no use for, nor `swarm.core.malloc`'s heap tuning (for peers
that move tensors); one with `--metrics-port` serves `/metrics` as before."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request

from procs import PeerProcess

from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig
from swarm.peer import Peer

CLIENT = DHTConfig(request_timeout=2.0, lookup_timeout=10.0, cache_size=0)


def imported_modules(stderr: str) -> set[str]:
    """Modules a process imported, from its `PYTHONPROFILEIMPORTTIME` lines on stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def imported(stderr: str) -> set[str]:
    """Top-level packages a process imported."""
    return {name.split(".")[0] for name in imported_modules(stderr)}


def test_a_dht_only_daemon_serving_requests_never_imports_prometheus_client_nor_x509():
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", env={"PYTHONPROFILEIMPORTTIME": "1"},
                     ready_timeout=60) as first, \
            PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", first.addrs[0],
                        env={"PYTHONPROFILEIMPORTTIME": "1"}, ready_timeout=60) as daemon:
        client = Peer(initial_peers=daemon.addrs, client_mode=True, dht_config=CLIENT)
        try:
            now = get_dht_time()
            assert client.dht.store("lazy-metrics", "v", now + 60)  # stored on both daemons over TLS
            assert client.dht.get("lazy-metrics", latest=True).value == "v"
        finally:
            client.shutdown()
        daemon.signal(signal.SIGINT)
        assert daemon.wait() == 0
        daemon_log = daemon.stderr_text()
        modules = imported_modules(daemon_log)
        first.signal(signal.SIGINT)
        assert first.wait() == 0
        answered = first.stderr_text()
    # the first daemon answered the second's dial-back (its TLS session there proved the PeerID
    # through the trust anchor, `tls.prove`), which reads no certificate itself
    assert "reachability: public" in daemon_log and "cryptography.x509" not in imported_modules(answered)
    names = {name.split(".")[0] for name in modules}
    assert "swarm" in names and "grpc" in names and "swarm.net.tls" in modules  # the import log is there
    assert "prometheus_client" not in names and "torch" not in names
    assert "cryptography.x509" not in modules
    assert "cryptography.hazmat.primitives.serialization" not in modules  # ~0.6 MB: the leaf key is swarm.net.der's
    # standard-library modules with nothing to do for such a daemon (~1.2 MB together): a config
    # file's parser, argparse's terminal sizing, ctypes' library search, a temporary directory for
    # the TLS key, the loop's idna codec for address literals
    assert not modules & {"tomllib", "shutil", "tempfile", "ctypes.util", "encodings.idna"}, modules
    # it moves no tensors, so it leaves glibc's heap thresholds alone (they would keep its peak)
    assert not modules & {"swarm.core.malloc", "ctypes"}, modules


def test_metrics_modules_load_without_prometheus_client_until_a_family_is_asked_for():
    code = (
        "import sys\n"
        "import swarm.metrics, swarm.net.server, swarm.net.channels, swarm.peer\n"
        "assert 'prometheus_client' not in sys.modules, 'imported early'\n"
        "from swarm.metrics import AVERAGING_ROUNDS, REGISTRY\n"
        "assert 'prometheus_client' in sys.modules\n"
        "AVERAGING_ROUNDS.labels(outcome='succeeded').inc()\n"
        "text = REGISTRY.render()\n"
        "assert 'swarm_averaging_rounds_total{outcome=\"succeeded\"} 1.0' in text, text\n"
        "assert 'process_cpu_seconds_total' in text, text\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_daemon_with_metrics_port_still_serves_metrics():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port), ready_timeout=60), \
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "swarm_rpc_server_calls_total" in text and "process_resident_memory_bytes" in text
    assert "swarm_averaging_rounds_total" in text
