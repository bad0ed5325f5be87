"""The private-swarm commands and options of `swarm-peer`: three commands start a private swarm;
the options come from flags, the environment or a TOML file; an uninvited daemon cannot join."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import PeerProcess

from swarm.cli.config import build_parser, resolve
from swarm.cli.health import _probe
from swarm.core.errors import ConfigError
from swarm.core.membership import MembershipCertificate, RevocationList, parse_authority
from swarm.core.multiaddr import Multiaddr

pytestmark = pytest.mark.timeout(90)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm", *args], check=False, cwd=cwd, capture_output=True, text=True,
                          timeout=30, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_three_commands_start_a_private_swarm_and_a_stranger_cannot_join(tmp_path: Path) -> None:
    made = _cli("authority", "init", "--out", "authority.key", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    public = made.stdout.strip()
    assert parse_authority(public) and (tmp_path / "authority.key").stat().st_mode & 0o777 == 0o600
    for name, roles in (("a", ["--role", "trainer", "--role", "relay"]), ("b", [])):
        invited = _cli("invite", "--authority-key", "authority.key", "--identity", f"{name}.id", "--expires", "1d",
                       *roles, "--out", f"{name}.cert", cwd=tmp_path)
        assert invited.returncode == 0, invited.stderr
    assert MembershipCertificate.load(tmp_path / "a.cert").roles == ("relay", "trainer")
    again = _cli("authority", "init", "--out", "authority.key", cwd=tmp_path)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    listen = ["--listen", "/ip4/127.0.0.1/tcp/0", "--reachability", "public"]
    with PeerProcess(*listen, "--identity", "a.id", "--swarm-authority", public, "--membership", "a.cert",
                     "--dashboard-port", "0", cwd=str(tmp_path)) as first:
        (tmp_path / "b.toml").write_text(f'swarm-authority = "{public}"\nmembership = "b.cert"\nidentity = "b.id"\n'
                                         f'initial-peers = ["{first.addrs[0]}"]\n')
        with PeerProcess(*listen, "--config", "b.toml", cwd=str(tmp_path)) as second:
            assert second.addrs[0].endswith("/p2p/" + MembershipCertificate.load(tmp_path / "b.cert").peer_id)
            stranger = PeerProcess(*listen, "--initial-peers", first.addrs[0], cwd=str(tmp_path), expect_addrs=0)
            with stranger:
                assert stranger.wait(30) == 2
                assert "not a member of this private swarm (missing)" in stranger.stderr_text()
            # `status` asks as a member of its own (an observer), and the health probe of `--self`
            # counts a member's refusal of an anonymous probe as a live peer
            assert _cli("invite", "--authority-key", "authority.key", "--identity", "obs.id", "--role", "observer",
                        "--out", "obs.cert", cwd=tmp_path).returncode == 0
            status = _cli("status", "--initial-peers", first.addrs[0], "--identity", "obs.id", "--swarm-authority",
                          public, "--membership", "obs.cert", cwd=tmp_path)
            assert status.returncode == 0 and second.addrs[0].rsplit("/", 1)[1] in status.stdout, status
            probe = asyncio.run(_probe(Multiaddr.parse(first.addrs[0]), None, 10.0))
            assert probe.startswith("ok ") and "private swarm" in probe
            assert second.stop() == 0
        assert first.stop() == 0
        logged = first.stderr_text()
        assert "refused caller" in logged
        # its dashboard is private: the operator gets the URL with the page's token
        assert re.search(r"# the dashboard of this private swarm: http://127\.0\.0\.1:\d+/\?token=[\w-]{20,}", logged)


def test_revoke_numbers_lists_and_keeps_earlier_revocations(tmp_path: Path) -> None:
    assert _cli("authority", "init", "--out", "authority.key", cwd=tmp_path).returncode == 0
    a, b = "12D3KooWQXgUF9BjkbGVo36iU1Nfnzzr1KSCnKE81AYWfaDxy9je", "12D3KooWBozueg29DxZUkAHo3XWY82qBAQGdN8d1Gjzor9mFSbLL"
    assert _cli("revoke", "--authority-key", "authority.key", "--peer-id", a, "--out", "r1", cwd=tmp_path).returncode == 0
    done = _cli("revoke", "--authority-key", "authority.key", "--peer-id", b, "--previous", "r1", "--out", "r2",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = _cli("authority", "show", "--authority-key", "authority.key", cwd=tmp_path)
    second = RevocationList.load(tmp_path / "r2", parse_authority(shown.stdout))
    assert second.number == 2 and second.peer_ids == {a, b}
    bad = _cli("invite", "--authority-key", "authority.key", "--peer-id", "nonsense", cwd=tmp_path)
    assert bad.returncode == 2 and "error" in bad.stderr


def test_private_options_come_from_the_environment_and_must_pair() -> None:
    options = resolve(build_parser().parse_args([]), {"SWARM_SWARM_AUTHORITY": "swarm-authority:x",
                                                      "SWARM_MEMBERSHIP": "/m.cert"})
    assert options.swarm_authority == "swarm-authority:x" and options.membership == "/m.cert"
    assert resolve(build_parser().parse_args([]), {"SWARM_DASHBOARD_PUBLIC": "1"}).dashboard_public
    assert resolve(build_parser().parse_args(["--dashboard-public"]), {}).dashboard_public
    assert not resolve(build_parser().parse_args([]), {}).dashboard_public
    with pytest.raises(ConfigError, match="both"):
        resolve(build_parser().parse_args(["--membership", "m.cert"]), {})
    with pytest.raises(ConfigError, match="not both"):
        resolve(build_parser().parse_args(["--swarm-key", "k", "--swarm-authority", "a", "--membership", "m"]), {})
