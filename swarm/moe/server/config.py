"""ExpertServerConfig: the limits and periods of an expert server."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.core.errors import ConfigError
from swarm.moe.server.hosted import BatchingConfig
from swarm.moe.server.hostile import HOSTILE_MODES

__all__ = ["ExpertServerConfig"]


@dataclass(frozen=True)
class ExpertServerConfig:
    """Limits and periods of an `ExpertServer`.

    Attributes:
        max_batch_size: the most rows per request and per batch, for experts built by the server.
        batching: how requests are merged into batches and forward graphs kept.
        max_inflight_requests: Forward/Backward calls handled at once; past it, RESOURCE_EXHAUSTED.
        max_inflight_bytes: tensor bytes held by requests in flight; past it, RESOURCE_EXHAUSTED.
        max_inflight_per_caller: Forward/Backward calls handled at once for one caller (PeerID),
            so that one identity cannot take every slot; past it, RESOURCE_EXHAUSTED at once.
            The limit in force is the smaller of this and `max_inflight_requests`.
        max_inflight_per_source: Forward/Backward calls handled at once from one source (the
            caller's /24 or /64, `swarm.net.server.source_of`), however many identities it uses;
            past it, RESOURCE_EXHAUSTED at once. Sources exempt in `ServerConfig.source_exempt`
            (loopback by default) are not counted.
        header_timeout: seconds a call may take to send its first message (the header naming the
            expert and its tensors); a call that stalls longer is refused (DEADLINE_EXCEEDED).
            No slot is held while the header is awaited.
        body_timeout: seconds a call may take to send its tensors once admitted; a call that
            stalls longer loses its slot and its bytes (DEADLINE_EXCEEDED).
        min_body_rate: bytes per second a call must keep up while it sends its tensors, after
            `body_grace`: by t seconds after admission it must have sent
            `min_body_rate * (t - body_grace)` bytes, else it loses its slot and its bytes
            (DEADLINE_EXCEEDED), so a sender that trickles a large body holds them for
            `body_grace` plus the time its bytes paid for, not for all of `body_timeout`.
        body_grace: seconds after admission during which no rate is asked of a call.
        check_finite: refuse inputs and gradients holding NaN or Inf.
        declare_ttl: seconds a DHT declaration lives; re-announced every third of it.
        checkpoint_interval: seconds between periodic checkpoints (None: only at shutdown).
        compute_threads: torch intra-op threads the compute threads use together (None: torch's
            default, one per core).
        compute_workers: compute threads, hence batches of different experts running at once
            (None: one per compute thread). A batch running alone gets all `compute_threads`;
            concurrent ones share them (`swarm.moe.server.runtime`). The experts of one group call
            (a mixture's share of a batch) are split among the workers at once.
        runtime_shutdown_timeout: seconds a running batch gets to finish at shutdown.
        max_drain_bytes: how much of a refused request is still read (and dropped) so that the
            caller sees the refusal's status; a caller that sends more sees a broken call.
        max_drain_seconds: how long, at most, a refused request is read before the refusal is
            sent anyway (a caller that sends nothing more is answered at once).
        grad_clip_ratio: each row of the output gradients a caller sends is scaled down to at most
            this many times the expert's running reference before the expert trains on it
            (`swarm.moe.server.gradient_bounds`); None: no bound.
        grad_clip_window: batches that reference is taken over.
        hostile: a FAULT for tests and demos: the server's experts lie in every answer
            (`swarm.moe.server.hostile`: ``x1e6``, ``nan``, ``shape``, ``sometimes``, ``flip``). None: honest.
    """

    max_batch_size: int = 4096
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    max_inflight_requests: int = 256
    max_inflight_bytes: int = 1 << 30
    max_inflight_per_caller: int = 64
    max_inflight_per_source: int = 128
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    min_body_rate: float = 256 << 10
    body_grace: float = 5.0
    check_finite: bool = True
    declare_ttl: float = 60.0
    checkpoint_interval: float | None = 300.0
    compute_threads: int | None = None
    compute_workers: int | None = None
    runtime_shutdown_timeout: float = 5.0
    max_drain_bytes: int = 128 << 20
    max_drain_seconds: float = 1.0
    grad_clip_ratio: float | None = 10.0
    grad_clip_window: int = 128
    hostile: str | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_inflight_requests < 1 or self.max_inflight_bytes < 1:
            raise ConfigError("max_batch_size and in-flight limits must be positive")
        if self.max_inflight_per_caller < 1 or self.max_inflight_per_source < 1:
            raise ConfigError("max_inflight_per_caller and max_inflight_per_source must be positive")
        for name in ("header_timeout", "body_timeout", "min_body_rate", "body_grace", "max_drain_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if not self.declare_ttl > 0:
            raise ConfigError("declare_ttl must be positive")
        if self.checkpoint_interval is not None and not self.checkpoint_interval > 0:
            raise ConfigError("checkpoint_interval must be positive or None")
        if self.compute_threads is not None and self.compute_threads < 1:
            raise ConfigError("compute_threads must be positive or None")
        if self.compute_workers is not None and self.compute_workers < 1:
            raise ConfigError("compute_workers must be positive or None")
        if self.grad_clip_ratio is not None and not self.grad_clip_ratio > 1:
            raise ConfigError("grad_clip_ratio must be greater than 1 or None")
        if self.grad_clip_window < 1:
            raise ConfigError("grad_clip_window must be positive")
        if self.hostile is not None and self.hostile not in HOSTILE_MODES:
            raise ConfigError(f"hostile must be one of {HOSTILE_MODES} or None, got {self.hostile!r}")
