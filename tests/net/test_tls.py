"""TLS bound to PeerIDs (docs/security.md): what an attacker on or off the path can no longer do.

Real servers and sockets throughout; the victim of the relay attack and the peers of the
--insecure test are real `swarm-peer` processes.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from procs import PeerProcess
from proxy import LoopbackProxy, RecordFlipper

from swarm.core.errors import PeerUnreachable, Unauthenticated
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.net import tls
from swarm.net.channels import HANDSHAKE, INFO, ChannelConfig, ChannelPool
from swarm.net.server import RPCServer, ServerConfig
from swarm.peer import Peer
from swarm.proto import peer_pb2

LOCAL = ("--listen", "/ip4/127.0.0.1/tcp/0")
APPLY = "/test.Tls/Apply"


def _status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    return subprocess.run([sys.executable, "-m", "swarm", "status", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


# -- unit: certificates ------------------------------------------------------------------------

def test_a_certificate_proves_its_issuers_peer_id_and_nothing_else():
    victim, attacker = Identity.generate(), Identity.generate()
    der = x509.load_pem_x509_certificate(tls.PeerCertificate.issue(victim).certificate_pem).public_bytes(
        serialization.Encoding.DER)
    assert tls.read_peer_certificate(der) == victim.peer_id
    forged = x509.load_pem_x509_certificate(_forged_certificate(victim, attacker).certificate_pem)
    with pytest.raises(Unauthenticated, match="does not prove"):
        tls.read_peer_certificate(forged.public_bytes(serialization.Encoding.DER))
    with pytest.raises(Unauthenticated, match="not an Ed25519 PeerID"):
        tls.trust_anchor("QmNotAnEd25519PeerIdAtAll")


def _forged_certificate(victim: Identity, attacker: Identity) -> tls.PeerCertificate:
    """What an attacker can make: a certificate naming the victim (subject, issuer) and carrying the
    libp2p extension, signed with the attacker's key because the victim's is out of reach."""
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, victim.peer_id)]))
        .issuer_name(tls.anchor_name(victim.public_key))
        .public_key(key.public_key()).serial_number(7)
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(tls.SERVER_NAME)]), critical=False)
        .add_extension(x509.UnrecognizedExtension(tls.LIBP2P_EXTENSION_OID, tls.signed_key(attacker, spki)),
                       critical=False)
        .sign(attacker.private_key, None)
    )
    return tls.PeerCertificate(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        certificate.public_bytes(serialization.Encoding.PEM))


# -- impostors ---------------------------------------------------------------------------------

class _Impostor:
    """An attacker's server (its own key) that records every call reaching it."""

    def __init__(self, identity: Identity, certificate: tls.PeerCertificate | None = None) -> None:
        self.server = RPCServer(identity, certificate=certificate)
        self.calls: list[str] = []
        self.tickets: list[bytes] = []

    def record(self, path: str, ctx) -> None:
        self.calls.append(path)
        for key, value in ctx.grpc_context.invocation_metadata() if ctx.grpc_context else ():
            if key == "swarm-ticket-bin":
                self.tickets.append(value)


def test_prove_completes_only_for_the_peer_id_expected_there(make_peer):
    """`tls.prove` (a dial-back's check): the handshake completes only when the certificate at the
    address is signed by the expected PeerID's key; a probe names whoever is there."""
    a = make_peer()
    addr = Multiaddr.parse(a.addrs[0])
    stranger = Identity.generate()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: refused

    async def go():
        return (await tls.prove(addr.host, addr.port, a.peer_id, 5.0),
                await tls.prove(addr.host, addr.port, stranger.peer_id, 5.0),
                await tls.prove(addr.host, addr.port, "QmNotAnEd25519PeerIdAtAll", 5.0),
                await tls.prove("127.0.0.1", closed.getsockname()[1], a.peer_id, 5.0),
                await tls.probe(addr.host, addr.port, 5.0))

    try:
        proved, other, malformed, refused, probed = a.run(go())
    finally:
        closed.close()
    assert proved == tls.Probe(True, True, a.peer_id)
    assert not other.peer_id and other.reachable and f"does not prove {stranger.peer_id}" in other.error
    assert not malformed.reachable and "Ed25519" in malformed.error
    assert not refused.reachable and "ConnectionRefusedError" in refused.error
    assert probed.peer_id == a.peer_id  # the unverified probe reads the same PeerID out of the certificate


