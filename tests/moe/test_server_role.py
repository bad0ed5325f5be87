"""The private swarm's rule that only servers declare experts, without sockets: which records are
declarations, and whose are refused (`swarm.moe.server_role`)."""

from __future__ import annotations

import pytest

from swarm.core.errors import ValidationError
from swarm.core.identity import Identity
from swarm.dht.validation import DHTRecord
from swarm.moe.dht_declare import declarations
from swarm.moe.server_role import ServerRoleValidator

TRAINER, SERVER, STRANGER = (Identity.generate().peer_id for _ in range(3))


class Roles:
    """What a gate knows: a trainer and a server; nothing of anyone else."""

    def roles_of(self, peer_id: str) -> frozenset[str] | None:
        return {TRAINER: frozenset({"trainer"}), SERVER: frozenset({"server"})}.get(peer_id)


def _records(owner: str) -> list[DHTRecord]:
    return [DHTRecord.create(key, value, 1e9, subkey)
            for key, subkey, value in declarations(["ffn.3.1"], f"/ip4/10.0.0.1/tcp/1/p2p/{owner}", owner)]


def test_a_declaration_by_a_member_without_the_server_role_is_refused_with_the_reason() -> None:
    validator = ServerRoleValidator(Roles())
    records = _records(TRAINER)
    assert [r.raw_key is not None for r in records] == [True] * 3  # "ffn.", "ffn.3.", "ffn.3.1"
    for record in records:
        with pytest.raises(ValidationError, match=r"lacks the server role .* \(its roles: trainer\)"):
            validator.validate(record)
    for owner in (SERVER, STRANGER):  # a server's, and one by a peer not known here (checked at call time)
        for record in _records(owner):
            validator.validate(record)


def test_other_records_a_member_owns_are_not_declarations() -> None:
    validator = ServerRoleValidator(Roles())
    marker = f"[owner:{TRAINER}]"
    for key, subkey in (("run.progress", marker), ("avg.group.d0.3", marker), ("avg.group.0", marker),
                        ("avg.roll.1", marker), ("ffn.3.1", None), ("ffn.", "3"), (f"ffn.3.1{marker}", None)):
        validator.validate(DHTRecord.create(key, "x", 1e9, subkey))
