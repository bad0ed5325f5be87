"""Checkpoints that cannot be written are errors the operator sees. Real
`swarm-peer --experts` processes on a tiny tmpfs (root only): a read-only directory fails at start
with exit 2; a disk that fills up fails the final save, the daemon exits 1 saying so, and the
previous checkpoint stays intact."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from procs import PeerProcess

from swarm.moe import RemoteExpert
from swarm.moe.server.checkpoints import checkpoint_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
HID = 256  # a checkpoint of ~2 MB, ~6 MB once Adam has state


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                            check=False, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def serve(directory: Path, *, expect_addrs: int = 1) -> PeerProcess:
    return PeerProcess(
        "--listen", "/ip4/127.0.0.1/tcp/0", "--experts", "ffn.0", "--expert-cls", "ffn",
        "--hidden-dim", str(HID), "--checkpoint-dir", str(directory), ready_timeout=60, expect_addrs=expect_addrs,
    )


def test_a_read_only_checkpoint_dir_fails_at_start(tiny_disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    with serve(tiny_disk, expect_addrs=0) as server:
        assert server.wait(60) == 2
        stderr = server.stderr_text()
    assert f"checkpoint directory {tiny_disk} is not writable" in stderr and "Traceback" not in stderr, stderr


def test_a_failed_final_save_exits_non_zero_and_keeps_the_previous_checkpoint(make_peer, tiny_disk: Path) -> None:
    with serve(tiny_disk) as first:
        assert first.stop() == 0
    path = checkpoint_path(tiny_disk, "ffn.0")
    saved = path.read_bytes()
    with serve(tiny_disk) as server:
        client = make_peer(client_mode=True)
        x = torch.randn(4, HID, requires_grad=True)
        RemoteExpert(client, "ffn.0", server.addrs[0], forward_timeout=30, backward_timeout=30)(x).sum().backward()
        server.signal(signal.SIGINT)
        assert server.wait(60) == 1
        stderr = server.stderr_text()
    assert "swarm-peer: error: the last checkpoint failed" in stderr and "ffn.0" in stderr, stderr
    assert path.read_bytes() == saved  # the previous checkpoint, intact
    assert not [p for p in tiny_disk.iterdir() if p.name.endswith(".tmp")]  # no half-written file left
