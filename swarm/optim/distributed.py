"""One swarm peer from a `torchrun` job: a machine's local ranks train as one member of the swarm.

Every local rank builds the same training mode (large-batch or DiLoCo) over its own replica of the
model and feeds it its own batches. Rank 0 alone runs `swarm.Optimizer` (and the `swarm.Peer`
under it): it decides, as any peer does, when a round is due, whether to catch up or download the
state, and what to apply. Its mode is a `MirroredMode`, which tells the other ranks every change it
makes to the mode, in order, over torch.distributed (gloo on CPU, NCCL on GPU), and each of them
makes the same change to its own mode (`serve_rank0`):

- a batch: each rank adds its own gradients (large-batch) or takes its own inner step (DiLoCo);
  rank 0 counts the machine's samples, so progress reports carry the whole machine's batch;
- a round's contribution: the ranks' local means (or pseudo-gradients) are averaged among them,
  weighted by samples, before rank 0 averages that one machine contribution with the swarm;
- a round's result, a missed round's result, a downloaded state: rank 0 broadcasts it, and every
  rank applies the same step to the same values, so the shared tensors stay identical on every
  rank (and on every other peer of the swarm);
- a round in which rank 0 stepped alone: it takes the machine's own mean from rank 1, whose
  buffers no averaging touched.

While a large-batch round is in flight with `CollaborationConfig.trial_step`, each rank's trial
step moves its parameters by its own window's mean, so the ranks compute their next batches at
slightly different points; the trial is undone before the real step, and what the ranks hold
alike (`shared_tensors`) never includes it. Changes that carry no data (a batch, an overlap, an
aborted round) are queued on rank 0 and sent with the next change that does, or with the end of
rank 0's call: most steps cost the other ranks one small all-reduce and one small broadcast.

So the swarm sees one peer per machine: one record, one member of each group, one state server
(a newcomer's download is served once per machine), and one exchange per round crosses the
network. Why rank 0 talks for the machine rather than every rank averaging a shard of the tensors
with the swarm: docs/operations.md, "A multi-GPU machine as one peer".

The training integrations build it through `swarm_optimizer` (a `swarm.Optimizer` for a process on
its own, this in a job of several ranks), so that a `SwarmTrainer` script run under torchrun is one
peer per machine unchanged.

Sharded models (FSDP, DTensor parameters) are refused: a rank's replica must hold the whole model
for the ranks' steps to be the same step.

Faults: a command that fails on rank 0 (an error of the swarm optimizer) fails the call on every
rank alike (`LocalRankError` on the others), after the ranks applied the same changes; so does a
rank 0 that cannot join the swarm before the optimizer is built (`agree_started`, called by
`SwarmSession`). A rank that
dies breaks the process group: the next collective fails on the survivors, nothing further is
applied (a contribution whose reduction among the ranks failed never reaches the swarm: the round
is launched only after it), and torchrun stops the job; rank 0 then leaves the swarm (`DistributedOptimizer.shutdown`
withdraws its record without talking to the dead rank).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, Unpack

import torch
import torch.distributed as dist

from swarm.core.errors import ConfigError, SwarmError
from swarm.dht.handle import PeerHandle
from swarm.optim.config import CollaborationConfig
from swarm.optim.mode import TrainingMode
from swarm.optim.optimizer import Optimizer, OptimizerFactory, OptimizerOptions, build_mode, check_options
from swarm.optim.outcome import RoundOutcome, StepOutcome
from swarm.optim.progress import SwarmProgress
from swarm.optim.training_state import TrainingState

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LocalRankError(SwarmError):
    """A local rank could not follow rank 0 (rank 0's call failed, or the ranks disagree)."""


class _Op(enum.IntEnum):
    """What rank 0 tells the other ranks to do next (a command is an op and an integer)."""

    DONE = 0  # rank 0's call returned None; the integer: its epoch
    DONE_STEP = 11  # it returned StepOutcome(epoch) and nothing more
    DONE_OBJECT = 12  # it returned something else, pickled next
    FAIL = 1
    ON_BATCH = 2
    PREPARE = 3
    OVERLAP = 4
    APPLY = 5
    STEP_ALONE = 6
    ABORT = 7
    APPLY_RESULT = 8
    DISCARD = 9
    LOAD_STATE = 10


# Commands that need no data from rank 0 (a batch, an overlap, an aborted round) wait on rank 0 and
# travel with the next one that does, or with the end of rank 0's call: on most steps the other
# ranks get one small broadcast, not one per change.
MAX_COMMANDS = 8


class LocalRanks:
    """The local ranks of one peer and the collectives among them (a torch.distributed group).

    Tensors travel in flat buffers, one per dtype (one collective each), on the group's device:
    the current CUDA device for NCCL, the CPU for gloo.

    Args:
        group: the process group of this machine's ranks (default: the whole job).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized: call dist.init_process_group() first "
                              "(torchrun sets the environment it reads)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, commands: Sequence[tuple[_Op, int]]) -> None:
        """On rank 0: sends `commands`, in order, to the other ranks (`receive`), up to
        `MAX_COMMANDS` in one broadcast."""
        for start in range(0, len(commands), MAX_COMMANDS):
            self._header(commands[start:start + MAX_COMMANDS])

    def receive(self) -> list[tuple[_Op, int]]:
        """On another rank: the next commands rank 0 sent."""
        return self._header([])

    def _header(self, commands: Sequence[tuple[_Op, int]]) -> list[tuple[_Op, int]]:
        header = torch.zeros(1 + 2 * MAX_COMMANDS, dtype=torch.int64)
        header[0] = len(commands)
        for i, (op, arg) in enumerate(commands):
            header[1 + 2 * i], header[2 + 2 * i] = int(op), arg
        header = header.to(self.device)
        dist.broadcast(header, self._global(0), group=self.group)
        values = header.tolist()
        return [(_Op(values[1 + 2 * i]), values[2 + 2 * i]) for i in range(values[0])]

    def sum_int(self, value: int) -> int:
        """The sum of `value` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return int(t[0])

    def average(self, tensors: Sequence[torch.Tensor], weight: float) -> float:
        """Replaces `tensors` on every rank by the ranks' mean weighted by `weight`; returns the
        sum of the weights."""
        total = torch.tensor([float(weight)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.group)
        weights = float(total[0])
        for group in _by_dtype(tensors):
            flat = self._flatten(group)
            flat.mul_(weight / weights)
            dist.all_reduce(flat, group=self.group)
            _unflatten(flat, group)
        return weights

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Copies `tensors` of rank `src` into the same-shaped `tensors` of every other rank."""
        for group in _by_dtype(tensors):
            flat = self._flatten(group) if self.rank == src else torch.empty(
                sum(t.numel() for t in group), dtype=group[0].dtype, device=self.device)
            dist.broadcast(flat, self._global(src), group=self.group)
            if self.rank != src:
                _unflatten(flat, group)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's picklable `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, self._global(0), group=self.group, device=self.device)
        return box[0]

    def broadcast_state(self, state: TrainingState | None) -> TrainingState:
        """Rank 0's training state (parameters, optimizer and scheduler state, epoch) on every rank."""
        if state is not None:  # rank 0
            tensors, metadata = state.to_wire()
            self.broadcast_object((metadata, [(tuple(t.shape), t.dtype) for t in tensors]))
            self.broadcast(tensors)
            return state
        received, specs = _state_description(self.broadcast_object())
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        self.broadcast(tensors)
        return TrainingState.from_wire(tensors, received)

    def _flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).to(self.device) for t in tensors])


