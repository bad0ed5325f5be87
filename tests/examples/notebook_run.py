"""Runs `examples/colab_join.ipynb` top to bottom in a fresh Jupyter kernel against a local swarm.

Used by tests/examples/test_colab_notebook.py (the kernel imports this checkout, with the newest
versions of everything in .venv) and tests/install/test_colab_pins.py (the kernel runs in a venv
holding a stock Colab runtime's packages and the notebook installs swarm's wheel itself).

`run_notebook` starts what a volunteer's reachable machine would run: an expert server holding the demo
model's experts and one full demo trainer, so the notebook has experts to call and a partner to
average with. It then replaces the notebook's parameters cell (papermill-style: the cell tagged
"parameters") to point at that swarm, skip the install (the kernel imports this checkout) and train
briefly, executes every cell with nbclient, and reads the outputs: the notebook joined (≥ 2 peers in
the run), trained (steps, loss values, averaging rounds) and left cleanly (`check_outputs`).
"""

from __future__ import annotations

import ast
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from procs import PeerProcess

from swarm.demo.events import Progress, from_json
from swarm.demo.model import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "colab_join.ipynb"
TRAIN_SECONDS = 20.0
KERNEL_NAME = "swarm-notebook-test"
JUPYTER_VARS = ("JUPYTER_PATH", "IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_CONFIG_DIR")


class DemoTrainer:
    """`python -m swarm.demo.trainer --json` (a full peer), its events read from stdout as they come."""

    def __init__(self, initial_peer: str, log_path: Path) -> None:
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.demo.trainer", "--json", "--name", "full", "--initial-peers", initial_peer,
             "--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1", "--duration", "600",
             "--hidden-dim", str(ModelConfig().hidden_dim), "--log-level", "INFO"],
            stdout=subprocess.PIPE, stderr=self._log, text=True,
            # faulthandler: an abort (one run's trainer died at exit with "terminate called without
            # an active exception") shows every thread's Python stack in the log
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
        )
        self.events: list[object] = []

    def wait_for_progress(self, timeout: float) -> Progress:
        """Reads events until the first progress report (the trainer found its experts and trains)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                assert left > 0 and sel.select(left), f"the trainer did not train within {timeout} s:\n{self.log()}"
                line = self.proc.stdout.readline()
                assert line, f"the trainer exited ({self.proc.wait()}):\n{self.log()}"
                event = from_json(line)
                self.events.append(event)
                if isinstance(event, Progress):
                    return event

    def stop(self, timeout: float = 30.0) -> int:
        """One SIGINT (the trainer finishes its step and leaves), then the rest of its events."""
        self.proc.send_signal(signal.SIGINT)
        rest, _ = self.proc.communicate(timeout=timeout)
        self.events += [from_json(line) for line in rest.splitlines()]
        return self.proc.returncode

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


def inject_parameters(nb: Any, **values: object) -> None:
    """Replaces the source of the cell tagged "parameters", keeping exactly the names it defines."""
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = {t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign) for t in node.targets}
    assert names == set(values), f"the notebook's parameters are {sorted(names)}"
    cell.source = "\n".join(f"{name} = {value!r}" for name, value in values.items())


def find(pattern: str, text: str) -> re.Match[str]:
    match = re.search(pattern, text)
    assert match, f"no {pattern!r} in the notebook's output:\n{text}"
    return match


def cell_text(cell: Any) -> str:
    """What a cell showed: its stream output and the text form of what it displayed."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "\n".join(parts)


