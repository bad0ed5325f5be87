"""Options of `swarm-peer`: command line, then `SWARM_<OPTION>` environment variables, then a TOML
file given by `--config`, then defaults (docs/operations.md). The first that sets an option wins."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from swarm.core.errors import ConfigError


@dataclass(frozen=True)
class PeerOptions:
    """Everything `swarm-peer` can be told; names match the CLI flags (dashes as underscores)."""

    listen: str = "/ip4/0.0.0.0/tcp/31337"
    announce: tuple[str, ...] = ()
    initial_peers: tuple[str, ...] = ()
    identity: str | None = None
    client_mode: bool = False
    experts: str | None = None
    expert_cls: str = "ffn"
    hidden_dim: int = 1024
    checkpoint_dir: str | None = None
    expert_hostile: str | None = None
    metrics_port: int | None = None
    bulk_port: str | None = None
    insecure: bool = False
    reachability: str = "auto"
    relay: str = "auto"
    relay_port: int = 0
    log_level: str = "INFO"
    # the swarm's live page (swarm.dashboard): served only when a port is given
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"
    dashboard_run: tuple[str, ...] = ()
    dashboard_experts: tuple[str, ...] = ()
    dashboard_public: bool = False  # a private swarm's page without its token (swarm.dashboard.access)
    # a private swarm (docs/security.md, "Private swarms")
    swarm_authority: str | None = None
    membership: str | None = None
    swarm_key: str | None = None
    revocations: str | None = None
    # an archiver (docs/operations.md, "Checkpoints and a cold restart")
    archive: str | None = None
    run: str | None = None
    archive_every: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_dim <= 0:
            raise ConfigError(f"--hidden-dim must be positive, got {self.hidden_dim}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be a TCP port, got {self.metrics_port}")
        if self.bulk_port is not None and self.bulk_port != "off" and not (
                self.bulk_port.isdigit() and 0 <= int(self.bulk_port) <= 65535):
            raise ConfigError(f"--bulk-port must be a TCP port or 'off', got {self.bulk_port!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.reachability not in ("auto", "public", "private"):
            raise ConfigError(f"--reachability must be auto, public or private, got {self.reachability!r}")
        if self.relay not in ("auto", "on", "off"):
            raise ConfigError(f"--relay must be auto, on or off, got {self.relay!r}")
        if not 0 <= self.relay_port <= 65535:
            raise ConfigError(f"--relay-port must be a TCP port, got {self.relay_port}")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port <= 65535:
            raise ConfigError(f"--dashboard-port must be a TCP port, got {self.dashboard_port}")
        if (self.swarm_authority is None) != (self.membership is None):
            raise ConfigError("a private swarm needs both --swarm-authority and --membership")
        if self.swarm_key is not None and self.swarm_authority is not None:
            raise ConfigError("--swarm-key or --swarm-authority/--membership, not both")
        if self.client_mode and self.experts:
            raise ConfigError("a client-mode peer cannot serve experts (it accepts no connections)")
        if (self.archive is None) != (self.run is None):
            raise ConfigError("--archive DIR and --run RUN_ID go together (an archiver keeps one run's state)")
        if self.archive_every is not None and self.archive_every < 1:
            raise ConfigError(f"--archive-every must be a positive number of seconds, got {self.archive_every}")


_LIST_OPTIONS = {"announce", "initial_peers", "dashboard_run", "dashboard_experts"}
_BOOL_OPTIONS = {"client_mode", "insecure", "dashboard_public"}
_INT_OPTIONS = {"hidden_dim", "metrics_port", "relay_port", "dashboard_port", "archive_every"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the daemon's options; every default is None so that env and config can fill them."""
    parser.add_argument("--config", help="TOML file with any of these options (keys as flag names)")
    parser.add_argument("--listen", help="multiaddr to accept connections on (default /ip4/0.0.0.0/tcp/31337)")
    parser.add_argument("--announce", action="append", help="multiaddr to advertise instead (repeatable)")
    parser.add_argument("--initial-peers", action="append", nargs="+",
                        help="multiaddrs of peers already in the swarm (…/p2p/<PeerID>)")
    parser.add_argument("--identity", help="key file; created (0600) if missing, so the PeerID survives restarts")
    parser.add_argument("--client-mode", action="store_const", const=True,
                        help="only dial out (behind NAT, Colab): no server, not in others' routing tables")
    parser.add_argument("--experts", help="expert UIDs to serve, e.g. 'ffn.[0:4].[0:4]'")
    parser.add_argument("--expert-cls", help="expert class (ffn, transformer, nop, or a registered one)")
    parser.add_argument("--hidden-dim", type=int, help="hidden size of served experts (default 1024)")
    parser.add_argument("--checkpoint-dir", help="where experts are saved periodically and at shutdown")
    parser.add_argument("--expert-hostile", help="a FAULT for tests and demos: the served experts lie in every answer "
                                                 "(x1e6, nan, shape, sometimes or flip; docs/threat-model.md)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--bulk-port", help="TCP port of the side channel that carries tensors (default: any free "
                                            "port; 'off': tensors over the gRPC port only, slower)")
    parser.add_argument("--insecure", action="store_const", const=True,
                        help="plaintext instead of TLS on every connection, for a closed cluster only: "
                             "talks only to peers that also run with --insecure (docs/security.md)")
    parser.add_argument("--reachability", help="auto (default: ask initial peers to dial back), public, or "
                                               "private (behind NAT: be reached through relays; docs/relay.md)")
    parser.add_argument("--relay", help="auto (default: relay for peers behind NAT when publicly reachable), on or off")
    parser.add_argument("--relay-port", type=int, help="TCP port of the relay service (default: any free port)")
    parser.add_argument("--log-level", help="DEBUG, INFO (default), WARNING or ERROR")
    parser.add_argument("--archive", help="keep the state of the run named by --run in this directory (an archiver)")
    parser.add_argument("--run", help="the run an archiver keeps")
    parser.add_argument("--archive-every", type=int, help="seconds between an archiver's downloads (default 300)")
    private = add_private_arguments(parser)
    private.add_argument("--revocations", help="a revocation list file (from `swarm-peer revoke`) to apply "
                                               "and spread through the DHT")
    add_dashboard_arguments(parser)


