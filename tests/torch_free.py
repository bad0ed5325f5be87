"""The suite's torch-free part: the tests that run where torch is not installed.

They are the tests of the layers an infrastructure node runs (core, metrics, net, dht, the CLI,
their security tests) and the checks of the package itself, less the files below that need torch.
tests/conftest.py marks them `torch_free`; tests/install/test_pythons.py runs them (by default less
`LONG`) on Python 3.12 and 3.13, in venvs without torch, so a file here that imports torch fails
there (and tests/test_torch_free.py, on 3.11, collects them where torch cannot be imported).
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
    "tests/core/test_collector.py::test_grpc_objects_the_freeze_holds_are_freed_before_the_interpreter_finalizes",
    "tests/cli/test_status.py::test_lists_experts_by_prefix_through_the_dht",  # serves experts
    "tests/cli/test_archive.py",  # an archiver of a run that trains
    "tests/cli/test_export.py",  # exports tensors (safetensors)
    "tests/security/test_private_swarm.py",  # averages and serves experts in a private swarm
)
"""Files and single tests under `PATHS` that need torch (experts, averaging, tensors); they run
with the full suite."""


LONG: tuple[str, ...] = (
    "tests/cli/test_cli.py",
    "tests/cli/test_private_cli.py",
    "tests/cli/test_status.py",
    "tests/dht/test_network.py",
    "tests/dht/test_processes.py",
    "tests/dht/test_timeouts.py",
    "tests/dht/test_dht.py::test_concurrent_single_gets_are_coalesced_into_shared_requests",
    "tests/dht/test_dht.py::test_large_values_travel_in_batches_under_the_message_limit",
    "tests/dht/test_dht.py::test_a_black_holed_replica_costs_a_writer_its_request_timeout_once_not_on_every_store_and_get",
    "tests/metrics/test_lazy_import.py",
    "tests/metrics/test_peer_metrics.py",
    "tests/metrics/test_prometheus.py",
    "tests/security/test_disjoint_lookups.py",
    "tests/security/test_identity_files.py",
    "tests/security/test_lying_node.py",
    "tests/security/test_sybil_diversity.py",
)
"""What the quick selection leaves out: swarms of many nodes or processes, seconds each, and tests
that race request timeouts of one or two seconds against the machine's load. On Python 3.12 and
3.13, scripts/test.sh runs the rest (tests/install/test_pythons.py); SWARM_TEST_PYTHONS=full runs all."""


def is_torch_free(nodeid: str) -> bool:
    """Whether a test (its pytest node id, relative to the repository root) is in the torch-free part."""
    if not nodeid.startswith("tests/"):
        nodeid = f"tests/{nodeid}"
    return nodeid.startswith(PATHS) and not any(nodeid == n or nodeid.startswith((f"{n}::", f"{n}["))
                                                for n in NEEDS_TORCH)


def pytest_args(quick: bool = False) -> list[str]:
    """pytest's arguments that select the torch-free part (run from the repository root); `quick`:
    less `LONG`."""
    left_out = NEEDS_TORCH + (LONG if quick else ())
    return [*PATHS, *(f"--deselect={n}" if "::" in n else f"--ignore={n}" for n in left_out), "-m", "torch_free"]
