"""What this peer has measured of its links: per-peer round-trip time and throughput.

Pure logic, no networking: the channel layer feeds it the duration of every answered call
(`observe_rtt`) and the all-reduce the duration of its transfers (`observe_transfer`); timeouts
are then derived from it instead of fixed constants:

- `retransmit_after(peer)`: the RFC 6298 retransmission timeout, SRTT + 4 RTTVAR (with the
  gains 1/8 and 1/4 of that RFC), between a floor and a cap the caller gives; a request to the
  peer that timed out (`timed_out`) doubles it until the next answered call brings a fresh
  sample (RFC 6298 §5.5 and §5.7), so a link that slowed down after it was measured is given
  more time on the next try instead of being timed out at its old pace forever;
- `deadline(peer, nbytes)`: a small multiple of the time a request of `nbytes` should take
  (round trip plus bytes over the measured throughput), between a floor and the caller's cap
  (the existing fixed setting), so a stalled or dead peer costs a known multiple of what a healthy
  one takes, and a link never measured keeps the cap.

Long polls (a call that is answered when something happens, not when it arrives) are not round
trips; methods registered with `exclude` are left out of the RTT, as are methods whose caller
feeds its own measurement (the DHT's, timed from before a delay on the link to the answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["MAX_BACKOFF", "LinkEstimate", "LinkEstimates"]

_ALPHA = 1 / 8   # RFC 6298 §2: gain of the smoothed RTT
_BETA = 1 / 4    # RFC 6298 §2: gain of the RTT variation
_THROUGHPUT_GAIN = 1 / 4
MAX_BACKOFF = 6  # doublings of a link's RTO after timeouts in a row: 64x at most


@dataclass
class LinkEstimate:
    """What is known of the link to one peer.

    Attributes:
        srtt: smoothed round-trip time, seconds (None: no sample yet).
        rttvar: round-trip time variation, seconds.
        min_rtt: the smallest round trip seen.
        samples: round trips seen.
        throughput: smoothed bytes per second of transfers to or from this peer (None: none yet).
        backoff: requests timed out since the last fresh sample; each doubles the RTO (capped at
            `MAX_BACKOFF` doublings).
    """

    srtt: float | None = None
    rttvar: float = 0.0
    min_rtt: float = math.inf
    samples: int = 0
    throughput: float | None = None
    backoff: int = 0

    def rto(self, backed_off: bool = True) -> float | None:
        """SRTT + 4 RTTVAR (None before a sample), doubled per timeout since the last sample."""
        if self.srtt is None:
            return None
        return (self.srtt + 4 * self.rttvar) * (self.backoff_factor() if backed_off else 1)

    def backoff_factor(self) -> int:
        return 1 << self.backoff


@dataclass
class LinkEstimates:
    """Per-peer link estimates, plus one over all peers for peers not measured yet.

    Attributes:
        max_peers: peers remembered; the least recently measured are forgotten beyond it.
    """

    max_peers: int = 4096
    links: dict[str, LinkEstimate] = field(default_factory=dict)
    overall: LinkEstimate = field(default_factory=LinkEstimate)
    excluded: set[str] = field(default_factory=set)

    def exclude(self, *methods: str) -> None:
        """Calls to these methods are long polls: their duration says nothing of the link."""
        self.excluded.update(methods)

    def observe_call(self, peer_id: str, method: str, seconds: float) -> None:
        """An answered call to `method` on `peer_id` took `seconds` (the channel layer's hook)."""
        if peer_id and method not in self.excluded:
            self.observe_rtt(peer_id, seconds)

    def observe_rtt(self, peer_id: str, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        for link in (self._link(peer_id), self.overall):
            if link.srtt is None:  # RFC 6298 §2.2
                link.srtt, link.rttvar = seconds, seconds / 2
            else:  # §2.3
                link.rttvar += _BETA * (abs(link.srtt - seconds) - link.rttvar)
                link.srtt += _ALPHA * (seconds - link.srtt)
            link.min_rtt = min(link.min_rtt, seconds)
            link.samples += 1
            link.backoff = 0  # RFC 6298 §5.7: a fresh sample ends the backoff

    def timed_out(self, peer_id: str) -> int:
        """A request to `peer_id` went unanswered for its timeout: its RTO doubles (RFC 6298 §5.5)
        until the next answer; returns the doublings now in force."""
        link = self.links.get(peer_id)
        if link is None:
            return 0
        link.backoff = min(link.backoff + 1, MAX_BACKOFF)
        return link.backoff

    def observe_transfer(self, peer_id: str, nbytes: int, seconds: float) -> None:
        """`nbytes` went to or came from `peer_id` in `seconds` (one round trip included)."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        link = self._link(peer_id)
        rtt = link.min_rtt if math.isfinite(link.min_rtt) else 0.0
        rate = nbytes / max(seconds - rtt, seconds / 2)
        for target in (link, self.overall):
            if target.throughput is None:
                target.throughput = rate
            else:
                target.throughput += _THROUGHPUT_GAIN * (rate - target.throughput)

    def get(self, peer_id: str) -> LinkEstimate | None:
        return self.links.get(peer_id)

    def rtt(self, peer_id: str | None = None) -> float | None:
        """Smoothed RTT to `peer_id` (or over all peers when it was never measured); None if nothing is known."""
        link = self.links.get(peer_id) if peer_id else None
        if link is None or link.srtt is None:
            link = self.overall
        return link.srtt

    def throughput(self, peer_id: str | None = None) -> float | None:
        link = self.links.get(peer_id) if peer_id else None
        if link is None or link.throughput is None:
            link = self.overall
        return link.throughput

    def retransmit_after(self, peer_id: str | None, floor: float, cap: float, default: float | None = None) -> float:
        """RFC 6298's retransmission timeout for `peer_id`, within [floor, cap].

        A peer never measured gets the RTO over all peers; with nothing measured at all, `default`
        (or `cap`)."""
        link = self.links.get(peer_id) if peer_id else None
        rto = link.rto() if link is not None else None
        if rto is None:
            rto = self.overall.rto()
        if rto is None:
            rto = cap if default is None else default
        return _clamp(rto, floor, cap)

    def expected_time(self, peer_id: str | None, nbytes: int = 0) -> float | None:
        """Seconds one request of `nbytes` to `peer_id` should take: RTO plus bytes over throughput."""
        link = self.links.get(peer_id) if peer_id else None
        rto = link.rto() if link is not None else None
        if rto is None:
            rto = self.overall.rto()
        if rto is None:
            return None
        if nbytes <= 0:
            return rto
        rate = self.throughput(peer_id)
        return None if rate is None else rto + nbytes / rate

    def deadline(self, peer_id: str | None, nbytes: int, *, multiple: float, floor: float, cap: float) -> float:
        """`multiple` times `expected_time`, within [floor, cap]; `cap` when the link was never measured."""
        expected = self.expected_time(peer_id, nbytes)
        return cap if expected is None else _clamp(multiple * expected, floor, cap)

    def _link(self, peer_id: str) -> LinkEstimate:
        link = self.links.pop(peer_id, None)
        if link is None:
            link = LinkEstimate()
            while len(self.links) >= self.max_peers:
                self.links.pop(next(iter(self.links)))
        self.links[peer_id] = link  # most recently measured last
        return link


def _clamp(value: float, floor: float, cap: float) -> float:
    return max(min(value, cap), min(floor, cap))
