"""`python -m swarm.demo`: a whole swarm on this machine, training a small language model.

It starts, as separate processes on loopback, one expert server holding the grid of experts of
the model's mixture layer (`python -m swarm --experts 'ffn.[0:2].[0:2]' ...`) and a few trainers
(`python -m swarm.demo.trainer`), shows a live line per trainer, and at the end prints a summary
(held-out loss before and after, samples, collective steps, bytes sent, text samples) and saves
the loss curve as a PNG. With `--hostile-experts MODE` the grid's last row is served instead by a
second expert server that lies in every answer (`swarm.moe.server.hostile`), to show the trainers'
mixtures catching it and training on. Ctrl+C stops the whole swarm cleanly: each child gets one SIGINT,
finishes what it is doing and exits 0; a second Ctrl+C kills them at once.

The first trainer saves the run's state every few seconds and when it stops, into
``OUT_DIR/checkpoints`` (the expert server its experts, into ``OUT_DIR/checkpoints/experts``);
``--resume-from OUT_DIR/checkpoints`` starts the whole swarm again from there, its loss curve
continuing where it was (`swarm.demo.resume`).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from swarm.core.errors import ConfigError
from swarm.demo.display import Board
from swarm.demo.events import Evaluation, Notice, Progress, TextSample, from_json, megabytes, printable
from swarm.demo.mode import ModeChoice, pick_mode
from swarm.demo.model import ModelConfig
from swarm.demo.plot import BLACK, PALETTE, PlotUnavailable, Series, plot
from swarm.demo.resume import prior_curve


@dataclass(frozen=True)
class DemoConfig:
    """What the local swarm looks like.

    Attributes:
        trainers: trainer processes.
        duration: seconds each trainer trains.
        batch_size: windows per local batch.
        target_batch_size: windows per collective step (large-batch mode).
        diloco_steps: run the trainers in DiLoCo mode with this many local steps per round.
        max_staleness: large-batch rounds: "auto" (the trainers' choice by their link: on
            loopback every round is waited for), "0" or "1" (averaged while the next batches compute).
        sample_length: bytes of text generated before and after training.
        out_dir: where the loss curve and the processes' logs go.
        model: model sizes (the expert server is started to match).
        aggregation: how the trainers average ("mean" or "centered_clip").
        byzantine: how many trainers attack (the first ones), with `attack` (`swarm.demo.byzantine`).
        attack: the attack those trainers make (one of `swarm.demo.byzantine.ATTACKS`).
        dashboard_port: the expert server serves the swarm's live page on this port of 127.0.0.1
            (0: any free one; None: no page).
        hostile_experts: split the grid over two expert servers, the second (the last row of the
            grid's first dimension) hostile in this way (`swarm.moe.server.hostile`); None: one honest
            server holds the whole grid.
        resume_from: a checkpoint directory of an earlier demo to continue from (and save into).
        checkpoint_every: seconds between the first trainer's checkpoints.
    """

    trainers: int = 3
    duration: float = 120.0
    batch_size: int = 16
    target_batch_size: int = 128
    diloco_steps: int | None = None
    max_staleness: str = "auto"
    sample_length: int = 160
    out_dir: Path = Path("demo-out")
    model: ModelConfig = field(default_factory=ModelConfig)
    aggregation: str = "mean"
    byzantine: int = 0
    attack: str = "sign_flip"
    dashboard_port: int | None = 0
    hostile_experts: str | None = None
    resume_from: Path | None = None
    checkpoint_every: float = 10.0

    @property
    def checkpoint_dir(self) -> Path:
        return self.resume_from if self.resume_from is not None else self.out_dir / "checkpoints"

    def __post_init__(self) -> None:
        if not 1 <= self.trainers <= 16:
            raise ConfigError("--trainers must be within 1..16")
        if not 0 <= self.byzantine <= self.trainers:
            raise ConfigError("--byzantine must be within 0..trainers")
        if self.duration <= 0:
            raise ConfigError("--duration must be positive")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port <= 65535:
            raise ConfigError("--dashboard-port must be a TCP port")
        if self.hostile_experts is not None and self.model.grid_size[0] < 2:
            raise ConfigError("--hostile-experts needs a grid of at least two rows")


def run_mode(c: DemoConfig) -> str:
    """The demo's mode as its first line states it: what its trainers will say they do (a
    large-batch trainer on loopback waits for its rounds unless told otherwise, `swarm.demo.mode`)."""
    if c.diloco_steps:
        return f"mode: DiLoCo, {c.diloco_steps} local steps per round (asked for)"
    # the staleness each trainer will pick on loopback, by the trainers' own rule
    staleness = pick_mode("auto", None, None, rtt=None, announce=(), client_mode=False,
                          max_staleness=c.max_staleness).max_staleness
    why = "every peer is on loopback" if c.max_staleness == "auto" else "asked for"
    return f"{ModeChoice('large-batch', None, why, staleness).describe()}; collective steps of {c.target_batch_size} windows"


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies without cleaning up (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child:
    """A child process: its own session (a terminal's Ctrl+C reaches only the launcher, which
    forwards exactly one SIGINT), stdout read line by line, stderr into a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     start_new_session=True,
                                     # the launcher starts children before it has threads of its own
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509
        assert self.proc.stdout is not None
        self.stdout: IO[str] = self.proc.stdout
        self.interrupted = False

    def interrupt(self) -> None:
        if self.proc.poll() is None and not self.interrupted:
            self.interrupted = True
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        self.stdout.close()
        self._log.close()


