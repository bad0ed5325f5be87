"""`swarm-peer authority init`, `invite`, `revoke` and `swarm-key`: the organizer's commands for a
private swarm (docs/security.md, "Private swarms"). None of them touches the network.

    swarm-peer authority init --out authority.key      # prints the public key members start with
    swarm-peer invite --authority-key authority.key --peer-id 12D3KooW... --expires 30d \\
        --role trainer --out member.cert
    swarm-peer revoke --authority-key authority.key --peer-id 12D3KooW... --out revoked.list
    swarm-peer swarm-key --out swarm.key                # the small-group mode: one shared key
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TypedDict

from swarm.cli.config import HelpFormatter, PeerOptions
from swarm.core.errors import SwarmError
from swarm.core.identity import IdentityFile
from swarm.core.membership import ROLES, Authority, RevocationList, SwarmKey, parse_duration

COMMANDS = ("authority", "invite", "revoke", "swarm-key")


def _write_private(path: str, text: str | bytes) -> None:
    """A new file, mode 0600; an existing one is never overwritten."""
    data = text.encode() if isinstance(text, str) else text
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmError(f"{path} exists: choose another --out (nothing is overwritten)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-peer", formatter_class=HelpFormatter,
                                     description="A private swarm's authority, invitations and revocations.")
    commands = parser.add_subparsers(dest="command", required=True)
    authority = commands.add_parser("authority", help="the authority key (keep it offline)")
    authority_commands = authority.add_subparsers(dest="action", required=True)
    init = authority_commands.add_parser("init", help="make a new authority key; prints its public key")
    init.add_argument("--out", default="authority.key", help="where to write the key (0600; default authority.key)")
    show = authority_commands.add_parser("show", help="print an authority key's public key")
    show.add_argument("--authority-key", default="authority.key", help="the key file (default authority.key)")

    invite = commands.add_parser("invite", help="a membership certificate for one PeerID")
    invite.add_argument("--authority-key", default="authority.key", help="the authority key file")
    who = invite.add_mutually_exclusive_group(required=True)
    who.add_argument("--peer-id", help="the invited peer's PeerID (12D3KooW…)")
    who.add_argument("--identity", help="or its identity file (created, 0600, if missing)")
    invite.add_argument("--expires", default="30d", help="validity, e.g. 30d, 12h (default 30d)")
    invite.add_argument("--role", action="append", choices=ROLES,
                        help=f"a role (repeatable): {', '.join(ROLES)}; default trainer")
    invite.add_argument("--out", help="write the certificate here (0600) instead of printing it")

    revoke = commands.add_parser("revoke", help="a revocation list (spreads through the DHT once a member loads it)")
    revoke.add_argument("--authority-key", default="authority.key", help="the authority key file")
    revoke.add_argument("--peer-id", action="append", default=[], help="a PeerID to revoke (repeatable)")
    revoke.add_argument("--previous", help="the last list: its revocations are kept and the number goes up")
    revoke.add_argument("--out", required=True, help="where to write the list")

    key = commands.add_parser("swarm-key", help="a pre-shared swarm key (the small-group mode)")
    key.add_argument("--out", default="swarm.key", help="where to write the key (0600; default swarm.key)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    try:
        return _run(args)
    except (SwarmError, ValueError) as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "authority":
        if args.action == "init":
            authority = Authority.generate()
            authority.save(args.out)
            print(authority.public_text)
            print(f"# the authority key is in {args.out}: keep it offline; members start with "
                  f"--swarm-authority {authority.public_text}", file=sys.stderr)
        else:
            print(Authority.load(args.authority_key).public_text)
        return 0
    if args.command == "invite":
        authority = Authority.load(args.authority_key)
        if args.identity:
            identity_file = IdentityFile(args.identity)
            peer_id = identity_file.load_or_create().peer_id
            identity_file.release()
        else:
            peer_id = args.peer_id
        certificate = authority.invite(peer_id, args.role or ["trainer"], parse_duration(args.expires))
        if args.out:
            _write_private(args.out, certificate.to_text() + "\n")
            print(f"# {peer_id} invited as {', '.join(certificate.roles)} until the expiry; "
                  f"start it with --membership {args.out}", file=sys.stderr)
        else:
            print(certificate.to_text())
        return 0
    if args.command == "revoke":
        authority = Authority.load(args.authority_key)
        previous = RevocationList.load(args.previous, authority.public_key) if args.previous else None
        revocations = authority.revoke(args.peer_id, previous=previous)
        _write_private(args.out, revocations.encode())
        print(f"# revocation list {revocations.number} ({len(revocations.peer_ids)} PeerIDs) in {args.out}: "
              f"start any member with --revocations {args.out} and the DHT spreads it", file=sys.stderr)
        return 0
    _write_private(args.out, SwarmKey.generate_text())
    print(f"# swarm key in {args.out}: give it (privately) to every member; start them with --swarm-key",
          file=sys.stderr)
    return 0


class PrivatePeerArguments(TypedDict):
    """The `swarm.Peer` arguments of a private swarm, as the daemon's options give them."""

    swarm_authority: str | None
    membership: str | None
    swarm_key: str | None
    revocations: str | None


def peer_arguments(options: PeerOptions) -> PrivatePeerArguments:
    """The `swarm.Peer` arguments of the daemon's private-swarm options."""
    return {"swarm_authority": options.swarm_authority, "membership": options.membership,
            "swarm_key": options.swarm_key, "revocations": options.revocations}
