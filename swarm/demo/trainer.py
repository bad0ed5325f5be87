"""A demo trainer: the byte-level language model, trained with `swarm.Optimizer` in a swarm.

    python -m swarm.demo.trainer --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...

joins the swarm those peers belong to, finds the experts of the model's mixture layer in the
DHT, and trains until `--duration` runs out or it gets SIGINT/SIGTERM (then it finishes its
step, leaves the swarm and exits 0; a second signal exits at once). It prints a progress line
every few seconds; with `--json` it prints events for `python -m swarm.demo` instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swarm.core.errors import ConfigError, SwarmError
from swarm.core.signals import handle_stop_signals
from swarm.demo.byzantine import ATTACKS, attack_gradients
from swarm.demo.data import ByteDataset, load_corpus
from swarm.demo.events import Evaluation, Event, EventWriter, Notice, Progress, TextSample
from swarm.demo.mode import MODES, STALENESS, ModeChoice, mode_key, pick_mode
from swarm.demo.model import ByteLM, LocalExperts, ModelConfig
from swarm.demo.resume import RunCurve, prior_curve

if TYPE_CHECKING:
    from swarm.optim import Optimizer

logger = logging.getLogger("swarm.demo.trainer")

PROMPT = b"The "


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a demo trainer can be told (names match the command-line flags).

    Attributes:
        name: how this trainer calls itself in events and logs.
        initial_peers: multiaddrs of peers already in the swarm.
        listen: where this trainer's peer accepts connections.
        announce: addresses to advertise instead of the listen address (public IP behind 1:1 NAT).
        client_mode: only dial out (behind NAT): averages, but serves no state.
        run_id: peers with the same run id train one model together.
        duration: seconds of training.
        batch_size: windows per local batch.
        target_batch_size: windows the swarm accumulates per collective step (large-batch mode).
        lr: peak learning rate of Adam (the inner optimizer in DiLoCo mode).
        warmup_epochs: epochs of linear learning-rate warm-up (large-batch mode).
        diloco_steps: use DiLoCo with this many local steps per round instead of large batches.
        mode: "auto" (the run's mode, or the one that fits this peer's link: `swarm.demo.mode`),
            "large-batch" or "diloco".
        max_staleness: large-batch mode's rounds: "auto" (waited for on a local link, overlapped
            with the next batches across the internet: `swarm.demo.mode`), "0" or "1".
        seed: seeds the data order (and nothing else: initial weights come from the swarm).
        threads: torch threads (default: torch's choice).
        sample: generate a text sample before and after training.
        sample_length: bytes per sample.
        report_every: seconds between progress events.
        eval_every: seconds between held-out evaluations.
        json_events: print events as JSON lines (for the launcher).
        local_experts: use local expert modules instead of the swarm's (a smoke test without servers).
        model: model sizes; the experts' hidden size must equal `model.hidden_dim`.
        aggregation: how the swarm averages ("mean", or "centered_clip": byzantine-robust).
        attack: make this trainer byzantine with this attack (`swarm.demo.byzantine`); None: honest.
        checkpoint_dir: save the run's state (and this trainer's loss curve) there (`swarm.demo.resume`).
        checkpoint_every: seconds between checkpoints.
        resume_from: a directory of the run's checkpoints to start from when no live peer is further.
    """

    name: str = "trainer"
    initial_peers: tuple[str, ...] = ()
    listen: str = "/ip4/0.0.0.0/tcp/0"
    announce: tuple[str, ...] = ()
    client_mode: bool = False
    run_id: str = "swarm-demo"
    duration: float = 120.0
    batch_size: int = 16
    target_batch_size: int = 128
    lr: float = 3e-3
    warmup_epochs: int = 4
    diloco_steps: int | None = None
    mode: str = "auto"
    max_staleness: str = "auto"
    seed: int = 0
    threads: int | None = None
    sample: bool = False
    sample_length: int = 160
    report_every: float = 2.0
    eval_every: float = 15.0
    json_events: bool = False
    local_experts: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    aggregation: str = "mean"
    attack: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: float = 10.0
    resume_from: str | None = None

    def __post_init__(self) -> None:
        if self.duration <= 0 or self.batch_size < 1 or self.target_batch_size < 1 or self.lr <= 0:
            raise ConfigError("duration, batch sizes and lr must be positive")
        if self.diloco_steps is not None and self.diloco_steps < 1:
            raise ConfigError("--diloco-steps must be positive")
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.attack is not None and self.attack not in ATTACKS:
            raise ConfigError(f"--attack must be one of {ATTACKS}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm.demo.trainer", description=__doc__.split("\n\n")[0])
    d = TrainerConfig()
    parser.add_argument("--initial-peers", nargs="+", default=[], help="multiaddrs of peers in the swarm")
    parser.add_argument("--name", default=f"trainer-{os.getpid()}")
    parser.add_argument("--listen", default=d.listen)
    parser.add_argument("--announce", nargs="+", default=[], help="multiaddrs to advertise (public address)")
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--run-id", default=d.run_id)
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds of training")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--target-batch-size", type=int, default=d.target_batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--diloco-steps", type=int, default=None, help="DiLoCo mode: local steps per round")
    parser.add_argument("--mode", choices=MODES, default=d.mode,
                        help="training mode; auto: the run's, or the one that fits this peer's link")
    parser.add_argument("--max-staleness", choices=STALENESS, default=d.max_staleness,
                        help="large-batch rounds: 0 waits for each, 1 averages it while the next batches compute; "
                             "auto: 0 on a local link, 1 across the internet")
    parser.add_argument("--hidden-dim", type=int, default=d.model.hidden_dim, help="must match the experts'")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sample", action="store_true", help="generate text before and after training")
    parser.add_argument("--sample-length", type=int, default=d.sample_length, help="bytes per text sample")
    parser.add_argument("--eval-every", type=float, default=d.eval_every)
    parser.add_argument("--json", action="store_true", help="print JSON events (for python -m swarm.demo)")
    parser.add_argument("--local-experts", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--aggregation", default=d.aggregation, help="mean (default) or centered_clip (robust)")
    parser.add_argument("--attack", default=None, help="make this trainer byzantine: x1000, sign_flip, random, constant")
    parser.add_argument("--checkpoint-dir", default=None, help="save the run's state (and the loss curve) there")
    parser.add_argument("--checkpoint-every", type=float, default=d.checkpoint_every, help="seconds between checkpoints")
    parser.add_argument("--resume-from", default=None,
                        help="start from the newest checkpoint in this directory when no live peer is further")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(
        name=args.name, initial_peers=tuple(args.initial_peers), listen=args.listen, announce=tuple(args.announce),
        client_mode=args.client_mode, run_id=args.run_id, duration=args.duration, batch_size=args.batch_size,
        target_batch_size=args.target_batch_size, lr=args.lr, diloco_steps=args.diloco_steps, mode=args.mode,
        max_staleness=args.max_staleness, seed=args.seed,
        threads=args.threads, sample=args.sample, sample_length=args.sample_length, eval_every=args.eval_every, json_events=args.json,
        local_experts=args.local_experts, model=ModelConfig(hidden_dim=args.hidden_dim),
        aggregation=args.aggregation, attack=args.attack, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume_from=args.resume_from,
    )


class Trainer:
    """One trainer process: a peer, the model, `swarm.Optimizer`, and the training loop.

    Args:
        config: what to train and how.
        emit: where events go.
        stop: set it to end training after the current step.
    """

    def __init__(self, config: TrainerConfig, emit: Callable[[Event], None], stop: threading.Event) -> None:
        from swarm.moe.client.mixture import RemoteMixtureOfExperts
        from swarm.peer import Peer

        self.config = config
        self.emit = emit
        self.stop = stop
        if config.threads:
            torch.set_num_threads(config.threads)
        self.train_data, self.held_out = ByteDataset.split(load_corpus(), config.model.context)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.peer = Peer(initial_peers=config.initial_peers, listen=config.listen,
                               announce=config.announce, client_mode=config.client_mode, role="trainer")
        torch.manual_seed(0)  # every trainer builds the same initial model; the swarm's state replaces it anyway
        mcfg = config.model
        mixture = LocalExperts(mcfg) if config.local_experts else RemoteMixtureOfExperts(
            self.peer, in_features=mcfg.hidden_dim, grid_size=mcfg.grid_size, uid_prefix=mcfg.uid_prefix,
            k_best=mcfg.k_best, k_min=1, forward_timeout=20.0, backward_timeout=20.0)
        self.model = ByteLM(mcfg, mixture)
        self.curve = prior_curve(config.resume_from, config.run_id) if config.resume_from else RunCurve()
        self.mode = self._pick_mode()
        self.optimizer = self._make_optimizer()
        self.expert_bytes = 0
        self.started = time.monotonic()

    def _pick_mode(self) -> ModeChoice:
        """The run's mode from the DHT, or the one that fits this peer's link (then stored for the
        peers that join later)."""
        from swarm.core.timeutil import get_dht_time

        cfg = self.config
        key = mode_key(cfg.run_id)
        dht = self.peer.dht
        try:
            found = dht.get(key, latest=True) if dht is not None else None
        except (SwarmError, TimeoutError) as e:
            logger.warning("could not read the run's mode: %s", e)
            found = None
        record = found.value if found is not None else None
        # the least round trip seen: queueing on a busy machine only ever adds to it
        least = self.peer.pool.estimates.overall.min_rtt
        choice = pick_mode(cfg.mode, cfg.diloco_steps, record, least if math.isfinite(least) else None,
                           cfg.announce, cfg.client_mode, cfg.max_staleness)
        if record is not None and record != choice.to_record():
            self.emit(Notice(cfg.name, f"warning: the run's peers train in mode {record}, this one in "
                                       f"{choice.to_record()}: they will not average together"))
        elif record is None and dht is not None:
            try:
                dht.store(key, choice.to_record(), get_dht_time() + 86_000)
            except (SwarmError, TimeoutError) as e:
                logger.warning("could not store the run's mode: %s", e)
        self.emit(Notice(cfg.name, choice.describe()))
        return choice

    def _make_optimizer(self) -> Optimizer:
        from swarm.optim import CollaborationConfig, DiLoCoConfig, Optimizer
        from swarm.optim.checkpointing import CheckpointConfig

        cfg = self.config
        collaboration = CollaborationConfig(target_batch_size=cfg.target_batch_size, averaging_timeout=20.0,
                                            report_period=0.5, max_refresh_period=2.0, aggregation=cfg.aggregation,
                                            max_staleness=self.mode.max_staleness)
        warmup = max(cfg.warmup_epochs, 1)

        def adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, 0.98))

        checkpoint = CheckpointConfig(
            cfg.checkpoint_dir, every_epochs=None, every_seconds=cfg.checkpoint_every,
            param_names=tuple(n for n, p in self.model.named_parameters() if p.requires_grad),
            extra=lambda: self.curve.to_extra(self.curve.elapsed + time.monotonic() - self.started),
        ) if cfg.checkpoint_dir else None
        if self.mode.mode == "diloco":
            assert self.mode.local_steps is not None
            return Optimizer(self.peer, run_id=cfg.run_id, params=self.model.dense_parameters(),
                             optimizer=adam, batch_size_per_step=cfg.batch_size, config=collaboration,
                             diloco=DiLoCoConfig(local_steps=self.mode.local_steps), checkpoint=checkpoint,
                             resume_from=cfg.resume_from)
        return Optimizer(
            self.peer, run_id=cfg.run_id, params=self.model.dense_parameters(), optimizer=adam,
            target_batch_size=cfg.target_batch_size, batch_size_per_step=cfg.batch_size, config=collaboration,
            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: min(1.0, (epoch + 1) / warmup)),
            checkpoint=checkpoint, resume_from=cfg.resume_from,
        )

    # -- phases -------------------------------------------------------------------------------

    def wait_for_experts(self, timeout: float = 120.0) -> bool:
        """Runs a tiny forward until the mixture finds its experts (a server may still be starting)."""
        deadline = time.monotonic() + timeout
        told = False
        probe = torch.zeros(1, 2, dtype=torch.long)
        while not self.stop.is_set():
            try:
                with torch.no_grad():
                    self.model(probe)
                return True
            except SwarmError as e:
                if time.monotonic() > deadline:
                    self.emit(Notice(self.config.name, f"no experts answered within {timeout:.0f} s: {e}"))
                    return False
                if not told:
                    self.emit(Notice(self.config.name, "waiting for the experts of the mixture layer..."))
                    told = True
                self.stop.wait(1.0)
        return False

    def sample(self, when: str) -> None:
        try:
            text = self.model.generate(PROMPT, self.config.sample_length, torch.Generator().manual_seed(1))
        except SwarmError as e:
            self.emit(Notice(self.config.name, f"could not generate a sample {when} training: {e}"))
            return
        self.emit(TextSample(self.config.name, when, PROMPT.decode(), text.decode("utf-8", "replace")))

    def evaluate(self) -> float:
        x, y = self.held_out.batch(32, torch.Generator().manual_seed(12345))
        with torch.no_grad():
            return float(self.model.loss(x, y))

    def report_evaluation(self, elapsed: float) -> None:
        """Emits the held-out loss, or a notice when the mixture's experts do not answer right now
        (a server restarting): a missed evaluation is no reason to stop training."""
        try:
            loss = self.evaluate()
        except SwarmError as e:
            self.emit(Notice(self.config.name, f"skipped a held-out evaluation: {e}"))
            return
        self.curve.add_eval(self.curve.elapsed + elapsed, loss)
        self.emit(Evaluation(self.config.name, self.curve.elapsed + elapsed, loss))

    def train(self) -> None:
        """The training loop: until `duration` or `stop`."""
        cfg, opt = self.config, self.optimizer
        self.started = time.monotonic()
        deadline = self.started + cfg.duration
        next_report = self.started + cfg.report_every
        next_eval = self.started
        smoothed = math.nan
        step = samples = 0
        rows = cfg.batch_size * cfg.model.context
        # forward: rows to k experts and their outputs back; backward: the same again
        bytes_per_step = 0 if cfg.local_experts else 4 * rows * cfg.model.hidden_dim * 4 * cfg.model.k_best
        window_start, window_samples = self.started, 0
        throughput = 0.0
        digest_epoch = -1
        while not self.stop.is_set() and time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_eval:
                self.report_evaluation(now - self.started)
                next_eval = now + cfg.eval_every
            x, y = self.train_data.batch(cfg.batch_size, self.generator)
            try:
                loss = self.model.loss(x, y)
                loss.backward()
            except SwarmError as e:
                logger.warning("skipping a batch: %s", e)
                opt.zero_grad()
                self.stop.wait(1.0)  # the experts may be restarting: do not spin on failing calls
                continue
            torch.nn.utils.clip_grad_norm_(self.model.dense_parameters(), 1.0)
            if cfg.attack is not None:
                attack_gradients(self.model.dense_parameters(), cfg.attack, self.generator)
            opt.step()
            opt.zero_grad()
            if cfg.json_events and opt.epoch != digest_epoch:  # the network lab compares these (docs/network-lab.md)
                digest_epoch = opt.epoch
                # the optimizer's shared tensors: the parameters (large-batch), or DiLoCo's outer
                # parameters (its local ones drift apart between rounds by design)
                shared = b"".join(t.detach().numpy().tobytes() for t in opt.shared_tensors)
                print(json.dumps({"kind": "digest", "name": cfg.name, "epoch": opt.epoch,
                                  "sha256": hashlib.sha256(shared).hexdigest()}), flush=True)
            step += 1
            samples += cfg.batch_size
            window_samples += cfg.batch_size
            self.expert_bytes += bytes_per_step
            value = loss.item()
            smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
            opt.tracker.report_loss(smoothed)  # in the run's progress record, for the dashboard
            now = time.monotonic()
            if now >= next_report:
                throughput = window_samples / max(now - window_start, 1e-9)
                window_start, window_samples = now, 0
                progress = opt.progress
                run_seconds = self.curve.elapsed + now - self.started  # continues a resumed run's curve
                self.curve.add(cfg.name, run_seconds, smoothed)
                self.emit(Progress(cfg.name, run_seconds, step, smoothed, throughput, progress.num_peers,
                                   opt.epoch, samples, opt.bytes_sent, self.expert_bytes))
                next_report = now + cfg.report_every
        now = time.monotonic()
        self.report_evaluation(now - self.started)
        from swarm.moe.client.mixture import RemoteMixtureOfExperts

        if isinstance(self.model.mixture, RemoteMixtureOfExperts):
            guard = self.model.mixture.caller.guard  # what the checks of the experts' answers did
            self.emit(Notice(cfg.name, f"expert answers: {guard.rejected} rejected, {guard.clipped_rows} of "
                                       f"{guard.checked_rows} rows clipped"))
        progress = opt.progress
        self.emit(Progress(cfg.name, self.curve.elapsed + now - self.started, step, smoothed, throughput,
                           progress.num_peers, opt.epoch, samples, opt.bytes_sent, self.expert_bytes))
        if opt.checkpointer is not None:  # the state it stops at: a restart continues from here
            saved = opt.save_checkpoint()
            self.emit(Notice(cfg.name, f"saved the run's state at epoch {opt.epoch} in {saved}" if saved else
                                       f"could not save the run's state: {opt.checkpointer.last_error}"))

    def close(self) -> None:
        try:
            self.optimizer.shutdown()
        finally:
            self.peer.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    config = config_from_args(args)
    emit = EventWriter(config.json_events)
    stop = threading.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            os._exit(128 + signum)
        stop.set()

    handle_stop_signals(on_signal)
    try:
        trainer = Trainer(config, emit, stop)
    except SwarmError as e:
        print(f"{config.name}: error: {e}", file=sys.stderr)
        return 2
    try:
        emit(Notice(config.name, f"peer {trainer.peer.peer_id} joined run {config.run_id!r}"))
        if trainer.wait_for_experts():
            if config.sample:
                trainer.sample("before")
            trainer.train()
            if config.sample:
                trainer.sample("after")
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
