"""What every integration shares: a peer, the model check, a `swarm.Optimizer`, and a torch-optimizer face.

`SwarmSession` is the swarm side of a training loop someone already has. It starts (or takes) a
`swarm.Peer`, admits the model (`swarm.integrations.admission`: a peer with another model is refused
before any tensor is averaged), builds the `swarm.Optimizer` around the loop's own optimizer and
scheduler, and counts the run's steps the way the framework's step limits should count them:
`global_step` is the swarm's collective step (large-batch mode: `Optimizer.epoch`), or, in DiLoCo
mode, the inner steps the swarm has taken together (`epoch * steps_per_round` plus this peer's inner
steps since). Its `state_dict` is what a framework checkpoint must hold to resume in the swarm: the
optimizer's collaborative state, the step count and the data position (`PeerShardSampler`).

`SwarmTorchOptimizer` gives the session the face of a `torch.optim.Optimizer` (its parameter groups
and state are the wrapped optimizer's), so a framework that drives an optimizer (transformers'
`Trainer`, Lightning, `accelerate`'s `AcceleratedOptimizer` and its gradient scaler) drives the swarm:
its `step()` hands the accumulated local batch to `swarm.Optimizer.step`.

A plain loop, or one under `accelerate`, needs neither: it calls `swarm.Optimizer` directly
(docs/integrations.md, "accelerate and plain loops").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from swarm.core.errors import ConfigError
from swarm.integrations.admission import AdmissionConfig, ModelAdmission
from swarm.integrations.data import PeerShardSampler, peer_seed
from swarm.integrations.fingerprint import ModelFingerprint, model_fingerprint, scoped_prefix
from swarm.optim.config import CollaborationConfig, DiLoCoConfig
from swarm.optim.distributed import agree_started, is_following_rank, machine_peer_id, swarm_optimizer
from swarm.optim.group_averaging import make_swarm_averager
from swarm.optim.outcome import StepOutcome
from swarm.peer import Peer

logger = logging.getLogger(__name__)

INITIAL_PEERS_ENV = "SWARM_INITIAL_PEERS"


@dataclass(frozen=True)
class SwarmArguments:
    """How a training script joins a swarm (the same for every integration).

    Attributes:
        run_id: the run's name; peers with the same run_id (and the same model) train together.
        target_batch_size: samples the swarm accumulates per collective step (large-batch mode).
        diloco: DiLoCo's settings (local steps, outer optimizer); None for large-batch mode.
        collaboration: the `swarm.Optimizer`'s collaboration settings (timeouts, group size,
            overlap); its `target_batch_size` is replaced by the field above when that is set.
        initial_peers: multiaddrs of peers already in the swarm; empty: the `SWARM_INITIAL_PEERS`
            environment variable (space- or comma-separated), else this peer starts a new swarm.
        listen: the multiaddr this peer listens on.
        identity_path: the peer's key file; a peer restarted with the same file keeps its PeerID,
            and with it its data order (`PeerShardSampler`).
        client_mode: dial out only (behind NAT, in a notebook).
        min_peers: wait until this many peers (this one included) report before training.
        peers_timeout: seconds to wait for them; training starts anyway after it (logged).
        admission: how often the model check renews and reads fingerprints.
    """

    run_id: str
    target_batch_size: int | None = None
    diloco: DiLoCoConfig | None = None
    collaboration: CollaborationConfig = field(default_factory=CollaborationConfig)
    initial_peers: tuple[str, ...] = ()
    listen: str = "/ip4/0.0.0.0/tcp/0"
    identity_path: str | None = None
    client_mode: bool = False
    min_peers: int = 1
    peers_timeout: float = 60.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or any(c.isspace() for c in self.run_id):
            raise ConfigError(f"run_id must be a non-empty string without spaces, got {self.run_id!r}")
        if isinstance(self.initial_peers, str):
            raise TypeError("initial_peers is a sequence of multiaddrs, not one string")
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        if self.diloco is None and self.target_batch_size is None and self.collaboration.target_batch_size is None:
            raise ConfigError("large-batch mode needs target_batch_size (or pass diloco=DiLoCoConfig(...))")
        if self.target_batch_size is not None and (
                not isinstance(self.target_batch_size, int) or self.target_batch_size < 1):
            raise ConfigError(f"target_batch_size must be a positive int, got {self.target_batch_size!r}")
        if not isinstance(self.min_peers, int) or self.min_peers < 1:
            raise ConfigError(f"min_peers must be a positive int, got {self.min_peers!r}")
        if self.peers_timeout <= 0:
            raise ConfigError(f"peers_timeout must be positive, got {self.peers_timeout!r}")

    @property
    def config(self) -> CollaborationConfig:
        """The collaboration settings with the target batch filled in."""
        if self.target_batch_size is None:
            return self.collaboration
        return replace(self.collaboration, target_batch_size=self.target_batch_size)

    def peers_to_join(self) -> list[str]:
        """`initial_peers`, or the environment's `SWARM_INITIAL_PEERS`."""
        if self.initial_peers:
            return list(self.initial_peers)
        return os.environ.get(INITIAL_PEERS_ENV, "").replace(",", " ").split()

    def start_peer(self) -> Peer:
        """A new peer as these arguments say (initial peers, listen address, identity, client mode)."""
        return Peer(initial_peers=self.peers_to_join(), listen=self.listen, identity_path=self.identity_path,
                    client_mode=self.client_mode)


