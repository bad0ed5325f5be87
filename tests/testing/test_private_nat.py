"""A private swarm in the network lab (real processes in real namespaces): a member behind NAT is
reached through an invited relay, never through a member without the relay role, and an uninvited
peer on the same network is refused (docs/security.md, "Private swarms")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from swarm.core.identity import IdentityFile
from swarm.core.membership import Authority
from swarm.core.multiaddr import Multiaddr
from swarm.testing import HostSpec, Lab

sys.path.insert(0, str(Path(__file__).parent))  # the NAT tests' process helpers
from test_nat_relay import Lines, peer_process

PY = sys.executable
INFO = str(Path(__file__).with_name("private_info.py"))


def test_a_member_behind_nat_is_reached_through_an_invited_relay_only(needs_lab, tmp_path: Path) -> None:
    authority = Authority.generate()
    files: dict[str, tuple[str, str]] = {}
    for name, roles in {"relay": ["trainer", "relay"], "plain": ["trainer"], "home": ["trainer"],
                        "caller": ["trainer"]}.items():
        identity = IdentityFile(tmp_path / f"{name}.id")
        peer_id = identity.load_or_create().peer_id
        identity.release()
        cert = tmp_path / f"{name}.cert"
        cert.write_text(authority.invite(peer_id, roles, 3600).to_text())
        files[name] = (str(tmp_path / f"{name}.id"), str(cert))

    def member(name: str) -> list[str]:
        identity, cert = files[name]
        return ["--identity", identity, "--swarm-authority", authority.public_text, "--membership", cert]

    hosts = [HostSpec("r1"), HostSpec("r2"), HostSpec("t1"), HostSpec("home", nat=True)]
    with Lab(hosts) as lab:
        _, relay_addrs = peer_process(lab, "r1", *member("relay"), "--relay", "on")
        _, plain_addrs = peer_process(lab, "r2", *member("plain"), "--relay", "on", "--initial-peers", relay_addrs[0])
        _, home_addrs = peer_process(lab, "home", *member("home"), "--initial-peers", plain_addrs[0], relay_addrs[0])
        relayed = [Multiaddr.parse(a) for a in home_addrs]
        relay_id, plain_id = Multiaddr.parse(relay_addrs[0]).peer_id, Multiaddr.parse(plain_addrs[0]).peer_id
        # behind NAT, it reserved on the invited relay only: the other member lacks the relay role
        assert {a.relay_id for a in relayed} == {relay_id}, home_addrs
        assert plain_id not in home_addrs[0]
        identity, cert = files["caller"]
        caller = lab.spawn("t1", [PY, INFO, authority.public_text, cert, identity, home_addrs[0]])
        answer = json.loads(Lines(caller).next(90))
        assert answer["ok"], answer
        assert answer["peer_id"] == Multiaddr.parse(home_addrs[0]).peer_id
        # an uninvited caller on the same network is refused by the relay (before the member hears of it)
        foreign = Authority.generate()  # a valid certificate, from another swarm's authority
        stranger_cert = tmp_path / "stranger.cert"
        stranger_id = IdentityFile(tmp_path / "stranger.id")
        stranger_cert.write_text(foreign.invite(stranger_id.load_or_create().peer_id, ["trainer"], 3600).to_text())
        stranger_id.release()
        stranger = lab.spawn("t1", [PY, INFO, foreign.public_text, str(stranger_cert), str(tmp_path / "stranger.id"),
                                    home_addrs[0]])
        refused = json.loads(Lines(stranger).next(90))
        assert not refused["ok"] and "not a member of this private swarm" in refused["error"], refused
