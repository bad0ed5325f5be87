"""Which training mode a demo trainer uses: the run's, or the one that fits this peer's link.

Every peer of a run must train in one mode (large-batch peers and DiLoCo peers never average
together), so the mode belongs to the run: the first trainer of a run picks it and stores it in
the DHT under `<run_id>.mode`; later trainers read it and follow. The first trainer picks by its
link: on loopback or a local network (round trips under `WAN_RTT`) a round of large-batch
averaging costs less than the compute it overlaps, so large-batch mode trains as one process
would; across the internet (a slower measured round trip, a public address announced for
others to join, or client mode behind NAT) the dense gradients of every collective step would
outlast the compute they overlap, so it picks DiLoCo, which sends one 8-bit pseudo-gradient per
`DEFAULT_DILOCO_STEPS` steps, its rounds overlapped with the next inner steps.

Whether a large-batch peer waits for each round or averages it while computing the next batches
(`CollaborationConfig.max_staleness`) is its own choice, by its own link (peers of one run may
differ in it: every peer still applies each round's mean at the same epoch): on a local link a
round costs less than applying the gradients a step late, so it waits; across the internet it
overlaps.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from swarm.core.errors import ConfigError

WAN_RTT = 0.010  # seconds: a round trip longer than this is not a local network
# the demo's model: ten steps (seconds of compute with remote experts) hide a round of its 8-bit
# pseudo-gradient (under 1 MB) across the internet
DEFAULT_DILOCO_STEPS = 10
MODES = ("auto", "large-batch", "diloco")
STALENESS = ("auto", "0", "1")


@dataclass(frozen=True)
class ModeChoice:
    """The mode a trainer uses, and why (printed when it starts).

    Attributes:
        mode: "large-batch" or "diloco".
        local_steps: DiLoCo's inner steps per round (None in large-batch mode).
        why: one sentence for the user.
        max_staleness: large-batch mode's `CollaborationConfig.max_staleness` (0: every round
            waited for; 1: averaged while the next batches compute).
    """

    mode: str
    local_steps: int | None
    why: str
    max_staleness: int = 1

    def describe(self) -> str:
        if self.mode == "diloco":
            what = f"DiLoCo, {self.local_steps} local steps per round, outer steps overlapped with the next inner ones"
        elif self.max_staleness:
            what = "large-batch, each round averaged while the next batches compute"
        else:
            what = "large-batch, each round waited for"
        return f"mode: {what} ({self.why})"

    def to_record(self) -> dict[str, object]:
        return {"mode": self.mode, "local_steps": self.local_steps}


def mode_key(run_id: str) -> str:
    """The DHT key holding a run's mode."""
    return f"{run_id}.mode"


def from_record(record: object) -> ModeChoice | None:
    """The run's mode as stored in the DHT; None for a missing or malformed record."""
    if not isinstance(record, Mapping):
        return None
    mode, steps = record.get("mode"), record.get("local_steps")
    if mode == "large-batch" and steps is None:
        return ModeChoice(mode, None, "the run's mode, chosen by the peer that started it")
    if mode == "diloco" and isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return ModeChoice(mode, steps, "the run's mode, chosen by the peer that started it")
    return None


def is_public(addr: str) -> bool:
    """True when a multiaddr names a global (not loopback, private or link-local) IP address."""
    parts = addr.split("/")
    for proto, value in zip(parts[1::2], parts[2::2]):
        if proto in ("ip4", "ip6"):
            try:
                return ipaddress.ip_address(value).is_global
            except ValueError:
                return False
    return False


def pick_mode(requested: str, diloco_steps: int | None, run_record: object, rtt: float | None,
              announce: Sequence[str], client_mode: bool, max_staleness: str = "auto") -> ModeChoice:
    """The mode this trainer uses.

    Args:
        requested: "auto", "large-batch" or "diloco" (the `--mode` flag).
        diloco_steps: DiLoCo's local steps when given (`--diloco-steps`; implies DiLoCo under "auto").
        run_record: what the DHT holds under `mode_key(run_id)` (None: nothing, this peer starts the run).
        rtt: the smoothed round trip this peer measured to the swarm (None: nothing measured yet).
        announce: the addresses this peer announces.
        client_mode: this peer only dials out.
        max_staleness: "auto" (by this peer's link: 0 on a local one, 1 across the internet), "0"
            or "1" (`CollaborationConfig.max_staleness` in large-batch mode).

    Raises:
        ConfigError: an unknown mode or staleness.
    """
    if requested not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {requested!r}")
    if max_staleness not in STALENESS:
        raise ConfigError(f"--max-staleness must be one of {', '.join(STALENESS)}, got {max_staleness!r}")
    steps = diloco_steps or DEFAULT_DILOCO_STEPS
    wide_area = None
    if rtt is not None and rtt > WAN_RTT:
        wide_area = f"round trip {rtt * 1e3:.0f} ms to the swarm: a wide-area link"
    elif public := [a for a in announce if is_public(a)]:
        wide_area = f"this peer announces {public[0]}: peers will join across the internet"
    elif client_mode:
        wide_area = "client mode: this peer is behind NAT, across the internet from the swarm"
    # a large-batch peer overlaps its rounds across the internet, and waits for them on a local link
    staleness = int(max_staleness) if max_staleness != "auto" else (1 if wide_area else 0)
    by_link = f"; {wide_area or 'a local link'}" if max_staleness == "auto" else ""  # why that staleness
    if requested == "large-batch":
        return ModeChoice("large-batch", None, "asked for" + by_link, staleness)
    if requested == "diloco" or diloco_steps is not None:
        return ModeChoice("diloco", steps, "asked for")
    adopted = from_record(run_record)
    if adopted is not None:
        if adopted.mode != "large-batch":
            return adopted
        return replace(adopted, max_staleness=staleness, why=adopted.why + by_link)
    if wide_area:
        return ModeChoice("diloco", steps, wide_area)
    link = "no other peer yet" if rtt is None else f"round trip {rtt * 1e3:.1f} ms to the swarm"
    return ModeChoice("large-batch", None, f"{link}: a local link", staleness)
