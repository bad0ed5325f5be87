"""The dashboard from the command line: `swarm-peer --dashboard-port N` on any daemon, and
`swarm-peer dashboard`, a process that joins in client mode only to serve the page.

    swarm-peer dashboard --initial-peers MADDR... [--port N] [--dashboard-host ADDR]
                         [--dashboard-run RUN_ID]... [--dashboard-experts PREFIX]... [--insecure]
                         [--identity FILE --swarm-authority KEY --membership FILE | --swarm-key FILE]
                         [--dashboard-public]

Prints the page's URL on stdout once it serves (in a private swarm, with the token a browser
must present: `swarm.dashboard.access`), then keeps serving until SIGINT/SIGTERM (exit 0).
Exit status 2 on bad options, a port that cannot be bound, or a missing `dashboard` extra.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence

from swarm.cli.config import PeerOptions, add_dashboard_arguments, add_private_arguments
from swarm.core.errors import ConfigError, SwarmError
from swarm.core.signals import handle_stop_signals
from swarm.dashboard.collector import DashboardConfig
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.service import serve_dashboard
from swarm.peer import Peer

__all__ = ["attach_dashboard", "dashboard_config", "main"]

logger = logging.getLogger("swarm.cli.dashboard")


def dashboard_config(port: int, host: str | None, runs: Sequence[str] | None,
                     experts: Sequence[str] | None) -> DashboardConfig:
    """The dashboard's config from its command-line options (bad values: `ConfigError`)."""
    try:
        return DashboardConfig(host=host or "127.0.0.1", port=port, runs=tuple(runs or ()),
                               expert_prefixes=tuple(experts or ()))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def attach_dashboard(peer: Peer, options: PeerOptions) -> DashboardServer:
    """Serves the page from a daemon started with `--dashboard-port`."""
    assert options.dashboard_port is not None
    config = dashboard_config(options.dashboard_port, options.dashboard_host, options.dashboard_run,
                              options.dashboard_experts)
    server = serve_dashboard(peer, config, public=options.dashboard_public)
    if not server.access.public:  # the operator needs the token, whatever the log level
        print(f"# the dashboard of this private swarm: {server.page_url}", file=sys.stderr, flush=True)
    return server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer dashboard",
        description="Join the swarm in client mode and serve its live page (nothing else).",
    )
    parser.add_argument("--initial-peers", action="append", nargs="+", metavar="MADDR",
                        help="peers already in the swarm (default: SWARM_INITIAL_PEERS)")
    add_dashboard_arguments(parser, port_flag="--port")
    parser.add_argument("--insecure", action="store_true", default=False,
                        help="dial in plaintext, to peers started with --insecure")
    parser.add_argument("--identity", help="key file (its PeerID is the one a private swarm's certificate names)")
    add_private_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("SWARM_LOG_LEVEL", "WARNING"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raw = ([a for group in args.initial_peers for item in group for a in item.replace(",", " ").split()]
           if args.initial_peers else os.environ.get("SWARM_INITIAL_PEERS", "").replace(",", " ").split())
    stop = threading.Event()
    try:
        if not raw:
            raise ConfigError("name at least one peer: --initial-peers MADDR... (or set SWARM_INITIAL_PEERS)")
        config = dashboard_config(args.dashboard_port or 0, args.dashboard_host, args.dashboard_run,
                                  args.dashboard_experts)
        handle_stop_signals(lambda signum: stop.set())
        peer = Peer(initial_peers=raw, client_mode=True, insecure=args.insecure, identity_path=args.identity,
                    swarm_authority=args.swarm_authority or os.environ.get("SWARM_SWARM_AUTHORITY") or None,
                    membership=args.membership or os.environ.get("SWARM_MEMBERSHIP") or None,
                    swarm_key=args.swarm_key or os.environ.get("SWARM_SWARM_KEY") or None)
    except SwarmError as e:
        print(f"swarm-peer dashboard: error: {e}", file=sys.stderr)
        return 2
    try:
        server = serve_dashboard(peer, config, public=bool(args.dashboard_public))
        print(server.page_url, flush=True)
        while not stop.wait(1.0):
            pass
    except SwarmError as e:
        print(f"swarm-peer dashboard: error: {e}", file=sys.stderr)
        return 2
    finally:
        peer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