def _state_description(received: object) -> tuple[object, list[tuple[tuple[int, ...], torch.dtype]]]:
    """The (metadata, tensor shapes and dtypes) of a training state rank 0 sent (`broadcast_state`)."""
    if isinstance(received, tuple) and len(received) == 2 and isinstance(received[1], list):
        specs = [(tuple(int(n) for n in shape), dtype) for shape, dtype in (
            spec for spec in received[1] if isinstance(spec, tuple) and len(spec) == 2)
            if isinstance(shape, tuple) and isinstance(dtype, torch.dtype)]
        if len(specs) == len(received[1]):
            return received[0], specs
    raise LocalRankError("rank 0 sent a malformed description of its training state")


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class MirroredMode:
    """Rank 0's training mode: each change goes to the other ranks' modes first (`serve_rank0`).

    Args:
        inner: rank 0's own mode (over its own replica).
        ranks: the machine's local ranks.
    """

    def __init__(self, inner: TrainingMode, ranks: LocalRanks) -> None:
        self.inner = inner
        self.ranks = ranks
        self.name = inner.name
        self.optimizer = inner.optimizer
        self.paced_alone = inner.paced_alone
        self.catches_up = inner.catches_up
        self.own_batch = 0  # this rank's samples in the batch being taken in
        self.machine_batch = 0  # every rank's
        self._samples = 0  # the machine's samples in the current round
        self._in_flight_samples = 0  # the machine's samples in the round being averaged
        self._detached = False
        self._queue: list[tuple[_Op, int]] = []  # commands not sent yet (they need no data)

    def detach(self) -> None:
        """The other ranks are gone (one died): from now on changes are made to rank 0's mode alone,
        so that rank 0 can still leave the swarm cleanly."""
        self._detached = True

    def _tell(self, op: _Op, arg: int = 0, *, now: bool = False) -> bool:
        """Queues the command for the other ranks (`now`: sends it with the queue, because data
        follows); False when there are none to follow it."""
        if self._detached:
            return False
        self._queue.append((op, arg))
        if now:
            self.flush()
        return self.ranks.size > 1

    def flush(self, *last: tuple[_Op, int]) -> None:
        """Sends the queued commands, then `last`."""
        if not self._detached:
            commands, self._queue = [*self._queue, *last], []
            self.ranks.send(commands)

    @property
    def averaged_fragments(self) -> list[list[torch.Tensor]]:
        return self.inner.averaged_fragments

    def fragment_of(self, epoch: int) -> int:
        return self.inner.fragment_of(epoch)

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        return self.inner.shared_tensors

    @property
    def samples(self) -> int:
        """The machine's samples (every rank's) in the current round."""
        return self._samples

    def on_batch(self, batch_size: int) -> None:
        self._tell(_Op.ON_BATCH)
        self.inner.on_batch(self.own_batch)
        self._samples += batch_size

    def wants_round(self, progress: SwarmProgress) -> bool:
        return self.inner.wants_round(progress)

    def eta(self, progress: SwarmProgress, samples_per_second: float) -> float:
        # the inner mode paces this rank's own batches; the rate counts the machine's
        share = self.own_batch / self.machine_batch if self.machine_batch else 1.0
        return self.inner.eta(progress, samples_per_second * share)

    def prepare_round(self, epoch: int) -> float:
        shared = self._tell(_Op.PREPARE, epoch, now=True)
        weight = self.inner.prepare_round(epoch)
        if shared:
            weight = self.ranks.average(self.inner.averaged_fragments[self.inner.fragment_of(epoch)], weight)
        self._in_flight_samples, self._samples = self._samples, 0
        return weight

    def overlap(self, epoch: int) -> None:
        self._tell(_Op.OVERLAP, epoch)
        self.inner.overlap(epoch)

    def apply_round(self, epoch: int) -> None:
        if self._tell(_Op.APPLY, epoch, now=True):
            self.ranks.broadcast(self.inner.averaged_fragments[self.inner.fragment_of(epoch)])
        self.inner.apply_round(epoch)
        self._in_flight_samples = 0

    def step_alone(self, epoch: int) -> None:
        if not self._tell(_Op.STEP_ALONE, epoch, now=True):
            self.inner.step_alone(epoch)
        else:
            # the machine's own mean, from a rank whose buffers no averaging touched
            self.ranks.broadcast(self.inner.averaged_fragments[self.inner.fragment_of(epoch)], src=1)
            self.inner.apply_round(epoch)
        self._in_flight_samples = 0

    def abort_round(self, epoch: int) -> None:
        self._tell(_Op.ABORT, epoch)
        self.inner.abort_round(epoch)
        self._samples += self._in_flight_samples
        self._in_flight_samples = 0

    def round_result(self) -> list[torch.Tensor]:
        return self.inner.round_result()

    def apply_result(self, result: list[torch.Tensor]) -> None:
        if self._tell(_Op.APPLY_RESULT, now=True):
            self.ranks.broadcast(result)
        self.inner.apply_result(result)

    def discard(self) -> int:
        self._tell(_Op.DISCARD)
        self.inner.discard()
        discarded = self._samples + self._in_flight_samples
        self._samples = self._in_flight_samples = 0
        return discarded

    def state(self, epoch: int) -> TrainingState:
        return self.inner.state(epoch)

    def load_state(self, state: TrainingState) -> None:
        state.check_compatible(self.inner.shared_tensors)  # refused before any rank changes
        if self._tell(_Op.LOAD_STATE, now=True):
            self.ranks.broadcast_state(state)
        self.inner.load_state(state)
        self._samples = self._in_flight_samples = 0


