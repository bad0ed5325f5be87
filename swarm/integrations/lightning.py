"""PyTorch Lightning in a swarm: `SwarmStrategy`, used as `Trainer(strategy=...)` (`pip install 'swarm-peer[lightning]'`).

    strategy = SwarmStrategy(SwarmArguments(run_id="my-run", target_batch_size=4096))
    loader = DataLoader(dataset, batch_size=32, sampler=strategy.sampler(len(dataset)))
    Trainer(strategy=strategy, max_steps=10_000).fit(module, loader)

What users of lightning-hivemind's `HivemindStrategy` kept, and the limits it had that this one does
not (docs/integrations.md, "Lightning"):

- kept: a target batch for the swarm and a run name; initial peers as an argument or from the
  environment (`SWARM_INITIAL_PEERS`), and a line in the log saying how others join; the local
  batch size taken from the batches themselves (here counted at every batch, so it may vary);
- `accumulate_grad_batches` works: the accumulated batches are one local batch of their summed size;
- the schedulers `configure_optimizers` returns are honoured (no `scheduler_fn`): the swarm steps
  them with its collective step, so every peer has the same rate at the same step;
- DiLoCo mode (`SwarmArguments.diloco`) besides large-batch;
- checkpoints hold the swarm's state (optimizer, step count, data position): `fit(ckpt_path=...)`
  resumes in the swarm; `max_collective_steps` stops at a step count of the swarm (Lightning's
  own `max_steps` counts this peer's optimizer steps);
- `max_grad_norm` clips the gradient a collective step applies (the swarm's mean), so peers stay
  identical; Lightning's `gradient_clip_val` still clips each local batch, as without a swarm;
- the model check: a peer with another model is refused, before any round.

One process trains one device (as `HivemindStrategy`); several GPUs of one machine are several peers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.types import LRSchedulerConfig

from swarm.core.errors import ConfigError
from swarm.integrations import session as swarm_session
from swarm.integrations.data import PeerShardSampler, peer_seed
from swarm.integrations.session import SwarmArguments
from swarm.peer import Peer

logger = logging.getLogger(__name__)


class SwarmStrategy(SingleDeviceStrategy):
    """A Lightning strategy whose optimizer steps are the swarm's.

    Args:
        swarm: how to join (run name, target batch or DiLoCo, initial peers, ...).
        device: the device this peer trains on (default: the first GPU if any, else the CPU).
        max_collective_steps: stop training when the swarm's step count reaches this (None: only
            the Trainer's own limits).
        max_grad_norm: clip the gradient each collective step applies to this norm (0: no clipping).
        peer: a running `swarm.Peer` to use; by default the strategy starts one (its PeerID seeds
            `sampler`) and stops it at teardown.
    """

    strategy_name = "swarm"
    # what this class reads of Lightning's Strategy (typed here: mypy does not follow lightning)
    optimizers: list[torch.optim.Optimizer]
    lr_scheduler_configs: list[LRSchedulerConfig]
    lightning_module: LightningModule

    def __init__(self, swarm: SwarmArguments, device: str | torch.device | None = None, *,
                 max_collective_steps: int | None = None, max_grad_norm: float = 0.0,
                 peer: Peer | None = None, **kwargs: object) -> None:
        if not isinstance(swarm, SwarmArguments):
            raise TypeError(f"swarm must be a SwarmArguments, got {type(swarm).__name__}")
        if max_collective_steps is not None and (not isinstance(max_collective_steps, int) or max_collective_steps < 1):
            raise ConfigError(f"max_collective_steps must be a positive int, got {max_collective_steps!r}")
        if max_grad_norm < 0:
            raise ConfigError(f"max_grad_norm must not be negative, got {max_grad_norm!r}")
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, **kwargs)
        self.swarm = swarm
        self.max_collective_steps = max_collective_steps
        self.max_grad_norm = max_grad_norm
        self._owns_peer = peer is None
        self.peer = peer if peer is not None else swarm.start_peer()
        self.session: swarm_session.SwarmSession | None = None
        self._adapter: swarm_session.SwarmTorchOptimizer | None = None
        self._sampler: PeerShardSampler | None = None
        self._trainer: Trainer | None = None
        self._ended_at = 0
        logger.info("[%s] to train with this peer, run the same script elsewhere with %s=\"%s\"", swarm.run_id,
                    "SWARM_INITIAL_PEERS", " ".join(self.peer.addrs))

    def sampler(self, num_samples: int) -> PeerShardSampler:
        """This peer's endless, resumable order of a dataset (pass it to the training DataLoader)."""
        self._sampler = PeerShardSampler(num_samples, peer_seed(self.peer.peer_id, self.swarm.run_id))
        if self.session is not None:
            self.session.sampler = self._sampler
        return self._sampler

    def setup(self, trainer: Trainer) -> None:
        self._trainer = trainer
        super().setup(trainer)

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ConfigError(f"SwarmStrategy trains with one optimizer, configure_optimizers returned "
                              f"{len(self.optimizers)}")
        if len(self.lr_scheduler_configs) > 1:
            raise ConfigError("SwarmStrategy takes at most one learning-rate scheduler")
        inner = self.optimizers[0]
        if isinstance(inner, swarm_session.SwarmTorchOptimizer):
            return  # set up again (a second fit): the session is in place
        config = self.lr_scheduler_configs[0] if self.lr_scheduler_configs else None
        scheduler = config.scheduler if config is not None else None
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigError(f"SwarmStrategy steps LRScheduler schedules, got {type(scheduler).__name__}")
        swarm_session.clip_before_step(inner, self.max_grad_norm)
        adapter = swarm_session.SwarmTorchOptimizer(inner)
        self.session, view = adapter.join(self.swarm, self.lightning_module, scheduler, peer=self.peer,
                                          resuming=bool(trainer.ckpt_path), sampler=self._sampler)
        self._adapter = adapter
        self.optimizers = [adapter]
        if config is not None:
            config.scheduler = view

    def training_step(self, *args: object, **kwargs: object) -> object:
        if self._adapter is not None:
            self._adapter.count(args[0] if args else kwargs.get("batch"))
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], object],
                       model: torch.nn.Module | None = None, **kwargs: object) -> object:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._adapter is not None:
            self._adapter.discard_samples()  # a step the gradient scaler skipped leaves its count there
        session = self.session
        if session is not None and self.max_collective_steps is not None and self._trainer is not None and (
                session.global_step >= self.max_collective_steps):
            self._trainer.should_stop = True
        return out

    @property
    def global_step(self) -> int:
        """The swarm's step count (collective steps; DiLoCo: the swarm's inner steps); after training,
        the count it ended at."""
        return self.session.global_step if self.session is not None else self._ended_at

    def teardown(self) -> None:
        session, self.session, self._adapter = self.session, None, None
        try:
            if session is not None:
                session.shutdown()
                self._ended_at = session.global_step
        finally:
            super().teardown()
            if self._owns_peer:
                self.peer.shutdown()


__all__ = ["SwarmArguments", "SwarmStrategy"]