def test_a_peer_with_another_key_cannot_pass_for_the_victim(make_peer):
    client = make_peer(client_mode=True)
    victim, attacker = Identity.generate(), Identity.generate()
    impostor = _Impostor(attacker, _forged_certificate(victim, attacker))

    async def forged_info(request, ctx):
        impostor.record(INFO, ctx)
        return peer_pb2.PeerInfo(peer_id=victim.peer_id, role="forged")

    impostor.server.add_unary(INFO, forged_info, peer_pb2.InfoRequest, authenticated=False)

    async def attempt():
        port = await impostor.server.start(Multiaddr.parse("/ip4/127.0.0.1/tcp/0"))
        try:
            await client.pool.get(f"/ip4/127.0.0.1/tcp/{port}/p2p/{victim.peer_id}").info()
        finally:
            await impostor.server.stop(0)

    with pytest.raises(Unauthenticated, match=f"is not {victim.peer_id}"):
        client.run(attempt())
    assert impostor.calls == [] and impostor.tickets == []  # the handshake never completed


@pytest.mark.timeout(90)
def test_the_handshake_relay_attack_fails(make_peer):
    """M relays only Handshake to the real S and answers the rest itself (a relaying man in the middle)."""
    client = make_peer(client_mode=True)
    with PeerProcess(*LOCAL) as s:
        s_addr = Multiaddr.parse(s.addrs[0])
        m = _Impostor(Identity.generate())
        relay = ChannelPool(m.server.identity)

        async def relay_handshake(request, ctx):
            m.record(HANDSHAKE, ctx)
            return await relay.get(s_addr)._raw_unary(HANDSHAKE, request, peer_pb2.HandshakeResponse, 5.0, ())

        async def forged_info(request, ctx):
            m.record(INFO, ctx)
            return peer_pb2.PeerInfo(peer_id=s_addr.peer_id, role="forged by M")

        m.server.add_unary(HANDSHAKE, relay_handshake, peer_pb2.HandshakeRequest, authenticated=False)
        m.server.add_unary(INFO, forged_info, peer_pb2.InfoRequest, authenticated=False)

        async def dial_m_as_s():
            port = await m.server.start(Multiaddr.parse("/ip4/127.0.0.1/tcp/0"))
            try:
                await client.pool.get(f"/ip4/127.0.0.1/tcp/{port}/p2p/{s_addr.peer_id}").info()
            finally:
                await m.server.stop(0)
                await relay.close()

        with pytest.raises(Unauthenticated, match=f"is not {s_addr.peer_id}.*proves {m.server.identity.peer_id}"):
            client.run(dial_m_as_s())
        # M got no call at all, so no ticket of the client's to replay to S
        assert m.calls == [] and m.tickets == []
        # and S, asked directly over TLS, is the real one and knows nothing of the client
        result = _status("--initial-peers", s.addrs[0], "--json")
        assert result.returncode == 0, result.stderr
        assert client.peer_id not in result.stdout and "forged" not in result.stdout


# -- an attacker on the path -------------------------------------------------------------------

def test_a_proxy_that_flips_bytes_makes_the_call_fail_and_nothing_is_applied(make_peer):
    server, client = make_peer(), make_peer(client_mode=True)
    applied: list[int] = []

    async def apply(request: bytes, ctx):
        applied.append(len(request))
        return b"applied"

    server.server.add_unary(APPLY, apply)
    port = int(server.addrs[0].split("/")[4])
    flipper = RecordFlipper(min_length=8192)
    proxy = LoopbackProxy(("127.0.0.1", port), tamper=flipper)
    try:
        channel = client.pool.get(f"/ip4/127.0.0.1/tcp/{proxy.port}/p2p/{server.peer_id}")
        assert client.run(channel.unary(APPLY, b"small")) == b"applied"  # small records pass untouched
        with pytest.raises(PeerUnreachable):
            client.run(channel.unary(APPLY, os.urandom(256 << 10), timeout=10))
        assert flipper.flipped >= 1
        assert applied == [5]  # only the untampered call reached the handler
    finally:
        proxy.close()


def _free_port_pair(host_a: str, host_b: str) -> tuple[LoopbackProxy, int]:
    """A proxy listening on host_b at a port that is then free on host_a too (the peer's)."""
    proxy = LoopbackProxy(None, host_b)
    return proxy, proxy.port


