"""Private swarms with real peers (docs/security.md, "Private swarms"): strangers, thieves and
revoked members get nothing; invited peers work as before."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch
from torch import nn

from swarm.averaging import Averager
from swarm.averaging.state import State, StateServer
from swarm.core.errors import (
    ConfigError,
    DHTError,
    PermissionDenied,
    ValidationError,
)
from swarm.core.identity import Identity
from swarm.core.membership import (
    Authority,
    CertificatePolicy,
    MembershipCertificate,
    RevocationList,
    SwarmKey,
)
from swarm.core.multiaddr import Multiaddr
from swarm.dht.revocations import REVOCATION_TTL
from swarm.dht.routing import NodeInfo
from swarm.dht.validation import DHTRecord
from swarm.dht.wire import STORED, node_id_of, store_item
from swarm.moe.dht_declare import DHTExpertSource, declarations, declare_experts
from swarm.moe.server.expert_server import ExpertServer
from swarm.net.channels import ChannelPool
from swarm.net.membership import METADATA_KEY, MembershipGate
from swarm.net.nat import NatConfig
from swarm.net.relay import GRPC_PORT, MEMBER_HEADER, member_header, reserve_payload
from swarm.optim import CollaborationConfig, Optimizer
from swarm.peer import Peer

DAY = 86400.0
pytestmark = pytest.mark.timeout(90)


class Swarm:
    """An authority and the peers it invited (all on loopback)."""

    def __init__(self, make_peer: Callable[..., Peer]) -> None:
        self.authority = Authority.generate()
        self.make_peer = make_peer
        self.peers: list[Peer] = []

    def invite(self, roles: tuple[str, ...] = ("trainer",), **kwargs: Any) -> Peer:
        identity = Identity.generate()
        certificate = self.authority.invite(identity.peer_id, list(roles), DAY)
        initial = [self.peers[0].addrs[0]] if self.peers else []
        peer = self.make_peer(identity=identity, initial_peers=initial, swarm_authority=self.authority.public_text,
                              membership=certificate, **kwargs)
        self.peers.append(peer)
        return peer


@pytest.fixture
def swarm(make_peer: Callable[..., Peer]) -> Swarm:
    return Swarm(make_peer)


def _probe_every_method(target: Peer, pool: ChannelPool, owner: Peer) -> dict[str, tuple[grpc.StatusCode, int]]:
    """Calls every method `target` serves, from `pool` (run on `owner`'s loop): for each, the status
    and how many refusals `target`'s gate counted during the call."""
    assert target.server is not None and target.gate is not None
    paths = sorted(target.server._dispatcher.handlers)  # every service the peer hosts, whatever its layer
    refused = target.gate.refused

    async def probe() -> dict[str, tuple[grpc.StatusCode, int]]:
        channel = pool.get(target.addrs[0])
        await channel._prove_identity()  # TLS proves the callee; no membership exchange from this pool
        codes = {}
        for path in paths:
            before = sum(refused.values())
            call = channel.channel.stream_stream(path)
            try:
                async for _ in call(iter([b"\x00" * 16]), timeout=5, metadata=channel._metadata()):
                    pass
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                code = e.code()
            codes[path] = (code, sum(refused.values()) - before)
        return codes

    return owner.run(probe(), timeout=60)


def test_an_uninvited_peer_obtains_no_record_and_every_service_refuses_it(swarm: Swarm, make_peer: Callable[..., Peer],
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    first, second = swarm.invite(), swarm.invite(("server", "trainer"))
    assert second.dht is not None and second.dht.store("secret", "weights", time.time() + 60)
    assert first.dht is not None and first.dht.get("secret") is not None
    with pytest.raises(DHTError, match=r"not a member of this private swarm \(missing\)"):
        make_peer(initial_peers=first.addrs)  # an open peer cannot even join
    # every service a member can host: averaging, state transfer, experts
    averager = Averager(first, [torch.zeros(1000)], prefix="run", target_group_size=2)
    StateServer(first, "run", lambda: State({"step": 1}, [torch.ones(1000)]))
    ExpertServer(first, {"ffn.0.0": nn.Linear(4, 4)})
    stranger = make_peer()  # alone, then it dials a member directly, every method, with garbage
    with caplog.at_level(logging.WARNING, logger="swarm.net.membership"):
        codes = _probe_every_method(first, stranger.pool, stranger)
    handshake = "/swarm.Peer/Handshake"  # proves the callee's PeerID only (plaintext mode): public
    assert len(codes) > 15  # DHT, averaging, state transfer, experts' wire, bulk, calls, dial-back...
    # every call was refused by the gate before its handler ran: PERMISSION_DENIED with the reason
    # (or, where grpc's core reports the abort of a stream whose request it was still reading,
    # INTERNAL), and the gate counted the refusal
    allowed = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL}
    bad = {path: result for path, result in codes.items()
           if path != handshake and (result[0] not in allowed or result[1] < 1)}
    assert bad == {}
    assert codes["/swarm.DHT/Find"][0] == grpc.StatusCode.PERMISSION_DENIED
    assert first.gate is not None and first.gate.refused["missing"] >= len(codes) - 1
    assert any("refused caller" in r.message and "(missing)" in r.message for r in caplog.records)
    averager.shutdown()


def test_a_member_refuses_a_callee_that_is_not_one(swarm: Swarm, make_peer: Callable[..., Peer],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    member = swarm.invite()
    outsider = make_peer()  # an open peer: it presents nothing
    assert outsider.dht is not None and outsider.dht.store("bait", 1, time.time() + 60)

    async def call() -> None:
        await member.pool.get(outsider.addrs[0]).info(timeout=5)

    with caplog.at_level(logging.WARNING, logger="swarm.net.membership"), \
            pytest.raises(PermissionDenied, match=r"\(missing\)"):
        member.run(call(), timeout=20)
    assert member.gate is not None and member.gate.refused["missing"] == 1
    assert any("refused callee" in r.message for r in caplog.records)


def test_each_bad_certificate_is_refused_with_its_reason_on_both_sides(swarm: Swarm,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    member = swarm.invite()
    authority, now = swarm.authority, time.time()
    victim = Identity.generate()
    cases: dict[str, tuple[Identity, MembershipCertificate, bytes]] = {}
    thief = Identity.generate()
    stolen = authority.invite(victim.peer_id, ["trainer"], DAY)
    cases["wrong PeerID"] = (thief, stolen, authority.public_key)  # a certificate for another PeerID
    expired_id = Identity.generate()
    cases["expired"] = (expired_id, authority.invite(expired_id.peer_id, ["trainer"], 60, now=now - 3600),
                        authority.public_key)
    foreign_id, foreign = Identity.generate(), Authority.generate()
    cases["wrong authority"] = (foreign_id, foreign.invite(foreign_id.peer_id, ["trainer"], DAY), foreign.public_key)
    forged_id = Identity.generate()
    genuine = authority.invite(forged_id.peer_id, ["trainer"], DAY)
    forged = MembershipCertificate(genuine.authority, genuine.peer_id, ("server", "trainer"), genuine.issued_at,
                                   genuine.expires_at, genuine.serial, genuine.signature)
    cases["forged"] = (forged_id, forged, authority.public_key)
    for reason, (identity, certificate, key) in cases.items():
        policy = CertificatePolicy.__new__(CertificatePolicy)  # the intruder's own copy: it skips its own checks
        policy.authority, policy.certificate, policy.revocations = key, certificate, None
        policy._proof = certificate.encode()
        pool = ChannelPool(identity, gate=MembershipGate(policy))

        async def call(pool: ChannelPool = pool) -> None:
            try:
                await pool.get(member.addrs[0]).info(timeout=5)
            finally:
                await pool.close()

        with caplog.at_level(logging.WARNING), pytest.raises(PermissionDenied) as caught:
            member.run(call(), timeout=20)
        assert f"({reason})" in str(caught.value), (reason, caught.value)
        assert member.gate is not None and member.gate.refused[reason] >= 1, (reason, member.gate.refused)
        callee_side = [r.message for r in caplog.records if "refused caller" in r.message and f"({reason})" in r.message]
        caller_side = [r.message for r in caplog.records if "refused this peer" in r.message and f"({reason})" in r.message]
        assert callee_side and caller_side, reason


def test_a_stolen_certificate_and_identity_file_checks_at_start(swarm: Swarm, make_peer: Callable[..., Peer]) -> None:
    member = swarm.invite()
    assert member.membership is not None
    stolen = MembershipCertificate.decode(member.membership.proof)
    with pytest.raises(ConfigError, match="is for"):
        make_peer(swarm_authority=swarm.authority.public_text, membership=stolen)
    with pytest.raises(ConfigError, match="both"):
        make_peer(swarm_authority=swarm.authority.public_text)


def test_repeated_attempts_from_one_address_are_refused_unread(swarm: Swarm) -> None:
    member = swarm.invite()
    assert member.gate is not None
    limit = member.gate.config.max_refusals

    async def attempts() -> list[str]:
        reasons = []
        for _ in range(limit + 3):
            intruder = Identity.generate()  # a new PeerID each time: nothing cached helps it
            pool = ChannelPool(intruder)
            try:
                await pool.get(member.addrs[0]).info(timeout=5)
            except PermissionDenied as e:
                reasons.append(str(e))
            finally:
                await pool.close()
        return reasons

    reasons = member.run(attempts(), timeout=60)
    assert len(reasons) == limit + 3
    # an attempt may be refused more than once (its Calls stream, then the call on its own): the
    # address is throttled after at most `limit` attempts, and stays so for the window
    assert "(missing)" in reasons[0]
    throttled = [i for i, r in enumerate(reasons) if "too many refused attempts" in r]
    assert throttled and throttled[0] <= limit and throttled == list(range(throttled[0], len(reasons)))
    assert member.gate.refused["too many refused attempts"] >= len(throttled)


def test_a_revoked_member_is_cut_off_within_the_interval(swarm: Swarm) -> None:
    interval = 0.5
    first = swarm.invite(revocation_interval=interval)
    second = swarm.invite(revocation_interval=interval)
    doomed = swarm.invite(revocation_interval=interval)
    assert doomed.dht is not None and doomed.dht.store("before", 1, time.time() + 60)
    assert second.revocations is not None and first.revocations is not None

    async def watched_call() -> None:
        await doomed.pool.get(second.addrs[0]).info(timeout=5)

    doomed.run(watched_call(), timeout=20)  # a member: answered, its channel now open
    revocations = swarm.authority.revoke([doomed.peer_id])
    published = time.monotonic()
    assert first.run(first.revocations.publish(revocations), timeout=20)

    async def wait_applied() -> float:
        await asyncio.wait_for(second.revocations.applied.wait(), 10 * interval + 10)
        return time.monotonic()

    applied = second.run(wait_applied(), timeout=30)
    # the bound: one interval plus one DHT lookup (loopback: well under the lookup timeout)
    assert applied - published < interval + 5.0
    with pytest.raises(PermissionDenied):
        doomed.run(watched_call(), timeout=20)  # the same open channel: refused now
    with pytest.raises(PermissionDenied, match="revoked"):
        async def fresh() -> None:
            await doomed.pool.forget(first.peer_id)
            await doomed.pool.get(first.addrs[0]).info(timeout=5)
        doomed.run(fresh(), timeout=20)
    assert first.dht is not None and first.dht.get("before") is not None  # the others go on


def test_invited_peers_average_as_before(swarm: Swarm) -> None:
    peers = [swarm.invite() for _ in range(3)]
    addrs = [p.addrs[0] for p in peers]
    tensors = [[torch.full((50_000,), float(i))] for i in range(3)]
    averagers = [Averager(p, t, prefix="private", target_group_size=3, initial_group=addrs)
                 for p, t in zip(peers, tensors)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda a: a.step(timeout=30), averagers))
    assert all(len(r.group) == 3 for r in results)
    for t in tensors:
        assert torch.allclose(t[0], torch.full((50_000,), 1.0))
    for a in averagers:
        a.shutdown()


def test_swarm_key_members_talk_and_other_keys_are_refused(tmp_path: Any, make_peer: Callable[..., Peer]) -> None:
    paths = []
    for name in ("ours", "theirs"):
        path = tmp_path / f"{name}.key"
        path.write_text(SwarmKey.generate_text())
        path.chmod(0o600)
        paths.append(str(path))
    first = make_peer(swarm_key=paths[0])
    second = make_peer(swarm_key=paths[0], initial_peers=first.addrs)
    assert second.dht is not None and second.dht.store("k", 1, time.time() + 60)
    assert first.dht is not None and first.dht.get("k") is not None
    with pytest.raises(DHTError, match=r"wrong swarm key"):
        make_peer(swarm_key=paths[1], initial_peers=first.addrs)
    with pytest.raises(ConfigError, match="not both"):
        make_peer(swarm_key=paths[0], swarm_authority=Authority.generate().public_text, membership="x")


def test_membership_rides_in_every_calls_metadata(swarm: Swarm) -> None:
    member = swarm.invite()
    metadata = dict(member.pool.signer.metadata_for(member.peer_id))
    assert member.membership is not None and metadata[METADATA_KEY] == member.membership.proof


def test_roles_are_enforced_where_they_matter(swarm: Swarm) -> None:
    trainer = swarm.invite(("trainer",))
    observer = swarm.invite(("observer",))
    assert trainer.gate is not None
    Averager(trainer, [torch.zeros(10)], prefix="roles", target_group_size=2)  # hosts the averaging service
    refused_before = sum(trainer.gate.refused.values())

    async def call(peer: Peer, target: Peer, method: str) -> None:
        await peer.pool.get(target.addrs[0]).unary(method, b"", None, timeout=5)

    # the callee refuses: averaging is for trainers
    with pytest.raises(PermissionDenied, match="lacks the role archive or trainer"):
        observer.run(call(observer, trainer, "/swarm.Averaging/Join"), timeout=20)
    assert trainer.gate.refused["missing role"] >= 1
    # the caller refuses: experts are called on servers only (nothing is sent to a trainer)
    refused_before = sum(trainer.gate.refused.values())
    with pytest.raises(PermissionDenied, match="lacks the role server"):
        observer.run(call(observer, trainer, "/swarm.moe.Expert/Info"), timeout=20)
    assert sum(trainer.gate.refused.values()) == refused_before


def test_a_relay_reserves_only_for_members(swarm: Swarm, make_peer: Callable[..., Peer]) -> None:
    relay_peer = swarm.invite(("trainer", "relay"), relay="on")
    member = swarm.invite(("trainer",), relay="on")  # asks to relay, but lacks the role
    assert relay_peer.nat is not None and relay_peer.nat.relay is not None
    relay = relay_peer.nat.relay
    assert member.membership is not None

    async def reserve(identity: Identity, proof: bytes, claim: str = "") -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            writer.write(b"RESERVE\n")
            nonce = bytes.fromhex((await reader.readline())[6:].strip().decode())
            signature = identity.sign(reserve_payload(nonce, relay_peer.peer_id))
            tail = f" {proof.hex()}" if proof else ""
            writer.write(f"{claim or identity.peer_id} {signature.hex()}{tail}\n".encode())
            return (await asyncio.wait_for(reader.readline(), 5)).decode()
        finally:
            writer.close()

    stranger = Identity.generate()
    assert relay_peer.run(reserve(stranger, b""), timeout=20).startswith("NO not a member of this private swarm (missing)")
    assert relay.refused["not a member"] == 1
    # a thief with a member's certificate, who cannot sign for its PeerID: refused, counted per address
    thief = relay_peer.run(reserve(stranger, member.membership.proof, claim=member.peer_id), timeout=20)
    assert thief.startswith("NO bad signature")
    assert relay_peer.gate is not None and relay_peer.gate.refused["unproven PeerID"] == 1
    assert relay_peer.run(reserve(member.identity, member.membership.proof), timeout=20).startswith("OK ")
    # a peer without the relay role runs no relay, and NAT'd members choose relays by role
    assert member.nat is not None and member.nat.relay is None


def test_a_list_given_at_start_spreads_and_no_member_goes_back_to_an_older_one(swarm: Swarm) -> None:
    first = swarm.invite(revocation_interval=0.3)
    doomed = Identity.generate().peer_id
    older = swarm.authority.revoke([Identity.generate().peer_id])
    newer = swarm.authority.revoke([doomed], previous=older)
    swarm.invite(revocations=newer)  # stores it in the DHT on its first read
    assert first.revocations is not None

    async def wait_applied() -> None:
        await asyncio.wait_for(first.revocations.applied.wait(), 20)

    first.run(wait_applied(), timeout=30)
    held = first.revocations.policy
    assert held.revocations is not None and held.revocations.number == 2
    # a member that stores the older genuine list (a rollback): far ahead, refused by the DHT; within
    # the limit, stored, then replaced by the next member's read, and applied by nobody
    assert first.dht is not None
    with pytest.raises(ValidationError, match="at most"):
        first.dht.store("_swarm.revocations", older.encode(), time.time() + 3600 * 20)
    assert first.dht.store("_swarm.revocations", older.encode(), time.time() + REVOCATION_TTL)
    first.run(first.revocations.refresh(), timeout=20)
    assert held.revocations.number == 2
    found = first.dht.get("_swarm.revocations", latest=True)  # the refresh stored the newest again
    assert found is not None and RevocationList.decode(found.value, swarm.authority.public_key).number == 2
    with pytest.raises(ValidationError):  # junk under the key: refused by the DHT's validator
        first.dht.store("_swarm.revocations", b"junk", time.time() + 3600 * 20)


def test_invited_peers_train_with_the_optimizer_as_before(swarm: Swarm) -> None:
    config = CollaborationConfig(target_batch_size=32, report_period=0.05, min_refresh_period=0.02,
                                 max_refresh_period=0.2, averaging_timeout=10.0, max_staleness=0)
    torch.manual_seed(0)
    models = [nn.Linear(8, 1) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [Optimizer(swarm.invite(), run_id="private-run", params=m.parameters(),
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1), config=config) for m in models]
    assert all(o.wait_for_peers(2, timeout=20) for o in opts)
    x, y = torch.randn(64, 8), torch.randn(64, 1)

    def train(opt: Optimizer, model: nn.Module) -> None:
        deadline = time.monotonic() + 60
        while opt.epoch < 3 and time.monotonic() < deadline:
            torch.nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
            opt.step(16)
            opt.zero_grad()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(train, opts, models))
    assert all(o.epoch >= 3 for o in opts)
    if opts[0].epoch == opts[1].epoch:  # every round waited for: the members took the same steps
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    for o in opts:
        o.shutdown()


def _connect(port: int, target: str, header: str | None) -> str:
    """A raw CONNECT to a relay, as a stranger's own code would send it; the relay's status line and reason."""
    async def go() -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            extra = f"{MEMBER_HEADER}: {header}\r\n" if header is not None else ""
            writer.write(f"CONNECT {target}:{GRPC_PORT} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            return head.decode()
        finally:
            writer.close()

    return asyncio.run(go())


def test_a_relay_opens_circuits_for_members_only(swarm: Swarm, make_peer: Callable[..., Peer]) -> None:
    relay_peer = swarm.invite(("trainer", "relay"), relay="on")
    natted = swarm.invite(("trainer",), nat=NatConfig(reachability="private", first_reservation_timeout=10.0))
    caller = swarm.invite(("trainer",), relay=False)
    assert relay_peer.nat is not None and relay_peer.nat.relay is not None and natted.gate is not None
    relay = relay_peer.nat.relay
    assert relay.port is not None and Multiaddr.parse(natted.addrs[0]).relay_id == relay_peer.peer_id
    assert caller.membership is not None and natted.membership is not None

    async def info(peer: Peer) -> str:
        return (await peer.pool.get(natted.addrs[0]).info(timeout=10)).peer_id

    assert caller.run(info(caller), timeout=30) == natted.peer_id  # a member: through the relay, as before
    natted_refusals = sum(natted.gate.refused.values())
    thief = Identity.generate()
    stolen = caller.membership.proof  # a member's certificate, seen somewhere
    forged = f"{caller.peer_id} {thief.sign(b'anything').hex()} {stolen.hex()}"  # claims the member's PeerID
    own_key = member_header(thief, stolen, relay_peer.peer_id, natted.peer_id)  # its own PeerID, the member's proof
    other_callee = member_header(caller.identity, stolen, relay_peer.peer_id, relay_peer.peer_id)  # replayed elsewhere
    cases = {None: "(missing)", forged: "(unproven PeerID)", own_key: "(wrong PeerID)",
             other_callee: "(unproven PeerID)", "garbage": "(unproven PeerID)"}
    for header, reason in cases.items():
        answer = _connect(relay.port, natted.peer_id, header)
        assert answer.startswith("HTTP/1.1 403") and reason in answer, (header, answer)
    # a member of another swarm, dialing through the relay with its own, valid-elsewhere proof
    other = Swarm(make_peer).invite(("trainer",), relay=False)
    with pytest.raises(PermissionDenied, match=r"refused a circuit .* \(wrong authority\)"):
        other.run(info(other), timeout=30)  # the relay's reason reaches the caller's code
    assert relay.refused["not a member"] >= len(cases) + 1
    assert relay_peer.gate is not None and relay_peer.gate.refused["wrong authority"] >= 1
    # the reserved member heard of none of it: no circuit offered to it, no handshake with it refused
    assert sum(natted.gate.refused.values()) == natted_refusals
    assert relay.refused["not accepted"] == 0 and relay.refused["no reservation"] == 0
    assert caller.run(info(caller), timeout=30) == natted.peer_id


def _signed_declarations(peer: Peer, uid: str) -> list[DHTRecord]:
    """`peer`'s declarations of `uid`, signed by it, as its DHT would send them (its own checks skipped)."""
    assert peer.dht is not None
    expiration = time.time() + 60
    records = [DHTRecord.create(key, value, expiration, subkey) for key, subkey, value in
               declarations([uid], peer.addrs[0], peer.peer_id)]
    return [dataclasses.replace(r, value=peer.dht.validator.sign_value(r)) for r in records]


def _send(sender: Peer, receiver: Peer, records: list[DHTRecord]) -> list[str]:
    """What `receiver`'s DHT node answers each of `records` sent by `sender` (a reason, or "stored")."""
    assert sender.dht is not None
    node = NodeInfo(node_id_of(receiver.peer_id), receiver.peer_id, receiver.addrs[0])
    found = sender.run(sender.dht.node.protocol.call_store(node, [store_item(r) for r in records]), timeout=30)
    assert found is not None
    return ["stored" if r.status == STORED else r.reason for r in found]


def test_only_servers_declare_experts(swarm: Swarm, caplog: pytest.LogCaptureFixture) -> None:
    server = swarm.invite(("server",))
    trainer = swarm.invite(("trainer",))  # a member, but no server
    client = swarm.invite(("trainer",))
    assert server.dht is not None  # a server declares as before
    assert server.run(declare_experts(server.dht, ["ffn.1.0"], server.addrs[0], time.time() + 60), timeout=30) == 3
    forged = _signed_declarations(trainer, "ffn.0.0")
    # refused where it would be stored: the node knows the sender's certificate (its gate checked it)
    for node in (server, client):
        answers = _send(trainer, node, forged)
        assert len(answers) == 3 and all("lacks the server role" in a for a in answers), answers
    assert trainer.dht is not None
    with pytest.raises(ValidationError, match="lacks the server role"):  # and by its own DHT, before sending
        trainer.dht.store("ffn.0.0", trainer.addrs[0], time.time() + 60, subkey=f"[owner:{trainer.peer_id}]")
    # a member that keeps them anyway (it lies, or colludes) serves them to lookups: a client that
    # knows the trainer's roles (its gate checked its certificate) drops them when it resolves experts
    for holder in (server, swarm.invite(("trainer",))):
        assert holder.dht is not None
        for r in forged:
            assert holder.dht.node.storage.store(r.key, r.value, r.expiration_time, r.subkey, r.raw_key,
                                                 writer=trainer.peer_id)
    assert client.dht is not None and client.gate is not None and client.gate.roles_of(trainer.peer_id) == {"trainer"}
    source = DHTExpertSource(client.dht)
    with caplog.at_level(logging.DEBUG, logger="swarm.dht.retrieval"):
        experts = client.run(source.get_experts(["ffn.0.0", "ffn.1.0"]), timeout=30)
    assert experts == {"ffn.1.0": server.addrs[0]}
    assert any("dropped" in r.message and "lacks the server role" in r.message for r in caplog.records)
    assert client.run(source.get_successors(["ffn."]), timeout=30) == {"ffn.": {1: ("ffn.1.0", server.addrs[0])}}
