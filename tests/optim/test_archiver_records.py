"""What a trainer takes from archivers' DHT announcements, without sockets: a record is used only
when well formed and pointing at its own signer, and `resume_from` names archivers by PeerID
(a directory that exists always wins)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.core.identity import Identity
from swarm.optim.archiver import MAX_ANNOUNCED_EPOCHS, ArchiverAnnouncement, trusted_archivers

ALICE = Identity.generate().peer_id
BOB = Identity.generate().peer_id
ADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{ALICE}"


def test_a_well_formed_announcement_lists_its_epochs_newest_first() -> None:
    found = ArchiverAnnouncement.from_record(ALICE, {"addr": ADDR, "epochs": [3, 9, 6]})
    assert found == ArchiverAnnouncement(ALICE, ADDR, (9, 6, 3)) and found.newest == 9


@pytest.mark.parametrize("value, why", [
    ({"addr": f"/ip4/127.0.0.1/tcp/4001/p2p/{BOB}", "epochs": [1]}, "an address of another PeerID than its signer"),
    ({"addr": "/ip4/127.0.0.1/tcp/4001", "epochs": [1]}, "an address without a PeerID"),
    ({"addr": ADDR, "epochs": []}, "no epochs"),
    ({"addr": ADDR, "epochs": [-1]}, "a negative epoch"),
    ({"addr": ADDR, "epochs": [True]}, "a boolean for an epoch"),
    ({"addr": ADDR, "epochs": [1.5]}, "a float for an epoch"),
    ({"addr": ADDR, "epochs": list(range(MAX_ANNOUNCED_EPOCHS + 1))}, "too many epochs"),
    ({"addr": ADDR}, "no epochs field"),
    ([ADDR, 1], "not a mapping"),
])
def test_a_malformed_announcement_is_skipped(value: object, why: str) -> None:
    assert ArchiverAnnouncement.from_record(ALICE, value) is None, why


def test_resume_from_names_archivers_by_peer_id_and_a_directory_wins(tmp_path: Path) -> None:
    assert trusted_archivers(ALICE) == (ALICE,)
    assert trusted_archivers(f"{ALICE}, {BOB}") == (ALICE, BOB)
    assert trusted_archivers(f"{ALICE},not-a-peer-id") is None  # a directory's name, then
    assert trusted_archivers(str(tmp_path)) is None
    (tmp_path / ALICE).mkdir()
    assert trusted_archivers(str(tmp_path / ALICE)) is None
