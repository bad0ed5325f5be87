"""Item 6: identity files are locked by the file, not the path, and every problem with one is a
clear message and exit 2, never a traceback. Real `swarm-peer` processes."""

from __future__ import annotations

import os

import pytest
from procs import PeerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
LISTEN = ("--listen", "/ip4/127.0.0.1/tcp/0")


def refused(*args: str) -> str:
    """Starts a peer that must exit 2 at once; its stderr."""
    with PeerProcess(*LISTEN, *args, expect_addrs=0) as proc:
        assert proc.wait(30) == 2, proc.stderr_text()
        stderr = proc.stderr_text()
    assert "swarm-peer: error:" in stderr and "Traceback" not in stderr, stderr
    return stderr


def test_a_key_in_use_cannot_start_a_second_peer_through_a_symlink_or_a_hard_link(tmp_path) -> None:
    key = tmp_path / "peer.key"
    with PeerProcess(*LISTEN, "--identity", str(key)) as first:
        symlink, hard_link = tmp_path / "link.key", tmp_path / "other" / "hard.key"
        symlink.symlink_to(key)
        hard_link.parent.mkdir()
        os.link(key, hard_link)
        for path in (symlink, hard_link):
            assert "in use by another running peer" in refused("--identity", str(path))
        assert first.proc.poll() is None  # the first peer keeps serving
        assert first.stop() == 0


def test_a_key_readable_by_others_is_refused(tmp_path) -> None:
    key = tmp_path / "peer.key"
    with PeerProcess(*LISTEN, "--identity", str(key)) as first:
        assert first.stop() == 0
    key.chmod(0o644)
    stderr = refused("--identity", str(key))
    assert "accessible by other users (mode 0644)" in stderr and "chmod 600" in stderr


def test_an_unusable_identity_path_is_a_clear_error(tmp_path) -> None:
    key = tmp_path / "peer.key"
    (tmp_path / "peer.key.lock").mkdir()
    assert "cannot use identity file" in refused("--identity", str(key))
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    assert "cannot use identity file" in refused("--identity", str(regular / "peer.key"))