def add_private_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """A private swarm's membership options (the daemon's, and `swarm-peer dashboard`'s)."""
    private = parser.add_argument_group("private swarm (docs/security.md)")
    private.add_argument("--swarm-authority", help="the authority's public key (swarm-authority:…): talk only to "
                                                   "peers holding its certificates")
    private.add_argument("--membership", help="this peer's certificate file (from `swarm-peer invite`)")
    private.add_argument("--swarm-key", help="a pre-shared swarm key file instead (small groups; no roles, "
                                             "no revocation)")
    return private


def add_dashboard_arguments(parser: argparse.ArgumentParser, port_flag: str = "--dashboard-port") -> None:
    """The dashboard's options (the daemon's, and `swarm-peer dashboard`'s with `--port`)."""
    parser.add_argument(port_flag, dest="dashboard_port", type=int,
                        help="serve the swarm's live page on this port (0: any free one; docs/operations.md)")
    parser.add_argument("--dashboard-host", help="address the page is served on (default 127.0.0.1: this machine only)")
    parser.add_argument("--dashboard-run", action="append", metavar="RUN_ID",
                        help="show only this training run (repeatable; default: every run the peers report)")
    parser.add_argument("--dashboard-experts", action="append", metavar="PREFIX",
                        help="an expert grid to read from the DHT, e.g. 'ffn.' (repeatable; grids the "
                             "peers serve are found anyway)")
    parser.add_argument("--dashboard-public", action="store_const", const=True,
                        help="in a private swarm, show the page to anyone who reaches it (by default only to "
                             "a browser with the token in the URL printed at start; docs/security.md)")


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in fields(PeerOptions):
        raw = environ.get(f"SWARM_{f.name.upper()}")
        if raw is None or raw == "":
            continue
        values[f.name] = _coerce(f.name, raw, f"environment variable SWARM_{f.name.upper()}")
    return values


def _coerce(name: str, raw: Any, where: str) -> Any:
    try:
        if name in _LIST_OPTIONS:
            items = raw.replace(",", " ").split() if isinstance(raw, str) else list(raw)
            return tuple(str(i) for i in items)
        if name in _BOOL_OPTIONS:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if name in _INT_OPTIONS:
            return int(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: invalid value {raw!r} for {name}") from None


def _from_file(path: str) -> dict[str, Any]:
    import tomllib  # only for a config file: its parser is ~0.3 MB of a daemon's memory

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    known = {f.name for f in fields(PeerOptions)} - {"extra"}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown option {key!r} (known: {', '.join(sorted(known))})")
        values[name] = _coerce(name, raw, f"config file {path}")
    return values


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> PeerOptions:
    """Merges command line, environment and config file into `PeerOptions`."""
    environ = os.environ if environ is None else environ
    config_path = args.config or environ.get("SWARM_CONFIG")
    merged = _from_file(config_path) if config_path else {}
    merged.update(_from_env(environ))
    for f in fields(PeerOptions):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name == "initial_peers":
            value = tuple(a for group in value for item in group for a in item.replace(",", " ").split())
        elif f.name in ("announce", "dashboard_run", "dashboard_experts"):
            value = tuple(value)
        merged[f.name] = value
    return PeerOptions(**merged)



class HelpFormatter(argparse.HelpFormatter):
    """argparse's own, sized to the terminal without `shutil`: argparse makes a formatter for every
    option it is given and imports `shutil` (with `bz2`, `lzma`: ~0.5 MB) to size it, help or not."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        if width is None:
            width = _terminal_columns() - 2
        super().__init__(prog, indent_increment, max_help_position, width)


def _terminal_columns() -> int:
    """What `shutil.get_terminal_size` says: $COLUMNS, else the terminal's width, else 80."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    stdout = sys.__stdout__
    try:
        return os.get_terminal_size(stdout.fileno()).columns if stdout is not None else 80
    except (AttributeError, OSError, ValueError):
        return 80


def build_parser() -> argparse.ArgumentParser:
    """The daemon's command line (`swarm-peer`); `swarm-peer status --self` reads it too."""
    parser = argparse.ArgumentParser(
        prog="swarm-peer", formatter_class=HelpFormatter,
        description="Run a swarm peer: join the DHT, serve experts, help average. "
        "Every option can also be set as SWARM_<OPTION> or in a --config TOML file.",
    )
    add_arguments(parser)
    return parser
