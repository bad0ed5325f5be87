"""The suite's torch-free part: the tests that run where torch is not installed.

They are the tests of the layers an infrastructure node runs (core, metrics, net, dht, the CLI,
their security tests) and the checks of the package itself, less the files below that need torch.
tests/conftest.py marks them `torch_free`; tests/install/test_pythons.py runs exactly these, on
Python 3.12 and 3.13, in venvs without torch, so a file here that imports torch fails there.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent

PATHS: tuple[str, ...] = (
    "tests/core/",
    "tests/metrics/",
    "tests/net/",
    "tests/dht/",
    "tests/cli/",
    "tests/security/",
    "tests/test_import.py",
    "tests/test_layers.py",
    "tests/test_torch_free.py",
)
"""Folders and files of the torch-free part (paths from the repository root)."""

NEEDS_TORCH: tuple[str, ...] = (
    "tests/metrics/test_subsystem_metrics.py",  # counts averaging rounds and expert calls
    "tests/net/test_relay_averaging.py",  # averages tensors through a relay
    "tests/net/test_streaming.py",  # tensor streams
    "tests/net/test_tls.py",  # averages tensors over TLS
    "tests/security/test_dht_flooding.py",
    "tests/security/test_expert_hijack.py",
    "tests/security/test_self_records.py",
    "tests/security/test_server_lockout.py",
    "tests/security/test_slow_body.py",
    "tests/security/test_source_limits.py",
    "tests/security/test_server_source_limits.py",  # its scenario holds an averager to its share
    "tests/core/test_collector.py::test_a_peer_that_averages_freezes_what_it_imported",
    "tests/cli/test_status.py::test_lists_experts_by_prefix_through_the_dht",  # serves experts
)
"""Files and single tests under `PATHS` that need torch (experts, averaging, tensors); they run
with the full suite."""


def is_torch_free(nodeid: str) -> bool:
    """Whether a test (its pytest node id, relative to the repository root) is in the torch-free part."""
    if not nodeid.startswith("tests/"):
        nodeid = f"tests/{nodeid}"
    return nodeid.startswith(PATHS) and not any(nodeid == n or nodeid.startswith((f"{n}::", f"{n}["))
                                                for n in NEEDS_TORCH)


def pytest_args() -> list[str]:
    """pytest's arguments that select the torch-free part (run from the repository root)."""
    return [*PATHS, *(f"--deselect={n}" if "::" in n else f"--ignore={n}" for n in NEEDS_TORCH), "-m", "torch_free"]
