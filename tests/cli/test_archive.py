"""`swarm-peer --archive DIR --run RUN_ID` as a real process: it downloads a live run's state and
keeps it as a checkpoint bit-identical to the trainer's state, from which a trainer on a fresh
peer resumes when no live peer is left; and its options are checked."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from procs import PeerProcess

from swarm.checkpoint import CheckpointStore
from swarm.cli.config import PeerOptions
from swarm.core.errors import ConfigError
from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.checkpointing import from_raw
from swarm.peer import Peer


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


CONFIG = CollaborationConfig(target_batch_size=8, report_period=0.1)


def test_an_archiver_keeps_the_live_state_and_a_trainer_resumes_from_it(tmp_path: Path) -> None:
    net = model()
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--archive", str(tmp_path / "archive"), "--run", "kept",
                     "--archive-every", "2", ready_timeout=60) as archiver:
        with Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=archiver.addrs) as peer:
            opt = Optimizer(peer, run_id="kept", params=net.parameters(), optimizer=adam, batch_size_per_step=4,
                            config=CONFIG)
            x = torch.randn(4, 8)
            while opt.epoch < 3:
                net(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            trained = [p.detach().clone() for p in net.parameters()]
            archiver.read_log_until(lambda line: "archived epoch 3" in line, 90)
            opt.shutdown()
        checkpoint = CheckpointStore(tmp_path / "archive").load_newest("kept")
        assert checkpoint.epoch == 3
        assert [p.name for p in checkpoint.manifest.params] == ["param.0", "param.1", "param.2", "param.3"]
        assert all(torch.equal(from_raw(a), b) for a, b in zip(checkpoint.params, trained))

        # every trainer gone: a cold restart from the state the archiver serves, named by its address
        for source in (archiver.addrs[0], str(tmp_path / "archive")):
            fresh = model()
            with Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=archiver.addrs) as peer:
                opt = Optimizer(peer, run_id="kept", params=fresh.parameters(), optimizer=adam,
                                batch_size_per_step=4, config=CONFIG, resume_from=source)
                assert opt.epoch == 3, source
                assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), trained)), source
                opt.shutdown()
        archiver.signal(signal.SIGINT)
        assert archiver.wait(30) == 0


def test_archive_options_go_together() -> None:
    with pytest.raises(ConfigError, match="--archive DIR and --run RUN_ID go together"):
        PeerOptions(archive="/tmp/x")
    with pytest.raises(ConfigError, match="--archive-every"):
        PeerOptions(archive="/tmp/x", run="r", archive_every=0)
