"""transformers' `Trainer` in a swarm: `SwarmTrainer`, a drop-in subclass (`pip install 'swarm-peer[transformers]'`).

    from swarm.integrations.transformers import SwarmTrainer
    from swarm.integrations.session import SwarmArguments

    trainer = SwarmTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                           swarm=SwarmArguments(run_id="my-run", target_batch_size=4096))
    trainer.train()

What it changes, and how each `TrainingArguments` setting reads in a swarm (docs/integrations.md):

- the optimizer the Trainer builds (its `optim`, learning rate, weight decay groups) is wrapped in a
  `swarm.Optimizer` (`SwarmTorchOptimizer`): every accumulated batch (`per_device_train_batch_size`
  times `gradient_accumulation_steps` samples, the last one counted as it is) goes to the swarm,
  which steps when the swarm holds `target_batch_size` samples (large-batch mode), or after
  `DiLoCoConfig.local_steps` inner steps (DiLoCo mode);
- `state.global_step` is the swarm's step count (`SwarmSession.global_step`): collective steps, or in
  DiLoCo mode the swarm's inner steps; so `max_steps`, `save_steps`, `eval_steps`, `logging_steps`
  and the learning-rate schedule all count the swarm's steps. Without `max_steps`, `num_train_epochs`
  passes over the dataset by the whole swarm make `num_train_epochs * len(train_dataset) /
  target_batch_size` collective steps (DiLoCo: this peer's passes, as without a swarm);
- the schedule (`lr_scheduler_type`, warmup) is stepped by the swarm with each collective step, so
  every peer has the same rate at the same step, whenever it joined;
- `max_grad_norm` clips the gradient the step applies: the swarm's mean in large-batch mode (so
  peers stay identical), each inner step's in DiLoCo mode;
- `bf16`/`fp16` autocast as usual (fp16's loss scaling is undone before gradients reach the swarm);
- checkpoints (`save_steps`, `resume_from_checkpoint`) hold the swarm's state in `optimizer.pt`: the
  collaborative optimizer state, the step count and this peer's data position; a resumed peer goes
  on from its checkpoint and takes the swarm's newer state at its first step;
- each peer draws the training set in its own order (`swarm.integrations.data.PeerShardSampler`),
  endlessly, resumed from the checkpoint: no replay after a restart (`ignore_data_skip` is implied);
- under `torchrun --nproc-per-node K`, the job's ranks are one peer: rank 0 starts it, the others
  follow it (`swarm.optim.distributed`; docs/operations.md, "A multi-GPU machine as one peer").
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch.optim.lr_scheduler import LRScheduler

from swarm.integrations.data import PeerShardSampler, peer_seed
from swarm.integrations.fingerprint import ModelFingerprint, model_fingerprint
from swarm.integrations.session import (
    ScheduleView,
    SwarmArguments,
    SwarmSession,
    SwarmTorchOptimizer,
    clip_before_step,
)
from swarm.optim.distributed import is_following_rank, machine_peer_id
from swarm.peer import Peer

logger = logging.getLogger(__name__)


class SwarmCallback(transformers.TrainerCallback):
    """Keeps the Trainer's step count on the swarm's, and saves or evaluates once per swarm step.

    It runs twice per step: first (before the Trainer's flow callback reads `global_step`), to set
    `global_step` to the swarm's; and last, to cancel a save or an evaluation the flow callback
    asked for at a step count that did not change since the last one (several local steps can
    share one collective step).
    """

    def __init__(self, trainer: SwarmTrainer, first: bool) -> None:
        self.trainer = trainer
        self.first = first

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: object) -> transformers.TrainerControl:
        session = self.trainer.session
        if session is None:
            return control
        if self.first:
            self.trainer._local_steps += 1
            state.global_step = session.global_step
            self.trainer._advanced = state.global_step > self.trainer._last_step
            self.trainer._last_step = max(self.trainer._last_step, state.global_step)
        elif not self.trainer._advanced:
            control.should_save = False
            control.should_evaluate = False
        if self.trainer._adapter is not None:
            self.trainer._adapter.discard_samples()  # a step the gradient scaler skipped leaves its count there
        return control

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: object) -> transformers.TrainerControl:
        if self.first and self.trainer.session is not None:
            self.trainer.session.optimizer.flush()  # the last round in flight lands before the model is saved
        return control


class SwarmTrainer(transformers.Trainer):
    """`transformers.Trainer` training with a swarm of peers; takes the Trainer's arguments plus `swarm`.

    Args:
        *args, **kwargs: `transformers.Trainer`'s.
        swarm: how to join the swarm (run name, target batch or DiLoCo, initial peers, ...).
        peer: a running `swarm.Peer` to use; by default the trainer starts one for each `train()`.

    Attributes:
        session: the swarm side of the current `train()` (None before and after it).
    """

    # what this class reads of `transformers.Trainer` (typed here: mypy does not follow transformers)
    args: transformers.TrainingArguments
    model: torch.nn.Module
    state: transformers.TrainerState
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: ScheduleView | LRScheduler | None
    train_dataset: Any  # what Trainer takes: a torch or `datasets` dataset (sized here: the sampler needs it), or None
    callback_handler: transformers.trainer_callback.CallbackHandler

    def __init__(self, *args: object, swarm: SwarmArguments, peer: Peer | None = None, **kwargs: object) -> None:
        if not isinstance(swarm, SwarmArguments):
            raise TypeError(f"swarm must be a SwarmArguments, got {type(swarm).__name__}")
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1 and (self.args.fsdp or self.args.deepspeed):
            raise ValueError("SwarmTrainer under torchrun needs every rank to hold the whole model; FSDP and DeepSpeed "
                             "shard it (docs/operations.md, 'A multi-GPU machine as one peer')")
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError("SwarmTrainer builds the optimizer from TrainingArguments (optim, learning_rate, ...); "
                             "pass optimizer_cls_and_kwargs instead of optimizers=")
        self.swarm = swarm
        self.session: SwarmSession | None = None
        self._given_peer = peer
        self._peer: Peer | None = None
        self._sampler: PeerShardSampler | None = None
        self._local_steps = 0  # this peer's optimizer steps in this train() (the loss log's divisor)
        self._logged_local = 0
        self._logged_global = 0
        self._last_step = 0
        self._advanced = False
        self._clip = 0.0
        self._resuming = False
        self._adapter: SwarmTorchOptimizer | None = None
        self.callback_handler.callbacks.insert(0, SwarmCallback(self, first=True))
        # (not add_callback, which warns the user of a second callback of one class)
        self.callback_handler.callbacks.append(SwarmCallback(self, first=False))

    # -- the peer, the data ------------------------------------------------------------------------

    @property
    def peer(self) -> Peer | None:
        """The machine's peer; None on a torchrun job's ranks other than 0 (they follow rank 0's)."""
        if self._given_peer is not None or is_following_rank():
            return self._given_peer
        if self._peer is None:
            s = self.swarm
            self._peer = Peer(initial_peers=s.peers_to_join(), listen=s.listen, identity_path=s.identity_path,
                              client_mode=s.client_mode)
        return self._peer

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        self._sampler = PeerShardSampler(len(dataset), peer_seed(machine_peer_id(self.peer), self.swarm.run_id))
        return self._sampler

    # -- training ---------------------------------------------------------------------------------

    def train(self, *args: object, **kwargs: object) -> transformers.trainer_utils.TrainOutput:
        """`Trainer.train`, in the swarm; the peer (if the trainer started it) stops at the end."""
        original = self.args
        self.args = copy.copy(original)  # the swarm's reading of the user's arguments, for this run
        self.args.max_steps = self._collective_max_steps(original)
        self.args.ignore_data_skip = True  # the sampler resumes from the checkpoint's position
        self._clip = float(original.max_grad_norm or 0.0)
        self.args.max_grad_norm = 0.0  # clipped at the swarm's step instead (`clip_before_step`)
        if original.fp16 and original.device.type == "cpu":
            logger.warning("fp16=True on a CPU: transformers (accelerate) neither autocasts nor scales the loss there, "
                           "so this trains in float32; bf16=True autocasts on CPUs")
        self._local_steps = self._logged_local = 0
        self._resuming = bool(kwargs.get("resume_from_checkpoint") or (args and args[0]))
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args = original
            self._close()

    def _collective_max_steps(self, args: transformers.TrainingArguments) -> int:
        if args.max_steps > 0:
            return int(args.max_steps)
        if self.train_dataset is None:
            raise ValueError("SwarmTrainer needs a train_dataset")
        samples = args.num_train_epochs * len(self.train_dataset)
        if self.swarm.diloco is None:
            target = self.swarm.config.target_batch_size
            assert target is not None  # SwarmArguments checks it in large-batch mode
            return max(1, math.ceil(samples / target))
        return max(1, math.ceil(samples / (args.per_device_train_batch_size * args.gradient_accumulation_steps)))

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        inner = super().create_optimizer(model)
        if isinstance(inner, SwarmTorchOptimizer):
            return inner
        clip_before_step(inner, self._clip)
        self._adapter = SwarmTorchOptimizer(inner)
        self.optimizer = self._adapter
        return self._adapter

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> ScheduleView | LRScheduler | None:
        if self.session is not None:
            return self.lr_scheduler
        adapter = self._adapter
        if adapter is None:
            raise RuntimeError("create_optimizer must run before create_scheduler")
        self.lr_scheduler = None
        scheduler = super().create_scheduler(num_training_steps, optimizer=adapter.optimizer)
        self.session, self.lr_scheduler = adapter.join(
            self.swarm, self.model, scheduler, peer=self.peer, resuming=self._resuming,
            fingerprint=fingerprint_of(self.model), sampler=self._sampler)
        self._last_step = self.session.global_step
        self._logged_global = self.state.global_step
        return self.lr_scheduler

    def training_step(self, model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], *args: object,
                      **kwargs: object) -> torch.Tensor:
        if self._adapter is not None:
            self._adapter.count(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: object, **kwargs: object) -> None:
        # the Trainer divides the summed loss by the steps its count moved; in a swarm that count is the
        # swarm's (`SwarmCallback`), while the loss was summed over this peer's own steps
        if "loss" in logs and self._local_steps > self._logged_local:
            moved = max(self.state.global_step - self._logged_global, 1)
            logs["loss"] = logs["loss"] * moved / (self._local_steps - self._logged_local)
        if "train_loss" in logs and self._local_steps > 0:
            moved = max(self.state.global_step - self._initial_global_step, 1)
            logs["train_loss"] = logs["train_loss"] * moved / self._local_steps
        if "loss" in logs:
            self._logged_local, self._logged_global = self._local_steps, self.state.global_step
        if self.session is not None and self.session.peer is not None:
            logs["swarm_peers"] = self.session.optimizer.progress.num_peers
        super().log(logs, *args, **kwargs)

    def _close(self) -> None:
        session, self.session = self.session, None
        try:
            if session is not None:
                session.shutdown()
        finally:
            if self._peer is not None:
                self._peer.shutdown()
                self._peer = None
            self.optimizer = None
            self.lr_scheduler = None
            self._adapter = None


def fingerprint_of(model: torch.nn.Module) -> ModelFingerprint:
    """A model's fingerprint, with its transformers config's `model_type` and its input embedding's
    vocabulary where it is a `PreTrainedModel`."""
    if not isinstance(model, transformers.PreTrainedModel):
        return model_fingerprint(model)
    embeddings = model.get_input_embeddings()
    vocab = embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None
    return model_fingerprint(model, model.config.model_type or None, vocab)


__all__ = ["SwarmArguments", "SwarmCallback", "SwarmTrainer"]
