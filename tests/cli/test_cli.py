"""`swarm-peer` as a volunteer runs it: a real process, real signals."""

import os
import re
import signal
import subprocess
import sys

import pytest
from procs import PeerProcess

ADDR = re.compile(r"^/(ip4|ip6|dns4|dns6|dns)/[^/]+/tcp/\d+/p2p/12D3KooW[1-9A-HJ-NP-Za-km-z]+$")
NOISE = ("Traceback", "Task was destroyed", "Exception ignored", "RuntimeWarning")


def clean(stderr: str) -> bool:
    return not any(n in stderr for n in NOISE)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_prints_addresses_and_exits_zero_on_signal(signum):
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0") as peer:
        assert len(peer.addrs) == 1 and ADDR.match(peer.addrs[0]), peer.addrs
        peer.signal(signum)
        assert peer.wait(10) == 0
        stderr = peer.stderr_text()
        assert clean(stderr), stderr
        assert "shutting down" in stderr and "stopped" in stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread masks from /proc")
def test_only_the_signal_thread_takes_stop_signals():
    """No handler runs on the main thread between its bytecodes (where it can deadlock on a lock it
    holds, swarm/core/signals.py): every thread blocks SIGINT/SIGTERM but the one in `sigwait`
    (which unblocks them while it waits)."""
    stop_bits = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0") as peer:
        takers = []
        tids = [int(task) for task in os.listdir(f"/proc/{peer.pid}/task")]
        for tid in tids:
            with open(f"/proc/{peer.pid}/task/{tid}/status") as status:
                mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigBlk:"))
            if mask & stop_bits != stop_bits:
                takers.append(tid)
        assert len(tids) >= 3 and len(takers) == 1 and takers[0] != peer.pid, (tids, takers)
        assert peer.stop() == 0


def test_second_signal_exits_at_once():
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0") as peer:
        peer.signal(signal.SIGSTOP)  # make sure both signals are pending when it resumes
        peer.signal(signal.SIGINT)
        peer.signal(signal.SIGINT)
        peer.signal(signal.SIGCONT)
        assert peer.wait(10) in (0, 128 + signal.SIGINT)


def test_unspecified_listen_address_prints_dialable_addresses():
    with PeerProcess("--listen", "/ip4/0.0.0.0/tcp/0") as peer:
        assert ADDR.match(peer.addrs[0]) and peer.addrs[0].startswith("/ip4/127.0.0.1/")
        assert peer.stop() == 0


def test_identity_file_keeps_the_peer_id_and_cannot_be_shared(tmp_path):
    key = tmp_path / "peer.key"
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(key)) as first:
        peer_id = first.addrs[0].rsplit("/", 1)[1]
        assert oct(os.stat(key).st_mode & 0o777) == "0o600"
        with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(key), expect_addrs=0) as second:
            assert second.wait(20) == 2
            assert "in use by another running peer" in second.stderr_text()
        assert first.stop() == 0
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(key)) as again:
        assert again.addrs[0].endswith(f"/p2p/{peer_id}")
        assert again.stop() == 0


def test_environment_and_config_file(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('listen = "/ip4/127.0.0.1/tcp/0"\nannounce = ["/dns4/volunteer.example.org/tcp/4000"]\n')
    with PeerProcess(env={"SWARM_CONFIG": str(config), "SWARM_LOG_LEVEL": "WARNING"}) as peer:
        assert peer.addrs[0].startswith("/dns4/volunteer.example.org/tcp/4000/p2p/12D3KooW")
        assert peer.stop() == 0
        assert "ready at" not in peer.stderr_text()  # WARNING level from the environment
    # the command line wins over the environment
    with PeerProcess("--announce", "/ip4/198.51.100.7/tcp/5", env={"SWARM_CONFIG": str(config)}) as peer:
        assert peer.addrs[0].startswith("/ip4/198.51.100.7/tcp/5/p2p/")
        assert peer.stop() == 0


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--listen", "/ip4/1.2.3/tcp/0"], {}, "not a valid /ip4 host"),
        (["--log-level", "LOUD"], {}, "--log-level must be"),
        ([], {"SWARM_CLIENT_MODE": "maybe"}, "SWARM_CLIENT_MODE: invalid value"),
        (["--bulk-port", "70000"], {}, "--bulk-port must be a TCP port or 'off'"),
    ],
)
def test_bad_options_are_clear_errors(args, env, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=30, check=False,
                            env={**os.environ, **env})
    assert result.returncode == 2 and message in result.stderr and clean(result.stderr), result.stderr


def test_bad_config_file_is_a_clear_error(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text("listen = [\n")
    result = subprocess.run([sys.executable, "-m", "swarm", "--config", str(config)], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2 and "is not valid TOML" in result.stderr
    config.write_text('lisen = "/ip4/127.0.0.1/tcp/0"\n')
    result = subprocess.run([sys.executable, "-m", "swarm", "--config", str(config)], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2 and "unknown option 'lisen'" in result.stderr


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "swarm-peer")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0 and "--initial-peers" in result.stdout


def test_bulk_port_option_reaches_the_server():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "swarm", "--listen", "/ip4/127.0.0.1/tcp/0", "--bulk-port",
                                 str(port)], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2 and f"cannot open the bulk port 127.0.0.1:{port}" in result.stderr, result.stderr
    assert clean(result.stderr), result.stderr
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--bulk-port", "off") as peer:
        assert peer.stop() == 0