@contextmanager
def notebook_kernel(tmp_path: Path, python: str, env: dict[str, str]) -> Iterator[Any]:
    """A notebook client with a fresh IPython kernel of `python` started (or a skip)."""
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: no Jupyter kernel to run")
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: no Jupyter kernel to run")
    # A kernelspec of exactly that interpreter, so the kernel imports what it has installed.
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "swarm test", "language": "python"}))
    saved = {k: os.environ.get(k) for k in JUPYTER_VARS}
    os.environ.update({
        "JUPYTER_PATH": str(tmp_path / "jupyter"),
        # keep the kernel's profile, connection files and config out of the home directory
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter" / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter" / "config"),
    })
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name=KERNEL_NAME, shutdown_kernel="graceful",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        try:
            client.km = client.create_kernel_manager()
            # unix sockets, not TCP ports: a port picked free can be taken by a test's own peers
            # before the kernel binds it (seen: the heartbeat's bind failed, and the client hung)
            client.km.transport = "ipc"
            client.km.ip = str(tmp_path / "kernel")
            client.start_new_kernel(env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                                    cwd=str(tmp_path))
            client.start_new_kernel_client()
        except Exception as e:  # noqa: BLE001 - any reason a kernel cannot start here is a reason to skip
            if client.km is not None and client.km.has_kernel:
                client._cleanup_kernel()
            pytest.skip(f"a Jupyter kernel cannot start here: {type(e).__name__}: {e}")
        try:
            yield client
        finally:
            if client.km is not None:
                client._cleanup_kernel()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_notebook(tmp_path: Path, python: str, env: dict[str, str], install: str) -> tuple[Any, list[object], str]:
    """Runs the notebook in a kernel of `python` against a local expert server and demo trainer.

    Returns the executed notebook and the events of the full demo trainer it trained with.
    """
    import nbformat  # notebook_kernel skips where it is missing

    model = ModelConfig()
    with notebook_kernel(tmp_path, python, env) as kernel, PeerProcess(
            "--listen", "/ip4/127.0.0.1/tcp/0", "--experts", model.expert_pattern, "--expert-cls", "ffn",
            "--hidden-dim", str(model.hidden_dim), "--log-level", "WARNING",
            ready_timeout=60) as server:  # it starts beside the kernel's own torch import, on a loaded CI box
        full = DemoTrainer(server.addrs[0], tmp_path / "full-trainer.log")
        try:
            full.wait_for_progress(timeout=60)
            nb = kernel.nb
            inject_parameters(nb, INITIAL_PEERS=[server.addrs[0]], INSTALL=install, TRAIN_SECONDS=TRAIN_SECONDS,
                              RUN_ID="swarm-demo", HIDDEN_DIM=model.hidden_dim, NAME="colab", SAMPLE_BYTES=8)
            try:
                kernel.execute()
            finally:
                nbformat.write(nb, tmp_path / "executed.ipynb")  # what the notebook showed, to read on failure
            assert full.stop() == 0, full.log()
            log = full.log()
        finally:
            full.close()
        assert server.stop() == 0, server.stderr_text()
    return nb, full.events, log


def check_outputs(nb: Any, full_events: list[object], full_log: str) -> str:
    """Asserts the notebook joined, trained and left; returns all that it printed."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    texts = [cell_text(c) for c in code]
    everything = "\n".join(texts)
    print(everything)  # shown by pytest on failure
    for noise in ("Traceback", "Task was destroyed", "Exception ignored", "RuntimeWarning"):
        assert noise not in everything, everything
    assert not [c for c in code if c.execution_count is None], "every code cell ran"

    # joined: in client mode, and the DHT (read with `await`) shows the run's other trainer and the experts
    find(r"joined as 12D3KooW\w+ in client mode", everything)
    # the mode the run's first trainer picked for its link (loopback: large-batch), followed and printed
    find(r"mode: large-batch.*the run's mode", everything)
    assert int(find(r"peers in run 'swarm-demo': (\d+)", everything).group(1)) >= 2, everything
    find(r"experts of the mixture layer: 4 of 4 alive", everything)

    # trained: the board's last state, the summary's steps, losses and averaging rounds
    board = next(cell_text(c) for c in code if "trainer.train()" in c.source)
    row = find(r"colab +loss +([\d.]+) \| +[\d.]+ samples/s \| (\d+) peers \| epoch +(\d+)", board)
    assert int(row.group(2)) >= 2, board
    assert int(find(r"trained (\d+) steps \((\d+) samples\)", everything).group(1)) > 0, everything
    losses = find(r"training loss ([\d.]+) -> ([\d.]+); held-out loss ([\d.]+) -> ([\d.]+)", everything)
    assert all(0 < float(v) < 6.0 for v in losses.groups()), everything  # ln 256 = 5.5 untrained
    rounds = int(find(r"averaging rounds: (\d+) averaged", everything).group(1))
    assert rounds >= 1, f"{everything}\nthe full trainer's log:\n{full_log}"
    find(r"colab +sample after training:", everything)

    # left cleanly: its loop thread stopped, and the full trainer had seen it in the run
    find(r"left the swarm: peer 12D3KooW\w+ shut down", texts[-1])
    assert max(e.peers for e in full_events if isinstance(e, Progress)) >= 2
    return everything
