"""RemoteMixtureOfExperts: a layer whose experts live on other peers, found through the DHT.

A gating network (one linear map, split into one score vector per grid dimension) scores the
grid coordinates; the beam search (`swarm.moe.client.beam_search`) picks each sample's `k_best` live
experts; one group call per server carries the rows of all its chosen experts
(`swarm.moe.client.dispatch`); the output is the gate-weighted sum of the experts that answered, the
weights renormalized over those (Learning@home, Ryabinin & Gusev 2020, §3). Gradients reach the
gating network through the weights and the experts through their Backward calls (each expert
trains itself on them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from swarm.core.errors import ConfigError, MoEError
from swarm.dht.handle import PeerHandle
from swarm.moe.client.answer_checks import AnswerChecks, MisbehavingExpert
from swarm.moe.client.beam_search import ExpertChoice, MoEBeamSearcher
from swarm.moe.client.dispatch import DispatchPolicy, MixtureCall, MixtureCaller
from swarm.moe.client.jobs import ExpertJob
from swarm.moe.client.spot_checks import ReplicaMismatch, SilentReplica, SpotCheckConfig, SpotChecker
from swarm.moe.sources import ExpertSource

__all__ = ["MixtureConfig", "RemoteMixtureOfExperts"]

_DUMMY = torch.empty(0, requires_grad=True)
"""Makes autograd run the mixture's backward (and so train the experts) even when x needs no grad."""


@dataclass(frozen=True)
class MixtureConfig:
    """Shape and routing of a mixture.

    Attributes:
        in_features: size of the last dimension of the input.
        grid_size: coordinates per grid dimension, e.g. ``(4, 4)``.
        uid_prefix: the grid's UID prefix, e.g. ``"ffn."``.
        k_best: experts chosen per sample.
        beam_size: prefixes kept per sample during the search (default: k_best).
        cache_ttl: seconds the search reuses what the DHT said about a prefix.
        policy: k_min, timeouts and what to do with failed experts.
        checks: how the experts' answers are checked and clipped (`swarm.moe.client.answer_checks`).
        spot_checks: how often an answer is compared with another server's of the same expert
            (`swarm.moe.client.spot_checks`; off by default).
    """

    in_features: int
    grid_size: tuple[int, ...]
    uid_prefix: str
    k_best: int
    beam_size: int | None = None
    cache_ttl: float = 2.0
    policy: DispatchPolicy = field(default_factory=DispatchPolicy)
    checks: AnswerChecks = field(default_factory=AnswerChecks)
    spot_checks: SpotCheckConfig = field(default_factory=SpotCheckConfig)

    def __post_init__(self) -> None:
        if self.in_features < 1:
            raise ConfigError(f"in_features must be positive, got {self.in_features}")
        if self.k_best < 1 or (self.beam_size is not None and self.beam_size < self.k_best):
            raise ConfigError("k_best must be >= 1 and beam_size (if given) >= k_best")
        if self.policy.k_min > self.k_best:
            raise ConfigError(f"k_min={self.policy.k_min} cannot exceed k_best={self.k_best}")
        object.__setattr__(self, "grid_size", tuple(self.grid_size))