def serve_rank0(mode: TrainingMode, ranks: LocalRanks, own_batch: int = 0) -> tuple[object, int]:
    """On a rank other than 0: makes rank 0's changes to this rank's `mode`, in order, until rank 0's
    call ends; returns what that call returned and rank 0's epoch then (pickled from rank 0).

    Raises:
        LocalRankError: rank 0's call failed (after the changes it made were made here too), or a
            change rank 0 made failed here.
    """
    failed: str | None = None
    while True:
        for op, arg in ranks.receive():
            if op in (_Op.DONE, _Op.DONE_STEP, _Op.DONE_OBJECT):
                result: object = (None if op == _Op.DONE else StepOutcome(arg) if op == _Op.DONE_STEP
                               else ranks.broadcast_object())
                if failed is not None:
                    raise LocalRankError(f"local rank {ranks.rank} could not follow rank 0: {failed}")
                return result, arg
            if op == _Op.FAIL:
                raise LocalRankError(f"rank 0 failed: {ranks.broadcast_object()}")
            try:
                _follow(mode, ranks, op, arg, own_batch)
            except (ValueError, RuntimeError, SwarmError) as e:
                # the collectives of the command are done: keep in step with rank 0 until its call ends
                logger.error("local rank %d: %s failed: %s", ranks.rank, op.name, e)
                failed = failed or f"{op.name}: {type(e).__name__}: {e}"