@pytest.mark.timeout(90)
@pytest.mark.parametrize("insecure", [False, True], ids=["tls", "insecure-control"])
def test_a_passive_capture_of_an_averaging_round_holds_no_tensor_bytes(insecure):
    """Two peers average a known tensor with every byte (gRPC and bulk ports) through recording
    proxies; over TLS none of its bytes appear. The insecure run checks the test can see them."""
    from swarm.averaging import Averager

    peers, proxies = [], []
    try:
        for real, public in (("127.0.0.2", "127.0.0.3"), ("127.0.0.4", "127.0.0.5")):
            grpc_proxy, grpc_port = _free_port_pair(real, public)
            bulk_proxy, bulk_port = _free_port_pair(real, public)
            grpc_proxy.target, bulk_proxy.target = (real, grpc_port), (real, bulk_port)
            proxies += [grpc_proxy, bulk_proxy]
            peers.append(Peer(listen=f"/ip4/{real}/tcp/{grpc_port}", announce=[f"/ip4/{public}/tcp/{grpc_port}"],
                              server_config=ServerConfig(bulk_port=bulk_port), insecure=insecure))
        known = torch.arange(1 << 18, dtype=torch.float32) * 3.14159 + 1234.5
        tensors = [[known.clone()], [known.clone() * -1.0]]
        addrs = [p.addrs[0] for p in peers]
        averagers = [Averager(p, t, prefix="cap", target_group_size=2, initial_group=addrs)
                     for p, t in zip(peers, tensors)]

        async def both():
            import asyncio
            return await asyncio.gather(*(a.astep(timeout=30) for a in averagers))

        peers[0].run(both(), timeout=60)
        assert torch.allclose(tensors[0][0], torch.zeros_like(known), atol=1e-3)
        captured = b"".join(bytes(p.up) + bytes(p.down) for p in proxies)
        assert len(captured) > known.numel() * 4  # the round's traffic did pass the proxies
        raw = known.numpy().tobytes()
        windows = [raw[i:i + 32] for i in range(0, len(raw) - 32, 4096)]
        ticket = peers[1].pool.signer.metadata_for(peers[0].peer_id)[0][1]
        found = sum(w in captured for w in windows)
        if insecure:
            assert found > len(windows) // 4  # plaintext: the tensor is there for anyone to read
        else:
            assert found == 0 and ticket not in captured and peers[1].identity.public_key not in captured
    finally:
        for p in peers:
            p.shutdown()
        for proxy in proxies:
            proxy.close()


# -- both sides must agree on --insecure -------------------------------------------------------

@pytest.mark.timeout(120)
def test_an_insecure_peer_and_a_default_peer_refuse_each_other_naming_the_flag():
    with PeerProcess(*LOCAL) as secure, PeerProcess(*LOCAL, "--insecure") as plain:
        refused = _status("--initial-peers", plain.addrs[0])
        assert refused.returncode == 1 and "--insecure" in refused.stdout and "does not speak TLS" in refused.stdout
        refused = _status("--insecure", "--initial-peers", secure.addrs[0])
        assert refused.returncode == 1 and "requires TLS" in refused.stdout and "--insecure" in refused.stdout
        # each kind still talks to its own kind, and status says which connections are encrypted
        ok = _status("--insecure", "--initial-peers", plain.addrs[0])
        assert ok.returncode == 0 and "PLAINTEXT (--insecure)" in ok.stdout, ok.stdout + ok.stderr
        ok = _status("--initial-peers", secure.addrs[0])
        assert ok.returncode == 0 and "tls1.3" in ok.stdout, ok.stdout + ok.stderr
        # a daemon started the other way cannot join: it says why, naming the flag
        with PeerProcess(*LOCAL, "--insecure", "--initial-peers", secure.addrs[0], expect_addrs=0) as joiner:
            code = joiner.wait(60)
            err = joiner.stderr_text()
        assert code != 0 and "--insecure" in err, err


def test_mismatched_tls_settings_in_one_peer_are_refused():
    from swarm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="tls"):
        Peer(server_config=ServerConfig(tls=False), channel_config=ChannelConfig(tls=True), start=False)


@pytest.mark.parametrize("memory_file", [True, False], ids=["memfd", "temporary-directory"])
def test_the_bulk_listeners_context_presents_the_peers_certificate(monkeypatch, tmp_path, memory_file):
    """`load_cert_chain` reads files: the key goes through a memfd, or (no memfd) a private
    temporary directory that is gone afterwards; either way a client that trusts only this
    PeerID completes a TLS 1.3 handshake with it."""
    identity = Identity.generate()
    if not memory_file:
        monkeypatch.setattr(tls, "_memory_file", lambda: None)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    context = tls.server_context(tls.PeerCertificate.issue(identity))
    assert list(tmp_path.iterdir()) == []

    async def handshake() -> tuple[str, bytes]:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
        async with server:
            port = server.sockets[0].getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls.client_context(identity.peer_id),
                                                      server_hostname=tls.SERVER_NAME)
            sslobj = writer.get_extra_info("ssl_object")
            result = sslobj.version(), sslobj.getpeercert(binary_form=True)
            writer.close()
            return result

    version, presented = asyncio.run(asyncio.wait_for(handshake(), 10))
    assert version == "TLSv1.3" and presented == context.certificate_der