class RemoteMixtureOfExperts(nn.Module):
    """A mixture-of-experts layer over remote experts.

    Takes either a `MixtureConfig` or its fields as keywords (``in_features=..., grid_size=...,
    uid_prefix=..., k_best=..., k_min=...``), not both.

    Args:
        peer: the calling `swarm.Peer` (client mode is fine).
        config: the mixture's shape, routing, policy and checks.
        source: where live experts are found (default: the peer's DHT).
        in_features: size of the input's last dimension (the gating network's input).
        grid_size: the expert grid, e.g. ``(4, 4)`` for experts ``ffn.0.0`` ... ``ffn.3.3``.
        uid_prefix: the grid's prefix, e.g. ``"ffn."``.
        k_best: experts chosen per sample (default `default_k_best` where the class has one).
        k_min: a forward fails (`MoEError`) unless every sample gets this many answers.
        forward_timeout: deadline of the expert calls of one forward, seconds.
        timeout_after_k_min: once every sample has k_min answers, wait at most this much longer for
            the other experts (None: wait for every expert until forward_timeout).
        backward_k_min: like k_min, for the backward calls.
        backward_timeout: deadline of the expert calls of one backward, seconds.
        allow_zero_outputs: a sample without any answer gets a zero output instead of an error.
        cache_ttl: seconds the beam search reuses what it read about a prefix.
        beam_size: prefixes kept per sample during the search (default: k_best).
        exclude_failed_for: seconds a failed expert is not chosen again.
        checks: how answers are checked and clipped (default `AnswerChecks()`: on); a server whose
            answer fails them is not chosen again for `checks.avoid_for` seconds.

    Raises:
        TypeError: both a config and its fields, or neither.

    Input ``(..., in_features)``; output ``(..., *expert output shape)``.
    """

    default_k_best: int | None = None
    """k_best when neither a config nor the keyword gives one (None: it must be given)."""

    def __init__(
        self,
        peer: PeerHandle,
        config: MixtureConfig | None = None,
        *,
        source: ExpertSource | None = None,
        in_features: int | None = None,
        grid_size: Sequence[int] | None = None,
        uid_prefix: str | None = None,
        k_best: int | None = None,
        k_min: int = 1,
        forward_timeout: float = 30.0,
        timeout_after_k_min: float | None = None,
        backward_k_min: int = 1,
        backward_timeout: float = 30.0,
        allow_zero_outputs: bool = False,
        cache_ttl: float = 2.0,
        beam_size: int | None = None,
        exclude_failed_for: float = 5.0,
        checks: AnswerChecks | None = None,
    ) -> None:
        super().__init__()
        if config is None:
            k_best = self.default_k_best if k_best is None else k_best
            if in_features is None or grid_size is None or uid_prefix is None or k_best is None:
                raise TypeError("give a MixtureConfig, or in_features, grid_size, uid_prefix and k_best")
            policy = DispatchPolicy(k_min, forward_timeout, timeout_after_k_min, backward_k_min, backward_timeout,
                                    allow_zero_outputs, exclude_failed_for)
            config = MixtureConfig(in_features, tuple(grid_size), uid_prefix, k_best, beam_size, cache_ttl, policy,
                                   checks or AnswerChecks())
        elif not isinstance(config, MixtureConfig):
            raise TypeError(f"config must be a MixtureConfig, got {type(config).__name__}")
        else:
            given = {"in_features": in_features, "grid_size": grid_size, "uid_prefix": uid_prefix, "k_best": k_best,
                     "beam_size": beam_size, "timeout_after_k_min": timeout_after_k_min, "checks": checks}
            flat = (k_min, forward_timeout, backward_k_min, backward_timeout, allow_zero_outputs, cache_ttl,
                    exclude_failed_for)
            if any(v is not None for v in given.values()) or flat != (1, 30.0, 1, 30.0, False, 2.0, 5.0):
                raise TypeError("give either a MixtureConfig or its fields as keywords, not both")
        self.config = config
        if source is None:
            from swarm.moe.dht_declare import DHTExpertSource

            if peer.dht is None:
                raise ConfigError("this peer has no DHT to find experts in: pass their address or a source")
            source = DHTExpertSource(peer.dht)
        self.peer = peer
        self.searcher = MoEBeamSearcher(source, config.uid_prefix, config.grid_size, config.cache_ttl)
        spot = None
        if config.spot_checks.fraction > 0:
            spot = SpotChecker(config.spot_checks, source, peer, self.searcher.avoided_servers,
                               config.policy.forward_timeout)
        self.caller = MixtureCaller(peer, config.policy, self._on_failure, config.checks, spot)
        self.gate = nn.Linear(config.in_features, sum(config.grid_size))

    def _on_failure(self, job: ExpertJob, error: BaseException) -> None:
        # runs on the peer's loop, like every use of the searcher's state (or, for a spot check's
        # verdict, on the calling thread between two searches)
        if isinstance(error, SilentReplica):  # a server that gave no third opinion: avoided like a timeout
            self.searcher.avoid_server(error.addr, self.config.policy.exclude_failed_for)
            return
        if isinstance(error, ReplicaMismatch):
            if error.blamed is not None:
                self.searcher.avoid_server(error.blamed, self.config.checks.avoid_for)
            if error.blamed != job.addr:
                return  # this expert's own server was not shown wrong: it stays in the search
        elif isinstance(error, MisbehavingExpert):
            self.searcher.avoid_server(job.addr, self.config.checks.avoid_for)
        self.searcher.exclude(job.uid, self.config.policy.exclude_failed_for)

    def choose_experts(self, grid_scores: Sequence[torch.Tensor]) -> ExpertChoice:
        """Runs the beam search for a batch of gating scores (blocking)."""
        cfg = self.config
        scores = [s.detach() for s in grid_scores]
        return self.peer.run(
            self.searcher.find_best_experts(scores, cfg.k_best, cfg.beam_size), cfg.policy.forward_timeout
        )

    def route(self, x: torch.Tensor) -> tuple[list[torch.Tensor], ExpertChoice, torch.Tensor, torch.Tensor]:
        """Scores, chooses and calls the experts for a flat batch ``(batch, in_features)``.

        Returns:
            ``(grid_scores, choice, outputs, answered)``: the per-dimension gating scores, the
            chosen experts, their outputs ``(batch, k, *out)`` and which slots answered.
        """
        grid_scores = list(self.gate(x).split(list(self.config.grid_size), dim=-1))
        misbehaviours = self.caller.misbehaviours
        choice = self.choose_experts(grid_scores)
        try:
            outputs, answered = MixtureCall.apply(_DUMMY, self.caller, choice, x, torch.is_grad_enabled())
        except MoEError:
            if self.caller.misbehaviours == misbehaviours:
                raise
            # answers failed the checks and left samples short of k_min: their servers are avoided
            # now, so one more search routes those samples to other experts
            choice = self.choose_experts(grid_scores)
            outputs, answered = MixtureCall.apply(_DUMMY, self.caller, choice, x, torch.is_grad_enabled())
        return grid_scores, choice, outputs, answered

    def gate_weights(
        self, grid_scores: list[torch.Tensor], choice: ExpertChoice, answered: torch.Tensor
    ) -> torch.Tensor:
        """``(batch, k)`` weights: softmax of the chosen experts' scores over those that answered."""
        logits = sum(s.gather(1, choice.coords(d)) for d, s in enumerate(grid_scores))
        any_answer = answered.any(dim=1, keepdim=True)
        masked = logits.masked_fill(~answered, -math.inf).masked_fill(~any_answer, 0.0)  # type: ignore[union-attr]
        return masked.softmax(dim=1) * any_answer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the mixture on ``x`` of shape ``(..., in_features)``.

        Raises:
            ValueError: `x` does not end with `in_features`.
            MoEError: some sample got fewer than k_min answers (and zero outputs are not allowed).
        """
        if x.dim() < 1 or x.shape[-1] != self.config.in_features:
            raise ValueError(f"expected input (..., {self.config.in_features}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.config.in_features)
        grid_scores, choice, outputs, answered = self.route(flat)
        return self.combine(self.gate_weights(grid_scores, choice, answered), outputs, x.shape[:-1])

    @staticmethod
    def combine(weights: torch.Tensor, outputs: torch.Tensor, lead_shape: Sequence[int]) -> torch.Tensor:
        """The weighted sum over slots of ``outputs (batch, k, *out)``, reshaped to ``(*lead, *out)``."""
        batch, k = weights.shape
        flat = (weights.unsqueeze(-1) * outputs.reshape(batch, k, -1).to(weights.dtype)).sum(dim=1)
        return flat.reshape(*lead_shape, *outputs.shape[2:])

    def extra_repr(self) -> str:
        cfg = self.config
        return f"uid_prefix={cfg.uid_prefix!r}, grid_size={cfg.grid_size}, k_best={cfg.k_best}, k_min={cfg.policy.k_min}"