class Launcher:
    """Runs the local swarm and reports what it did."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.out_dir = config.out_dir
        self.log_dir = self.out_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.names = [f"trainer-{i}" for i in range(config.trainers)]
        self.board = Board(self.names, config.duration, plain_interval=5.0)
        self.server: Child | None = None
        self.hostile_server: Child | None = None
        self.trainers: list[Child] = []
        self.curves: dict[str, list[tuple[float, float]]] = {n: [] for n in self.names}
        self.evals: list[tuple[float, float]] = []
        if config.resume_from is not None:  # the curve so far, kept in the checkpoint it resumes from
            prior = prior_curve(config.resume_from)
            for name, points in prior.curves.items():
                self.curves.setdefault(name, []).extend(points)
            self.evals.extend(prior.evals)
        self.samples: dict[str, str] = {}
        self.final: dict[str, Progress] = {}
        self.started = time.monotonic()
        self.stopping = False
        self._signals = 0

    # -- processes ----------------------------------------------------------------------------

    def start_server(self) -> str:
        m, hostile = self.config.model, self.config.hostile_experts
        pattern = m.expert_pattern
        if hostile is not None:  # the last row of the grid goes to a hostile server
            rows, rest = m.grid_size[0], "".join(f".[0:{n}]" for n in m.grid_size[1:])
            pattern, lies = f"{m.uid_prefix}[0:{rows - 1}]{rest}", f"{m.uid_prefix}[{rows - 1}:{rows}]{rest}"

        def argv(experts: str) -> list[str]:
            return [sys.executable, "-m", "swarm", "--listen", "/ip4/127.0.0.1/tcp/0", "--experts", experts,
                    "--expert-cls", "ffn", "--hidden-dim", str(m.hidden_dim), "--log-level", "WARNING",
                    # the experts are half the model: saved beside the run's checkpoints, loaded on a resume
                    "--checkpoint-dir", str(self.config.checkpoint_dir / ("experts" if experts == pattern else "hostile"))]

        served = argv(pattern)
        dashboard = self.dashboard_url()
        if dashboard is not None:  # the page shows the trainers' run (their default run id)
            served += ["--dashboard-port", dashboard.rsplit(":", 1)[1].strip("/"), "--dashboard-run", "swarm-demo"]
        self.server = Child("expert-server", served, self.log_dir)
        line = self.server.stdout.readline().strip()
        if not line.startswith("/"):
            raise RuntimeError(f"the expert server did not start:\n{self.server.log_tail()}")
        self.board.notice(f"expert server: experts {pattern} (ffn, hidden {m.hidden_dim}) at {line}")
        if dashboard is not None:
            self.board.notice(f"dashboard: {dashboard}  (the swarm live in a browser, served by the expert server)")
        if hostile is not None:
            self.hostile_server = Child("hostile-expert-server", [*argv(lies), "--initial-peers", line,
                                                                  "--expert-hostile", hostile], self.log_dir)
            if not self.hostile_server.stdout.readline().strip().startswith("/"):
                raise RuntimeError(f"the hostile expert server did not start:\n{self.hostile_server.log_tail()}")
            self.board.notice(f"HOSTILE expert server ({hostile}): experts {lies}")
        return line

    def dashboard_url(self) -> str | None:
        """Where the expert server will serve the dashboard, or None (off, or its extra missing)."""
        if self.config.dashboard_port is None:
            return None
        if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
            self.board.notice("dashboard: off (pip install 'swarm-peer[dashboard]' to watch the swarm in a browser)")
            return None
        port = self.config.dashboard_port
        if not port:  # a free port now; the server binds it a moment later
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        return f"http://127.0.0.1:{port}/"

    def start_trainers(self, initial_peer: str) -> None:
        c = self.config
        for i, name in enumerate(self.names):
            argv = [sys.executable, "-m", "swarm.demo.trainer", "--json", "--name", name, "--initial-peers",
                    initial_peer, "--listen", "/ip4/127.0.0.1/tcp/0", "--seed", str(i), "--threads", "1",
                    "--duration", str(c.duration), "--batch-size", str(c.batch_size), "--target-batch-size",
                    str(c.target_batch_size), "--hidden-dim", str(c.model.hidden_dim)]
            # every peer of this swarm is on loopback: large-batch fits that link (a round costs less
            # than the compute between two), unless DiLoCo is asked for
            argv += ["--diloco-steps", str(c.diloco_steps)] if c.diloco_steps is not None else ["--mode", "large-batch"]
            argv += ["--max-staleness", c.max_staleness]
            argv += ["--aggregation", c.aggregation]
            if i < c.byzantine:
                argv += ["--attack", c.attack]
            if i == 0:
                argv += ["--sample", "--sample-length", str(c.sample_length)]
                argv += ["--checkpoint-dir", str(c.checkpoint_dir), "--checkpoint-every", str(c.checkpoint_every)]
            if c.resume_from is not None:
                argv += ["--resume-from", str(c.resume_from)]
            self.trainers.append(Child(name, argv, self.log_dir))

    def on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        if self._signals > 1:
            for child in [*self.trainers, *self.servers()]:
                child.kill()
            os._exit(128 + signum)
        self.stopping = True

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)
        c = self.config
        self.board.notice(f"swarm demo: {c.trainers} trainers, {c.duration:.0f} s, {run_mode(c)}; "
                          f"logs in {self.log_dir}/ (Ctrl+C stops the swarm)")
        try:
            self.start_trainers(self.start_server())
            self.follow()
        finally:
            self.shutdown()
        self.summarize()
        return 0

    def follow(self) -> None:
        """Reads the trainers' events until they all exit (forwarding one SIGINT on Ctrl+C)."""
        with selectors.DefaultSelector() as selector:
            for child in self.trainers:
                selector.register(child.stdout, selectors.EVENT_READ, child)
            open_streams = len(self.trainers)
            while open_streams:
                if self.stopping:
                    for child in self.trainers:
                        if not child.interrupted:
                            self.board.notice(f"stopping {child.name}...")
                        child.interrupt()
                for key, _ in selector.select(timeout=0.5):
                    child = key.data
                    line = child.stdout.readline()
                    if not line:
                        selector.unregister(child.stdout)
                        open_streams -= 1
                        self.on_exit(child)
                        continue
                    self.on_line(child, line)
                self.board.draw()
        self.board.draw(force=True)

    def on_line(self, child: Child, line: str) -> None:
        event = from_json(line)
        # points on the run's time axis (a resumed run's trainers continue the one before)
        if isinstance(event, Progress):
            self.board.update(event)
            self.final[event.name] = event
            if event.loss == event.loss:  # not NaN
                self.curves[event.name].append((event.elapsed, event.loss))
        elif isinstance(event, Evaluation):
            self.evals.append((event.elapsed, event.loss))
        elif isinstance(event, TextSample):
            self.samples[event.when] = event.prompt + event.text
            self.board.notice(f"{event.name}: text {event.when} training: {printable(event.prompt + event.text)}")
        elif isinstance(event, Notice):
            self.board.notice(f"{event.name}: {event.message}")

    def on_exit(self, child: Child) -> None:
        code = child.proc.wait()
        if code != 0:
            self.board.notice(f"{child.name} exited with status {code}; the end of its log:\n{child.log_tail()}")

    def shutdown(self) -> None:
        """Stops the trainers (if still running) and then the expert server, each with one SIGINT."""
        for child in self.trainers:
            child.interrupt()
        for child in self.trainers:
            try:
                child.proc.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
        for server in self.servers():
            server.interrupt()
            try:
                code = server.proc.wait(30)
                if code != 0:
                    self.board.notice(f"{server.name} exited with status {code}:\n{server.log_tail()}")
            except subprocess.TimeoutExpired:
                server.kill()
        for child in [*self.trainers, *self.servers()]:
            child.close()

    def servers(self) -> list[Child]:
        return [s for s in (self.server, self.hostile_server) if s is not None]

    # -- the report ---------------------------------------------------------------------------

    def summarize(self) -> None:
        wall = time.monotonic() - self.started
        out = sys.stdout
        out.write("\n== what the swarm did ==\n")
        if self.evals:
            first = self.evals[0][1]
            last = self.evals[-min(len(self.evals), self.config.trainers):]
            end = sum(v for _, v in last) / len(last)
            out.write(f"held-out loss   {first:.3f} -> {end:.3f} nats per byte (wall time {wall:.0f} s)\n")
        if self.final:
            total = sum(p.samples for p in self.final.values())
            per = ", ".join(f"{n} {p.samples}" for n, p in sorted(self.final.items()))
            epochs = max(p.epoch for p in self.final.values())
            averaging = sum(p.averaging_bytes for p in self.final.values())
            experts = sum(p.expert_bytes for p in self.final.values())
            out.write(f"samples         {total} windows of {self.config.model.context} bytes ({per})\n")
            out.write(f"collective steps {epochs} (epochs of the shared optimizer)\n")
            out.write(f"tensors sent    {megabytes(averaging)} averaging, {megabytes(experts)} to and from experts\n")
        for when in ("before", "after"):
            if when in self.samples:
                out.write(f"text {when:<6}     {printable(self.samples[when])}\n")
        png = self.write_plot()
        if png is not None:
            out.write(f"loss curve      {png}\n")
        out.flush()

    def write_plot(self) -> Path | None:
        series = [Series(name, points, PALETTE[i % len(PALETTE)]) for i, (name, points) in
                  enumerate(self.curves.items()) if points]
        if self.evals:
            series.append(Series("held-out", self.evals, BLACK, dots=True))
        if not series:
            return None
        try:
            png = plot(series, "time (s)", "loss (nats per byte)")
        except PlotUnavailable as e:
            self.board.notice(f"no loss plot: {e}")
            return None
        path = self.out_dir / "loss.png"
        path.write_bytes(png)
        return path


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    parser = argparse.ArgumentParser(prog="python -m swarm.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=d.trainers, help="trainer processes (default 3)")
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds of training (default 120)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--target-batch-size", type=int, default=d.target_batch_size,
                        help="windows per collective step")
    parser.add_argument("--diloco-steps", type=int, default=None,
                        help="DiLoCo mode: local steps per averaging round")
    parser.add_argument("--max-staleness", choices=("auto", "0", "1"), default=d.max_staleness,
                        help="large-batch rounds: 0 waits for each, 1 averages it while the next batches compute "
                             "(default auto: 0 on loopback)")
    parser.add_argument("--hidden-dim", type=int, default=d.model.hidden_dim)
    parser.add_argument("--sample-length", type=int, default=d.sample_length, help="bytes of generated text")
    parser.add_argument("--out-dir", type=Path, default=d.out_dir, help="loss curve and logs (default demo-out)")
    parser.add_argument("--aggregation", default=d.aggregation, choices=["mean", "centered_clip"],
                        help="how trainers average: mean (default) or centered_clip (byzantine-robust)")
    parser.add_argument("--byzantine", type=int, default=0, help="how many trainers attack (default 0)")
    parser.add_argument("--attack", default=d.attack, choices=["x1000", "sign_flip", "random", "constant"],
                        help="what the byzantine trainers do to their gradients (default sign_flip)")
    parser.add_argument("--dashboard-port", type=int, default=0,
                        help="port of the swarm's live page on 127.0.0.1 (default: any free one)")
    parser.add_argument("--no-dashboard", action="store_true", help="serve no live page")
    parser.add_argument("--hostile-experts", default=None, choices=["x1e6", "nan", "shape", "sometimes"],
                        help="serve the grid's last row from a second, hostile expert server that lies this way "
                             "(default: one honest server holds every expert)")
    parser.add_argument("--resume-from", type=Path, default=None,
                        help="continue an earlier demo from its checkpoints (e.g. demo-out/checkpoints)")
    parser.add_argument("--checkpoint-every", type=float, default=d.checkpoint_every,
                        help="seconds between checkpoints of the run's state (default 10)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = DemoConfig(trainers=args.trainers, duration=args.duration, batch_size=args.batch_size,
                            target_batch_size=args.target_batch_size, diloco_steps=args.diloco_steps,
                            max_staleness=args.max_staleness, sample_length=args.sample_length, out_dir=args.out_dir, model=ModelConfig(hidden_dim=args.hidden_dim),
                            aggregation=args.aggregation, byzantine=args.byzantine, attack=args.attack,
                            dashboard_port=None if args.no_dashboard else args.dashboard_port,
                            hostile_experts=args.hostile_experts,
                            resume_from=args.resume_from, checkpoint_every=args.checkpoint_every)
    except ValueError as e:
        print(f"swarm demo: error: {e}", file=sys.stderr)
        return 2
    return Launcher(config).run()