def _follow(mode: TrainingMode, ranks: LocalRanks, op: _Op, epoch: int, own_batch: int) -> None:
    """One change of rank 0's, with the same collectives as `MirroredMode`'s in the same order."""
    if op == _Op.ON_BATCH:
        mode.on_batch(own_batch)
    elif op == _Op.PREPARE:
        weight = mode.prepare_round(epoch)
        ranks.average(mode.averaged_fragments[mode.fragment_of(epoch)], weight)
    elif op == _Op.OVERLAP:
        mode.overlap(epoch)
    elif op in (_Op.APPLY, _Op.STEP_ALONE):
        src = 0 if op == _Op.APPLY else 1
        if ranks.size > 1:
            ranks.broadcast(mode.averaged_fragments[mode.fragment_of(epoch)], src=src)
        mode.apply_round(epoch)
    elif op == _Op.ABORT:
        mode.abort_round(epoch)
    elif op == _Op.APPLY_RESULT:
        result = [torch.empty_like(t) for t in mode.round_result()]
        ranks.broadcast(result)
        mode.apply_result(result)
    elif op == _Op.DISCARD:
        mode.discard()
    elif op == _Op.LOAD_STATE:
        mode.load_state(ranks.broadcast_state(None))
    else:
        raise LocalRankError(f"unknown command {op!r} from rank 0")


def job_ranks(group: dist.ProcessGroup | None = None) -> LocalRanks | None:
    """This process's local ranks when it is one of several ranks of an initialized torch.distributed
    job (a `torchrun` job, or a framework that started one, as transformers' `Trainer` does under
    torchrun); None for a process on its own, which is a peer of its own."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return None
    return LocalRanks(group)


def is_following_rank() -> bool:
    """True on a rank other than 0 of a torch.distributed job: a rank that starts no `swarm.Peer`,
    because rank 0's peer is the machine's."""
    ranks = job_ranks()
    return ranks is not None and ranks.rank != 0


def agree_started(error: Exception | None) -> None:
    """In a job, where every rank calls it at the same point, after its own part of joining the
    swarm (rank 0: starting its `swarm.Peer`, the model check; `error`: how that failed, None if it
    did not): every rank learns whether any rank failed before any of them waits on the others in a
    collective that a failed rank would never reach. A rank whose own part failed returns (its
    caller raises its own error); the others raise `LocalRankError` with rank 0's reason. Outside a
    job it does nothing.

    Raises:
        LocalRankError: this rank's part went well and another rank's failed.
    """
    ranks = job_ranks()
    if ranks is None or not ranks.sum_int(int(error is not None)):
        return
    reason = ranks.broadcast_object(f"{type(error).__name__}: {error}" if ranks.rank == 0 and error is not None
                                    else None)
    if error is None:
        raise LocalRankError(f"local rank {ranks.rank}: " + (
            f"rank 0 could not join the swarm: {reason}" if isinstance(reason, str)
            else "another local rank could not join the swarm (see its error)"))


def machine_peer_id(peer: PeerHandle | None) -> str:
    """The PeerID of the machine's peer on every rank: `peer`'s own outside a job; in a job (where
    every rank calls it at the same point) rank 0's `peer`, sent to the others."""
    ranks = job_ranks()
    if ranks is None or ranks.rank == 0:
        if peer is None:
            raise ConfigError("the process that talks to the swarm (rank 0 of a job) needs its swarm.Peer")
        if ranks is None:
            return peer.peer_id
    peer_id = ranks.broadcast_object(peer.peer_id if peer is not None else None)
    if not isinstance(peer_id, str):
        raise LocalRankError(f"rank 0 sent no PeerID (got {type(peer_id).__name__})")
    return peer_id