SchedulerLike = torch.optim.lr_scheduler.LRScheduler


class SwarmSession:
    """A training loop's membership in a swarm: peer, model check, `swarm.Optimizer`, step count.

    Args:
        args: how to join.
        model: the model trained (its trainable parameters are shared).
        optimizer: the loop's torch optimizer over the model's parameters (the inner one in
            DiLoCo mode).
        scheduler: its learning-rate scheduler, stepped with the collective step (large-batch) or
            every inner step (DiLoCo); None for a constant rate.
        peer: a running `swarm.Peer` to use; by default the session starts one (and stops it).
        fingerprint: the model's fingerprint, if the integration knows more than the module tells
            (a transformers config's `model_type` and `vocab_size`).
        sampler: the loop's `PeerShardSampler`, whose position the session's state keeps.

    Raises:
        ModelMismatchError: a peer of the run trains another model.
    """

    def __init__(self, args: SwarmArguments, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: SchedulerLike | None = None, *, peer: Peer | None = None,
                 fingerprint: ModelFingerprint | None = None, sampler: PeerShardSampler | None = None) -> None:
        self.args = args
        self.model = model
        # in a torchrun job, rank 0's peer is the machine's and the other ranks follow it (`swarm.optim.distributed`)
        following = is_following_rank()
        self._owns_peer = peer is None and not following
        self.peer: Peer | None = peer
        self.sampler = sampler
        self.inner_steps = 0  # DiLoCo: the swarm's inner steps, as this peer counts them
        self.admission: ModelAdmission | None = None
        try:
            try:
                if self._owns_peer:
                    self.peer = Peer(initial_peers=args.peers_to_join(), listen=args.listen,
                                     identity_path=args.identity_path, client_mode=args.client_mode)
                self.fingerprint = fingerprint or model_fingerprint(model)
                if self.peer is not None:
                    self.admission = ModelAdmission(self.peer, args.run_id, self.fingerprint, args.admission)
                    self.admission.admit()
                    self.peer.attach(self.admission)
            except Exception as e:
                # in a job, the other ranks would otherwise wait for rank 0 in the next collective
                # until the process group's timeout: they learn of the failure and raise too
                agree_started(e)
                raise
            agree_started(None)
            self.peer_id = machine_peer_id(self.peer)
            config = args.config
            compression = args.diloco.compression if args.diloco is not None else config.gradient_compression
            params = [p for p in model.parameters() if p.requires_grad]
            swarm_peer = self.peer
            self.optimizer = swarm_optimizer(
                swarm_peer, args.run_id, params, optimizer, scheduler=scheduler, diloco=args.diloco, config=config,
                averager_factory=None if swarm_peer is None else lambda tensors, prefix: make_swarm_averager(
                    swarm_peer, tensors, scoped_prefix(prefix, self.fingerprint), config, compression))
        except BaseException:
            if self._owns_peer and self.peer is not None:
                self.peer.shutdown()
            raise
        if self.peer is not None:
            logger.info("[%s] this peer: %s; others join with initial peers %s", args.run_id, self.peer.peer_id,
                        " ".join(self.peer.addrs) or "(client mode: join through another peer)")
        if args.min_peers > 1 and not self.optimizer.wait_for_peers(args.min_peers, args.peers_timeout) and (
                self.peer is not None):
            logger.warning("[%s] fewer than %d peers after %.0f s: training with %d", args.run_id, args.min_peers,
                           args.peers_timeout, self.optimizer.progress.num_peers)

    @property
    def diloco(self) -> bool:
        return self.args.diloco is not None

    @property
    def global_step(self) -> int:
        """The run's step count: collective steps (large-batch), or the swarm's inner steps (DiLoCo)."""
        return self.inner_steps if self.diloco else self.optimizer.epoch

    def make_sampler(self, num_samples: int) -> PeerShardSampler:
        """This peer's endless, resumable order of a dataset of `num_samples` (kept for checkpoints)."""
        self.sampler = PeerShardSampler(num_samples, peer_seed(self.peer_id, self.args.run_id))
        return self.sampler

    def step(self, batch_size: int) -> StepOutcome:
        """Hands one local batch (gradients in `param.grad`, the mean over its samples) to the swarm."""
        outcome = self.optimizer.step(batch_size)
        if self.args.diloco is not None:
            self.inner_steps += 1
            if outcome.state_loaded:  # the downloaded state starts a round: count from its epoch
                self.inner_steps = self.optimizer.epoch * self.args.diloco.steps_per_round
        return outcome

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint must hold to resume in the swarm (optimizer, step count, data position)."""
        return {"swarm_optimizer": self.optimizer.state_dict(), "inner_steps": self.inner_steps,
                "sampler": self.sampler.state_dict() if self.sampler is not None else None}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resumes from `state_dict()`'s output; the swarm's newer state follows at the next step."""
        optimizer, inner_steps, sampler = (state.get(k) if isinstance(state, Mapping) else None
                                           for k in ("swarm_optimizer", "inner_steps", "sampler"))
        if not isinstance(optimizer, dict) or not isinstance(inner_steps, int) or not (
                sampler is None or isinstance(sampler, Mapping)):
            raise ValueError("not a swarm session state (expected the keys swarm_optimizer, inner_steps, sampler)")
        self.optimizer.load_state_dict(optimizer)
        self.inner_steps = inner_steps
        if sampler is not None and self.sampler is not None:
            self.sampler.load_state_dict(sampler)

    def shutdown(self) -> None:
        """Lands the round in flight, leaves the run, and stops the peer if the session started it."""
        try:
            self.optimizer.flush()
            self.optimizer.shutdown()
            if self.peer is not None and self.admission is not None:
                self.peer.run(self.admission.ashutdown(), timeout=self.args.admission.timeout + 5)
                self.peer.detach(self.admission)
        finally:
            if self._owns_peer and self.peer is not None:
                self.peer.shutdown()


class SwarmTorchOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose `step()` is the swarm's: what frameworks that drive an optimizer see.

    Its `param_groups`, `state` and `defaults` are the wrapped optimizer's (the learning rate a
    framework logs is the one the swarm's scheduler set). Until `bind` gives it a session it is
    that optimizer, unchanged (frameworks prepare the optimizer before the run's step count, which
    the scheduler needs, is known).

    The framework's training step counts each batch's samples (`count`); `step()` hands their sum
    to the swarm. A step the framework skips (fp16's gradient scaler found an inf) leaves its count
    behind: `discard_samples` drops it.

    Args:
        optimizer: the loop's own torch optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # like accelerate's AcceleratedOptimizer, it keeps no parameter groups of its own
        self.optimizer = optimizer
        self.session: SwarmSession | None = None
        self.samples = 0  # samples of the local batch being accumulated
        self.last_outcome: StepOutcome | None = None

    def bind(self, session: SwarmSession) -> None:
        if session.optimizer.optimizer is not self.optimizer:
            raise ValueError("the session must wrap this optimizer")
        self.session = session

    def join(self, swarm: SwarmArguments, model: torch.nn.Module, scheduler: SchedulerLike | None, *, peer: Peer | None,
             resuming: bool, fingerprint: ModelFingerprint | None = None,
             sampler: PeerShardSampler | None = None) -> tuple[SwarmSession, ScheduleView]:
        """Starts the session around this optimizer and binds to it; returns it and what the framework sees
        of the schedule. `resuming`: a checkpoint's state loads first, the swarm's newer one at the first step."""
        if resuming:
            swarm = replace(swarm, collaboration=replace(swarm.collaboration, load_state_on_start=False))
        session = SwarmSession(swarm, model, self.optimizer, scheduler, peer=peer, fingerprint=fingerprint,
                               sampler=sampler)
        self.bind(session)
        return session, ScheduleView(scheduler, self.optimizer)

    def count(self, batch: object) -> None:
        """Adds a batch's samples (`batch_size_of`) to the local batch the next `step()` hands over."""
        self.samples += batch_size_of(batch)

    def discard_samples(self) -> None:
        """Forgets the samples counted since the last step (one the framework skipped)."""
        self.samples = 0

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("a swarm's parameters are fixed once it trains: add parameter groups before it starts")

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Hands the local batch to the swarm (which steps the wrapped optimizer when it is time)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.session is None:
            raise ConfigError("this optimizer is not bound to a swarm session yet")
        batch, self.samples = self.samples, 0
        if batch < 1:
            raise ValueError("the batch being stepped holds no samples (count them before step())")
        self.last_outcome = self.session.step(batch)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if self.session is None:
            return self.optimizer.state_dict()
        return self.session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.session is None:
            self.optimizer.load_state_dict(state_dict)
        else:
            self.session.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"SwarmTorchOptimizer({self.optimizer.__class__.__name__}, {self.session and self.session.optimizer})"


class ScheduleView:
    """What a framework sees of the learning-rate schedule the swarm steps: its rates, no steps.

    The schedule belongs to `swarm.Optimizer` (stepped with the collective step); the framework's
    own `scheduler.step()` after each local step must not move it again.
    """

    def __init__(self, scheduler: SchedulerLike | None, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    def step(self, *args: object, **kwargs: object) -> None:
        """Does nothing: the swarm steps the schedule."""

    def get_last_lr(self) -> list[float]:
        if self.scheduler is not None:
            return [float(lr) for lr in self.scheduler.get_last_lr()]
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, object]:
        return {}  # the schedule's state travels with the session's (`SwarmSession.state_dict`)

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Nothing to load: the session's state holds the schedule's."""


def batch_size_of(batch: object) -> int:
    """Samples in a batch: the leading dimension of its first tensor (a tensor, a mapping, a sequence)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    values: Sequence[object] = list(batch.values()) if isinstance(batch, Mapping) else (
        batch if isinstance(batch, (list, tuple)) else [])
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, (Mapping, list, tuple)):
            found = batch_size_of(value)
            if found:
                return found
    return 0


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Clips the gradient `optimizer` applies to `max_norm` just before each of its steps: in a swarm, the
    swarm's mean (large-batch mode: every peer clips the same gradient) or the inner step's (DiLoCo)."""
    if max_norm <= 0:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def clip(_optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(clip)
