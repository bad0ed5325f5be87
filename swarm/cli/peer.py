"""`swarm-peer`: the daemon a volunteer runs (docs/operations.md).

On ready it prints each reachable multiaddr on its own stdout line and keeps serving.
SIGINT/SIGTERM stop it cleanly (exit 0; 1 if the experts' last checkpoint could not be saved);
a second signal exits at once. Bad options, identity files or checkpoint directories: exit 2.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarm.cli.config import PeerOptions, build_parser, resolve
from swarm.cli.private import COMMANDS as PRIVATE_COMMANDS
from swarm.cli.private import peer_arguments as private_peer_arguments
from swarm.core.errors import SwarmError
from swarm.core.signals import handle_stop_signals

if TYPE_CHECKING:
    from swarm.moe.server.expert_server import ExpertServer
    from swarm.peer import Peer

logger = logging.getLogger("swarm.cli")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if level.upper() != "DEBUG":
        logging.getLogger("asyncio").setLevel(logging.ERROR)


def _attach_services(peer: Peer, options: PeerOptions) -> ExpertServer | None:
    """Starts what the options ask for beyond the bare peer (experts, metrics); the expert server, if any."""
    server = None
    if options.experts:
        from swarm.moe.server.cli import serve_experts  # imports torch only when experts are served

        server = serve_experts(peer, options)
    if options.metrics_port is not None:
        from swarm.cli.metrics import serve_metrics

        serve_metrics(peer, options.metrics_port)
    if options.dashboard_port is not None:
        from swarm.cli.dashboard import attach_dashboard

        attach_dashboard(peer, options)
    return server


def _unsaved(server: ExpertServer | None) -> str | None:
    """Why the expert server's last checkpoint failed, if it did (the trained updates are lost)."""
    saver = server.checkpoints if server is not None else None
    error = saver.last_error if saver is not None else None
    return None if error is None else str(error)


def run_daemon(options: PeerOptions) -> int:
    from swarm.net.nat import NatConfig
    from swarm.net.server import ServerConfig
    from swarm.peer import Peer

    stop = threading.Event()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            os._exit(128 + signum)
        logger.info("received %s, shutting down (send it again to exit at once)", signal.Signals(signum).name)
        stop.set()

    handle_stop_signals(on_signal)

    peer = Peer(
        initial_peers=options.initial_peers,
        listen=options.listen,
        identity_path=options.identity,
        client_mode=options.client_mode,
        announce=options.announce,
        role="expert-server" if options.experts else "peer",
        server_config=ServerConfig(bulk=options.bulk_port != "off",
                                   bulk_port=int(options.bulk_port) if options.bulk_port not in (None, "off") else 0),
        insecure=options.insecure,
        nat=NatConfig(reachability=options.reachability, relay=options.relay, relay_port=options.relay_port),
        **private_peer_arguments(options),
    )
    server: ExpertServer | None = None
    archive_stop = threading.Event()
    try:
        server = _attach_services(peer, options)
        if options.archive is not None:  # an archiver: keeps the run's state on disk (swarm/optim/archiver.py)
            from swarm.optim.archiver import Archiver, ArchiverConfig

            Archiver(peer, ArchiverConfig(options.archive, options.run or "",
                                          float(options.archive_every or 300))).start(archive_stop)
        for addr in peer.addrs:
            print(addr, flush=True)
        if options.client_mode:
            logger.info("client mode: peer %s dials out only", peer.peer_id)
        elif peer.nat is not None:
            logger.info("reachability: %s", peer.nat.plan())
        if options.insecure:
            logger.warning("--insecure: connections are plaintext (readable and forgeable on the path); "
                           "only peers started with --insecure can talk to this one")
        while not stop.wait(1.0):
            pass
    finally:
        archive_stop.set()
        peer.shutdown()
    unsaved = _unsaved(server)
    if unsaved is not None:
        logger.error("stopped, but the experts' last checkpoint failed, so trained updates are lost: %s", unsaved)
        print(f"swarm-peer: error: the last checkpoint failed: {unsaved}", file=sys.stderr)
        return 1
    logger.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "status":
        from swarm.cli.status import main as status_main

        return status_main(argv[1:])
    if argv and argv[0] == "dashboard":
        from swarm.cli.dashboard import main as dashboard_main

        return dashboard_main(argv[1:])
    if argv and argv[0] in PRIVATE_COMMANDS:  # a private swarm's authority, invitations, revocations
        from swarm.cli.private import main as private_main

        return private_main(argv)
    if argv and argv[0] == "export":  # a model's parameters out of a checkpoint or a live run
        from swarm.cli.export import main as export_main

        return export_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        options = resolve(args)
        _setup_logging(options.log_level)
        return run_daemon(options)
    except SwarmError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