def check_not_sharded(params: Sequence[torch.Tensor], ranks: LocalRanks) -> None:
    """Raises ConfigError unless every rank holds the whole model (same shapes on every rank, no
    FSDP flat parameters or DTensors): a sharded model's ranks hold different parts, and the
    mode's step on rank 0 would not be the step of the others."""
    from torch.distributed.fsdp._flat_param import FlatParameter
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, (DTensor, FlatParameter)):
            raise ConfigError(
                f"swarm.DistributedOptimizer needs every local rank to hold the whole model; got a sharded "
                f"{type(p).__name__} (FSDP or DTensor): give it the parameters of a whole replica on each rank "
                f"(docs/operations.md, 'A multi-GPU machine as one peer')")
    shapes = [tuple(p.shape) for p in params]
    everyone = [None] * ranks.size
    dist.all_gather_object(everyone, shapes, group=ranks.group)
    if any(s != shapes for s in everyone):
        raise ConfigError("the local ranks hold parameters of different shapes (a sharded or different model): "
                          "swarm.DistributedOptimizer needs every rank to hold the whole, same model")


def swarm_optimizer(peer: PeerHandle | None, run_id: str, params: Iterable[torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer | OptimizerFactory, target_batch_size: int | None = None,
                    **options: Unpack[OptimizerOptions]) -> Optimizer | DistributedOptimizer:
    """`swarm.Optimizer` for a process on its own, `DistributedOptimizer` for a rank of a
    torch.distributed job (`job_ranks`): what a training integration builds, so that the same script
    runs as one peer per process or, under `torchrun`, as one peer per machine. Rank 0 passes its
    peer, the other ranks None (`is_following_rank`)."""
    if job_ranks() is None:
        if peer is None:
            raise ConfigError("a process on its own is a peer: pass its swarm.Peer")
        return Optimizer(peer, run_id, params, optimizer, target_batch_size, **options)
    return DistributedOptimizer(peer, run_id, params, optimizer, target_batch_size, **options)


def _expect(value: object, kind: type[T]) -> T:
    """`value`, the result of rank 0's call that this rank followed, if it is a `kind`."""
    if not isinstance(value, kind):
        raise LocalRankError(f"rank 0's call returned a {type(value).__name__}, not a {kind.__name__}")
    return value


class DistributedOptimizer:
    """`swarm.Optimizer` for a `torchrun --nproc-per-node K` job: the machine is one swarm peer.

    Every local rank constructs it and calls the same methods in the same order (`step`,
    `zero_grad`, `flush`, `load_state_from_peers`, `shutdown`), as with DistributedDataParallel.
    Rank 0 passes its `swarm.Peer`; the other ranks pass None. The model needs no
    DistributedDataParallel: gradients are reduced here, once per round, not on every backward.
    Wrapped in it anyway (transformers' `Trainer` does, under torchrun), each rank's gradients are
    already the ranks' mean: the same step, at the cost of an all-reduce per backward.

    Example (one command per machine: ``torchrun --nproc-per-node 4 train.py``)::

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        peer = swarm.Peer(initial_peers=[...], identity_path="id.key") if dist.get_rank() == 0 else None
        opt = swarm.DistributedOptimizer(peer, run_id="my-run", params=model.parameters(),
                                         optimizer=lambda ps: torch.optim.Adam(ps), target_batch_size=4096)
        for x, y in data:                      # each rank its own share of the data
            loss_fn(model(x), y).backward()
            opt.step(len(x))                   # this rank's batch; the machine's counts in the swarm
            opt.zero_grad()

    Args:
        peer: rank 0's `swarm.Peer`; None on the other ranks.
        group: the process group of this machine's ranks (default: the whole job).
        The others: as `swarm.Optimizer`'s (`OptimizerOptions`; factories are called on every
            rank), but for `mode_wrapper`, which is this class's own.

    Raises:
        ConfigError: torch.distributed not initialized, a peer on a rank other than 0 (or none on
            rank 0), a sharded model, and whatever `swarm.Optimizer` refuses.
    """

    def __init__(
        self,
        peer: PeerHandle | None,
        run_id: str,
        params: Iterable[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        target_batch_size: int | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        **options: Unpack[OptimizerOptions],
    ) -> None:
        check_options(options, "swarm.DistributedOptimizer")
        if "mode_wrapper" in options:
            raise TypeError("swarm.DistributedOptimizer wraps the mode itself (its local ranks follow rank 0's): "
                            "mode_wrapper is not one of its arguments")
        self.ranks = LocalRanks(group)
        misplaced = (peer is None) != (self.ranks.rank != 0)
        if self.ranks.sum_int(int(misplaced)):  # refused on every rank, so that none waits for the others
            raise ConfigError(f"local rank {self.ranks.rank}: rank 0 passes its swarm.Peer and the other ranks "
                              f"pass None (got {'none' if peer is None else 'a peer'} here; "
                              f"{'this rank' if misplaced else 'another rank'} is wrong)")
        self.params = list(params)
        self.batch_size_per_step = options.get("batch_size_per_step")
        check_not_sharded(self.params, self.ranks)
        self.ranks.broadcast(self.params)  # every rank starts from rank 0's initial parameters
        self.swarm: Optimizer | None = None
        self._mirror: MirroredMode | None = None
        self._mode: TrainingMode
        self._closed = False
        self._epoch = 0
        if peer is not None:
            def wrap(mode: TrainingMode) -> TrainingMode:
                self._mirror = MirroredMode(mode, self.ranks)
                return self._mirror

            wrapped: OptimizerOptions = {**options, "mode_wrapper": wrap}
            self.swarm = self._on_rank0(lambda: Optimizer(peer, run_id, self.params, optimizer, target_batch_size,
                                                          **wrapped))
            assert self._mirror is not None
            self._mode = self._mirror.inner
        else:
            config = options.get("config") or CollaborationConfig()
            self._mode = build_mode(self.params, optimizer, options.get("scheduler"), options.get("diloco"), config)
            self._follow()

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's torch optimizer (the inner one in DiLoCo mode)."""
        return self._mode.optimizer

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """What every rank, and every peer of the swarm at the same epoch, holds alike
        (`swarm.Optimizer.shared_tensors`)."""
        return self._mode.shared_tensors

    def step(self, batch_size: int | None = None) -> StepOutcome:
        """Takes in this rank's batch (its gradients are in `param.grad`); every rank calls it.

        Returns:
            Rank 0's `StepOutcome` on every rank: the machine's step.
        """
        batch_size = batch_size or self.batch_size_per_step
        if not batch_size or batch_size < 1:
            raise ValueError("pass batch_size to step() or batch_size_per_step to the constructor")
        machine = self.ranks.sum_int(batch_size)
        if self.swarm is None:
            return _expect(self._follow(batch_size), StepOutcome)
        assert self._mirror is not None
        self._mirror.own_batch, self._mirror.machine_batch = batch_size, machine
        swarm = self.swarm
        return self._on_rank0(lambda: swarm.step(machine))

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Blocks every rank until at least `count` peers (this machine included) report progress;
        False on timeout (`swarm.Optimizer.wait_for_peers`)."""
        swarm = self.swarm
        if swarm is None:
            return _expect(self._follow(), bool)
        return self._on_rank0(lambda: swarm.wait_for_peers(count, timeout))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears this rank's gradients."""
        self._mode.optimizer.zero_grad(set_to_none=set_to_none)

    def flush(self) -> RoundOutcome | None:
        """Lands the round in flight on every rank (`swarm.Optimizer.flush`)."""
        swarm = self.swarm
        if swarm is None:
            landed = self._follow()
            return None if landed is None else _expect(landed, RoundOutcome)
        return self._on_rank0(swarm.flush)

    def load_state_from_peers(self, min_epoch: int = 0) -> bool:
        """Downloads the swarm's state on rank 0 and lands it in every rank."""
        swarm = self.swarm
        if swarm is None:
            return _expect(self._follow(), bool)
        return self._on_rank0(lambda: swarm.load_state_from_peers(min_epoch))

    def state_dict(self) -> dict[str, Any]:
        """The epoch, mode state and optimizer state, for a local checkpoint (the same on every rank:
        `swarm.Optimizer.state_dict`)."""
        if self.swarm is not None:
            return self.swarm.state_dict()
        tensors, metadata = self._mode.state(self._epoch).clone().to_wire()
        return {"tensors": tensors, "metadata": metadata}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads rank 0's `state` into every rank (the other ranks' `state` is not read)."""
        swarm = self.swarm
        if swarm is None:
            self._follow()
            return
        self._on_rank0(lambda: swarm.load_state_dict(state))

    @property
    def epoch(self) -> int:
        """Collective steps taken (rank 0's count, which the others learn at the end of each call)."""
        return self.swarm.epoch if self.swarm is not None else self._epoch

    @property
    def progress(self) -> SwarmProgress:
        """The swarm's progress as rank 0 sees it (`swarm.Optimizer.progress`).

        Raises:
            LocalRankError: on another rank, which does not read the swarm's records.
        """
        if self.swarm is None:
            raise LocalRankError(f"local rank {self.rank} does not see the swarm's progress: only rank 0 does")
        return self.swarm.progress

    def shutdown(self) -> None:
        """Leaves the swarm (rank 0 withdraws its record); every rank calls it. After a rank died,
        rank 0 leaves without the dead rank: what the round in flight held is dropped."""
        if self._closed:
            return
        self._closed = True
        if self.swarm is None:
            try:
                self._follow()
            except (RuntimeError, LocalRankError) as e:
                logger.info("local rank %d: leaving without rank 0 (%s)", self.rank, e)
            return
        swarm = self.swarm
        try:
            self._on_rank0(swarm.shutdown)
        except RuntimeError as e:
            logger.warning("the local ranks are gone (%s): leaving the swarm without them", e)
            assert self._mirror is not None
            self._mirror.detach()
            swarm.shutdown()

    def _on_rank0(self, call: Callable[[], T]) -> T:
        """Runs `call` on rank 0 while the other ranks follow its changes (`serve_rank0`); ends with
        DONE and the result for them, or FAIL and the error."""
        try:
            result = call()
        except BaseException as e:
            try:
                self._send_last((_Op.FAIL, 0))
                self.ranks.broadcast_object(f"{type(e).__name__}: {e}")
            except RuntimeError:
                pass  # the ranks are gone: the error above is the one to raise
            raise
        epoch = self.swarm.epoch if self.swarm is not None else 0
        if result is None or isinstance(result, Optimizer):
            self._send_last((_Op.DONE, epoch))
        elif isinstance(result, StepOutcome) and result == StepOutcome(epoch):
            self._send_last((_Op.DONE_STEP, epoch))
        else:
            self._send_last((_Op.DONE_OBJECT, epoch))
            self.ranks.broadcast_object(result)
        return result

    def _send_last(self, command: tuple[_Op, int]) -> None:
        """Sends what rank 0's mode still queues, then `command`, the end of rank 0's call."""
        if self._mirror is not None:
            self._mirror.flush(command)
        else:
            self.ranks.send([command])

    def _follow(self, own_batch: int = 0) -> object:
        """On a rank other than 0: follows rank 0's call (`serve_rank0`); returns its result."""
        result, self._epoch = serve_rank0(self._mode, self.ranks, own_batch)
        return result

    def __repr__(self) -> str:
        return f"swarm.DistributedOptimizer(rank={self.rank}/{self.ranks.size}, epoch={self.epoch})"


__all__ = [
    "DistributedOptimizer", "LocalRankError", "LocalRanks", "MirroredMode", "is_following_rank", "job_ranks",
    "machine_peer_id", "serve_rank0", "swarm_optimizer",
]
