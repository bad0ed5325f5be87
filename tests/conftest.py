"""Shared fixtures. `tests/procs.py` starts real peer processes; `make_peer` starts in-process peers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from torch_free import is_torch_free

from swarm.peer import Peer


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    """`make_peer(**Peer arguments)` starts a peer on loopback; every one is shut down after the test."""
    peers: list[Peer] = []

    def factory(**kwargs: Any) -> Peer:
        peer = Peer(**kwargs)
        peers.append(peer)
        return peer

    yield factory
    for peer in reversed(peers):
        peer.shutdown()


# scripts/test.sh runs the suite in two passes. First, on two xdist workers (`-n 2 --dist loadfile
# --no-loadscope-reorder`), every test but those marked `alone`: about half of a test's wall time
# here is waiting (on processes starting, on timeouts, on pip and podman writing to disk), so two at
# once fill the cores. Each file runs on one worker, so module fixtures are made once (the install
# tests' wheel is shared through a lock: tests/install/conftest.py), and the files that run
# longest (the container image build, the venvs, the notebook, the lab) start first, so that
# neither worker is left with a long tail. (Not `--dist loadgroup`: pytest-xdist 3.8 groups by
# rewriting `item._nodeid`, which pytest 9.2's items no longer read.) Then, in one process, the
# tests marked `alone`: the averaging and optimizer tests run several peers in one process against
# round deadlines learned from their own first rounds, and a neighbour test's load arriving between
# those rounds made a round miss its deadline (twice in four runs on two workers).
_LONGEST_FIRST = ("tests/docker/", "tests/install/", "tests/examples/", "tests/testing/", "tests/demo/",
                  "tests/test_types.py")
_ALONE = ("tests/averaging/", "tests/optim/")


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.partition("::")[0]
    return next((i for i, prefix in enumerate(_LONGEST_FIRST) if path.startswith(prefix)), len(_LONGEST_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(_ALONE):
            item.add_marker(pytest.mark.alone)
        if is_torch_free(item.nodeid):  # tests/torch_free.py: what runs without torch
            item.add_marker(pytest.mark.torch_free)
    items.sort(key=_rank)  # stable: the order within a file stays as collected
