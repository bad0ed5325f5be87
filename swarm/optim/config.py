"""Configuration of collaborative training: one frozen dataclass per mode, validated on construction.

`CollaborationConfig` holds what every mode shares (how progress is reported in the DHT, how
long averaging and state downloads may take, how groups form). `DiLoCoConfig` switches the
optimizer to the low-communication mode of DiLoCo (Douillard et al., 2023, §2): H local inner
steps, then an outer Nesterov step on the averaged pseudo-gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.averaging.config import AGGREGATIONS
from swarm.compression import CompressionType
from swarm.core.errors import ConfigError


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class CollaborationConfig:
    """How a peer takes part in collaborative training.

    Attributes:
        target_batch_size: samples the whole swarm accumulates before one collective step
            (large-batch mode), as the peers' progress reports, each extrapolated by its peer's
            throughput since it was sent, estimate it: a round may hold a little more or fewer.
            In DiLoCo mode it is unused and may be None.
        target_group_size: most peers averaging together in one group; set it at least to
            the number of peers that should stay identical.
        averaging_timeout: seconds one averaging round (matchmaking and all-reduce) may take
            before it fails for every member; a dead peer never stalls the others past it.
        matchmaking_window: once two peers are in a group, how long its leader waits for more
            (peers notice that the swarm is ready within about `report_period` of each other).
        max_failed_rounds: consecutive failed rounds after which a peer gives up averaging its
            current gradients, discards them and re-synchronizes its state (large-batch mode).
        report_period: least seconds between two progress reports of this peer to the DHT (with no
            target batch, as in DiLoCo mode, reports between epoch changes come once per
            `progress_expiration / 3` instead).
        min_refresh_period: least seconds between two reads of the swarm's progress.
        max_refresh_period: most seconds between two reads of the swarm's progress.
        progress_expiration: seconds a progress report lives; a peer that stops reporting
            (it died) stops counting after this long.
        state_timeout: seconds a state download (parameters, optimizer state) may take.
        load_state_on_start: download the swarm's current state when this peer starts.
        gradient_compression: wire format of averaged gradients (large-batch mode).
            SCALED_FLOAT16 (the default): half the bytes of float32, and less of a peer's CPU per
            round (benchmarks/history/BENCHMARKS-2026-12-05.md, "Gradients as scaled float16 by default"), every finite range
            kept; members apply the mean as the codec rounded it, so they stay identical, within
            its rounding (about 2**-11 relative) of one process's step. NONE: that step exactly.
        max_staleness: rounds that may still be averaging while this peer computes. 1 (the
            default): a round's averaging runs while the trainer computes the next batches, and its
            step applies when the average arrives, so the gradients a step applies were computed
            at most one collective step earlier (DiLoCo: the outer step lands up to one round late,
            on top of the local steps taken meanwhile). The trainer waits for a round only when
            the next one is due before it ended. 0: every round is waited for (synchronous), and
            a trainer whose swarm is due at the target within half of its own next batch's time
            waits for it rather than computing that batch (`swarm.optim.optimizer.NEAR_TARGET`).
        trial_step: in large-batch mode with a round in flight, compute the next batches at the
            parameters moved by a trial of the step the round will take: the optimizer's step on
            this peer's own part of the round's gradients, its state left as it was. When the
            average lands the trial is undone exactly (the parameters are copied back) and the
            real step taken, so peers stay identical; what it changes is where the next batches'
            gradients are computed: near the parameters they will be applied to, instead of one
            whole step behind them (`swarm.optim.large_batch`; the loss it buys back:
            benchmarks/history/BENCHMARKS-2026-12-05.md, "Communication overlapped with compute"). It costs a copy of the
            parameters while the round is in flight, and one of the optimizer's state and one
            optimizer step per round for the trial. The optimizer must step without a closure (as
            every collective step does). False: compute at the parameters held.
        aggregation: how groups combine what they average (gradients, or DiLoCo's pseudo-gradients):
            "mean", or "centered_clip" for byzantine-robust averaging (`swarm.averaging.robust`;
            every peer of a run must use the same).
    """

    target_batch_size: int | None = None
    target_group_size: int = 16
    averaging_timeout: float = 30.0
    matchmaking_window: float = 1.0
    max_failed_rounds: int = 3
    report_period: float = 0.5
    min_refresh_period: float = 0.1
    max_refresh_period: float = 5.0
    progress_expiration: float = 10.0
    state_timeout: float = 60.0
    load_state_on_start: bool = True
    gradient_compression: CompressionType = CompressionType.SCALED_FLOAT16
    max_staleness: int = 1
    trial_step: bool = True
    aggregation: str = "mean"

    def __post_init__(self) -> None:
        if self.max_staleness not in (0, 1) or isinstance(self.max_staleness, bool):
            raise ConfigError(f"max_staleness must be 0 (synchronous) or 1 (one round in flight), "
                              f"got {self.max_staleness!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.target_batch_size is not None and (
            not isinstance(self.target_batch_size, int) or self.target_batch_size < 1
        ):
            raise ConfigError(f"target_batch_size must be a positive int, got {self.target_batch_size!r}")
        if not isinstance(self.target_group_size, int) or self.target_group_size < 1:
            raise ConfigError(f"target_group_size must be a positive int, got {self.target_group_size!r}")
        if not isinstance(self.max_failed_rounds, int) or self.max_failed_rounds < 1:
            raise ConfigError(f"max_failed_rounds must be a positive int, got {self.max_failed_rounds!r}")
        for name in ("averaging_timeout", "matchmaking_window", "report_period", "min_refresh_period", "max_refresh_period",
                     "progress_expiration", "state_timeout"):
            _positive(name, getattr(self, name))
        if self.min_refresh_period > self.max_refresh_period:
            raise ConfigError("min_refresh_period must not exceed max_refresh_period")
        if self.progress_expiration <= 3 * self.report_period:
            raise ConfigError("progress_expiration must be longer than 3 report periods")
        object.__setattr__(self, "gradient_compression", CompressionType(self.gradient_compression))


@dataclass(frozen=True)
class DiLoCoConfig:
    """The low-communication mode (DiLoCo, Douillard et al. 2023, Algorithm 1).

    Each peer runs `local_steps` steps of its own (inner) optimizer, then the peers average the
    pseudo-gradient `params_at_round_start - params_now` and apply SGD with Nesterov momentum
    to the round-start parameters. Inner optimizer state stays local, as in the paper.

    Attributes:
        local_steps: H, inner steps between two averaging rounds.
        outer_lr: learning rate of the outer SGD (the paper uses 0.7).
        outer_momentum: momentum of the outer SGD (the paper uses 0.9).
        nesterov: use Nesterov momentum (the paper does).
        compression: wire format of the averaged pseudo-gradient: UNIFORM_8BIT (the default),
            or UNIFORM_4BIT (blockwise 4-bit, ~0.53x the bytes; its loss against 8-bit:
            benchmarks/history/BENCHMARKS-2026-12-05.md, "Communication overlapped with compute").
        fragments: the parameters are cut into this many fragments, synced in turn (Streaming
            DiLoCo, Douillard et al. 2025): one fragment every `local_steps / fragments` inner
            steps, so each fragment is still synced every `local_steps` steps while a round sends
            1/fragments of the model (the peak bandwidth per peer drops by that factor).
    """

    local_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: CompressionType = CompressionType.UNIFORM_8BIT
    fragments: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ConfigError(f"local_steps must be a positive int, got {self.local_steps!r}")
        if not isinstance(self.fragments, int) or isinstance(self.fragments, bool) or self.fragments < 1:
            raise ConfigError(f"fragments must be a positive int, got {self.fragments!r}")
        if self.local_steps % self.fragments:
            raise ConfigError(f"local_steps ({self.local_steps}) must be a multiple of fragments ({self.fragments})")
        _positive("outer_lr", self.outer_lr)
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.nesterov and self.outer_momentum == 0:
            raise ConfigError("nesterov needs a positive outer_momentum")
        object.__setattr__(self, "compression", CompressionType(self.compression))

    @property
    def steps_per_round(self) -> int:
        """Inner steps between two rounds (each round syncs one fragment)."""
        return self.local_steps // self.fragments
