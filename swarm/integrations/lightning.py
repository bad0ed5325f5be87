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

One process trains one device (as `HivemindStrategy`). Under `torchrun --nproc-per-node K` the
job's K processes are one peer, as a `SwarmTrainer` job is (docs/operations.md, "A multi-GPU
machine as one peer"): the strategy starts the job's process group (gloo on CPUs, NCCL on GPUs) when
nothing did, rank 0 alone runs the `swarm.Peer`, each rank trains on `cuda:LOCAL_RANK` (or the CPU)
and draws its own share of the data in the order rank 0's PeerID seeds (`sampler`), the optimizer
is a `swarm.DistributedOptimizer` (the ranks' gradients are reduced once per collective step, not
on every backward as DDP would), rank 0 alone writes checkpoints and logs, and Lightning's
broadcasts, barriers and decisions (to save a checkpoint, to stop early) span the job. The model
is not wrapped in DistributedDataParallel. To Lightning's data and logging the strategy is not a
distributed one: it injects no DistributedSampler (`sampler` gives each rank its share), a value
logged with `sync_dist` is rank 0's own, and validation runs whole on every rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from swarm.core.errors import ConfigError
from swarm.integrations import session as swarm_session
from swarm.integrations.data import PeerShardSampler, peer_seed
from swarm.integrations.session import SwarmArguments
from swarm.optim.distributed import agree_started, is_following_rank, job_ranks, machine_peer_id
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
        local_rank = _start_job_group(device)
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, **kwargs)
        ranks = job_ranks()
        if ranks is not None:  # a torchrun job: its ranks are one peer, rank 0's
            self.global_rank, self.local_rank, self.world_size = ranks.rank, local_rank, ranks.size
            # Lightning's rank-zero-only logging reads the rank from the environment at import: a
            # group started without torchrun's variables would log on every rank (DDPStrategy sets it so too)
            rank_zero_only.rank = utils_rank_zero_only.rank = ranks.rank  # type: ignore[attr-defined]  # a function attribute
        self._ranks = ranks
        self.swarm = swarm
        self.max_collective_steps = max_collective_steps
        self.max_grad_norm = max_grad_norm
        self._owns_peer = peer is None and not is_following_rank()
        self.peer: Peer | None = peer
        try:
            if self._owns_peer:
                self.peer = swarm.start_peer()
        except Exception as e:
            agree_started(e)  # in a job, the other ranks raise too rather than wait for rank 0
            raise
        agree_started(None)
        self._machine_id = machine_peer_id(self.peer)  # in a job, a collective: every rank builds the strategy
        self.session: swarm_session.SwarmSession | None = None
        self._adapter: swarm_session.SwarmTorchOptimizer | None = None
        self._sampler: PeerShardSampler | None = None
        self._trainer: Trainer | None = None
        self._ended_at = 0
        if self.peer is not None:
            logger.info("[%s] to train with this peer, run the same script elsewhere with %s=\"%s\"", swarm.run_id,
                        "SWARM_INITIAL_PEERS", " ".join(self.peer.addrs))

    def sampler(self, num_samples: int) -> PeerShardSampler:
        """This peer's endless, resumable order of a dataset (pass it to the training DataLoader); in
        a torchrun job, this rank's share of it."""
        ranks = self._ranks
        self._sampler = PeerShardSampler(num_samples, peer_seed(self._machine_id, self.swarm.run_id),
                                         *((ranks.rank, ranks.size) if ranks is not None else ()))
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
            if self._owns_peer and self.peer is not None:
                self.peer.shutdown()

    # -- a torchrun job: Lightning's collectives span its ranks (one process: what SingleDeviceStrategy does)

    @property
    def is_global_zero(self) -> bool:
        return self._ranks is None or self._ranks.rank == 0

    def barrier(self, *args: object, **kwargs: object) -> None:
        if self._ranks is not None:
            dist.barrier(group=self._ranks.group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._ranks is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=self._ranks.group)
        return box[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """One decision for the job (a checkpoint is saved by every rank's call or by none)."""
        if self._ranks is None:
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, group=self._ranks.group)
        return bool(votes.item() == self._ranks.size) if all else bool(votes.item() > 0)


def _start_job_group(device: str | torch.device | None) -> int:
    """Under torchrun (WORLD_SIZE > 1 in the environment) starts the job's process group unless
    something did (gloo on CPUs, NCCL on GPUs) and selects this rank's GPU; returns LOCAL_RANK
    (0 outside a job)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world < 2:
        return 0
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if on_gpu:
        torch.cuda.set_device(local_rank if device is None else torch.device(device))
    if dist.is_available() and not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
    return local_rank


__all__ = ["SwarmArguments", "SwarmStrategy"]
