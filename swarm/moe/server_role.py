"""In a private swarm, only peers with the `server` role declare experts (docs/security.md,
"Private swarms").

`ServerRoleValidator` is one more DHT record validator. It recognizes an expert declaration by
its shape (`swarm.moe.dht_declare`: a grid prefix or an expert UID as key, the declaring server's
owner marker as subkey) and refuses it when the declaring peer is known here not to hold the
server role. A node knows the roles of every member that called it (the gate checked its
certificate), so the node a declaration is sent to refuses it; a client that resolves experts
drops declarations by members it knows to lack the role; and a declaration whose owner this
peer never met (a replica) passes here, since the callee's role is checked again before any
expert is called (`swarm.peer.CALLEE_ROLES`).
"""

from __future__ import annotations

from typing import Protocol

from swarm.core.errors import ValidationError
from swarm.dht.keys import deserialize_key
from swarm.dht.validation import DHTRecord, RecordValidator, record_owner
from swarm.moe.uids import is_valid_prefix, is_valid_uid

__all__ = ["SERVER_ROLE", "KnownRoles", "ServerRoleValidator"]

SERVER_ROLE = "server"


class KnownRoles(Protocol):
    """Who holds which roles, as far as this peer knows (`swarm.net.membership.MembershipGate`)."""

    def roles_of(self, peer_id: str) -> frozenset[str] | None:
        """The roles of `peer_id`; None for a peer not known here."""
        ...


class ServerRoleValidator(RecordValidator):
    """Refuses expert declarations by peers known to lack the server role (see the module docstring)."""

    priority = 4

    def __init__(self, roles: KnownRoles) -> None:
        self.roles = roles

    def validate(self, record: DHTRecord) -> None:
        if record.raw_key is None or not record.subkey:
            return
        try:
            key = deserialize_key(record.raw_key)
            owner = record_owner(record)
        except (ValueError, TypeError, ValidationError):
            return  # not a declaration's shape; other validators judge it
        if owner is None or not isinstance(key, str) or not (is_valid_uid(key) or is_valid_prefix(key)):
            return
        roles = self.roles.roles_of(owner)
        if roles is not None and SERVER_ROLE not in roles:
            raise ValidationError(f"{owner} lacks the server role in this private swarm, so it cannot declare "
                                  f"experts (its roles: {', '.join(sorted(roles))})")
