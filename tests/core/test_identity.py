"""Identities: PeerIDs as libp2p prints them, identity files, locking."""

import os
import stat
import subprocess
import sys

import pytest

from swarm.core.errors import IdentityError
from swarm.core.identity import (
    Identity,
    IdentityFile,
    peer_id_to_public_key,
    public_key_to_peer_id,
    verify,
)

# Produced by py-libp2p 0.8.1 for Ed25519PrivateKey.from_bytes(bytes(range(32))):
# ID.from_pubkey(key.get_public_key()).to_base58() and key.get_public_key().serialize().hex()
LIBP2P_PEER_ID = "12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"
LIBP2P_PUBKEY_PROTO = "0801122003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"


def test_peer_id_matches_libp2p_for_the_same_key():
    identity = Identity.from_seed(bytes(range(32)))
    assert identity.peer_id == LIBP2P_PEER_ID
    assert identity.public_key.hex() == LIBP2P_PUBKEY_PROTO[8:]
    assert peer_id_to_public_key(LIBP2P_PEER_ID) == identity.public_key


def test_peer_id_matches_installed_py_libp2p_when_available():
    pytest.importorskip("libp2p", reason="py-libp2p not installed; the fixed vector above covers it")
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.peer.id import ID

    for seed in (bytes(32), os.urandom(32)):
        theirs = ID.from_pubkey(Ed25519PrivateKey.from_bytes(seed).get_public_key()).to_base58()
        assert Identity.from_seed(seed).peer_id == theirs


def test_private_key_round_trip_in_go_and_py_libp2p_forms():
    identity = Identity.generate()
    data = identity.private_bytes()
    assert data[:4] == bytes([0x08, 0x01, 0x12, 0x40]) and len(data) == 68
    assert Identity.from_private_bytes(data).peer_id == identity.peer_id
    short_form = bytes([0x08, 0x01, 0x12, 0x20]) + data[4:36]  # py-libp2p writes the seed only
    assert Identity.from_private_bytes(short_form).peer_id == identity.peer_id


def test_signatures_verify_only_for_the_signer_and_the_data():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"hello")
    assert verify(a.peer_id, b"hello", sig)
    assert not verify(a.peer_id, b"hellO", sig)
    assert not verify(b.peer_id, b"hello", sig)
    assert not verify("not-a-peer-id", b"hello", sig)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not a libp2p private key"),
        (b"garbage garbage garbage", "not a libp2p private key"),
        (bytes([0x08, 0x02, 0x12, 0x20]) + bytes(32), "unsupported libp2p key type 2"),
        (bytes([0x08, 0x01, 0x12, 0x40]) + bytes(10), "corrupt"),
        (bytes([0x08, 0x01, 0x12, 0x40]) + bytes(64), "public half does not match"),
    ],
)
def test_bad_private_keys_are_refused_clearly(data, message):
    with pytest.raises(IdentityError, match=message):
        Identity.from_private_bytes(data)


def test_non_ed25519_peer_ids_are_refused():
    with pytest.raises(IdentityError):
        peer_id_to_public_key("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # an RSA (sha256) PeerID
    assert public_key_to_peer_id(bytes(32)).startswith("12D3KooW")


def test_identity_file_is_created_private_and_reloaded(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    first = IdentityFile(path)
    identity = first.load_or_create()
    first.release()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = IdentityFile(path)
    assert second.load_or_create().peer_id == identity.peer_id
    second.release()


def test_corrupt_identity_file_is_a_clear_error(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    with pytest.raises(IdentityError, match="is not a swarm/libp2p Ed25519 key"):
        IdentityFile(path).load_or_create()
    # a failed load leaves the file unlocked and untouched
    assert path.read_bytes().startswith(b"-----BEGIN")
    with pytest.raises(IdentityError):
        IdentityFile(path).load_or_create()


def test_identity_file_held_by_another_process_is_refused(tmp_path):
    path = tmp_path / "peer.key"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         ("import sys; from swarm.core.identity import IdentityFile; IdentityFile(sys.argv[1]).load_or_create();"
          "print('held', flush=True); sys.stdin.read()"), str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(IdentityError, match=f"in use by another running peer \\(pid {holder.pid}\\)"):
            IdentityFile(path).load_or_create()
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the lock when the holder died (even by SIGKILL)
    again = IdentityFile(path)
    again.load_or_create()
    again.release()
