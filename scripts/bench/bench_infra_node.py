#!/usr/bin/env python
"""An infrastructure node (swarm installed without torch) against today's DHT-only daemon (the same
`swarm-peer`, from the full install with torch), in one invocation, one line per figure:

  * start: from launching `python -m swarm` to its address line, median and max over --starts
    launches of each, taking turns;
  * RSS of each daemon idle, once --nodes of a kind have joined each other;
  * RSS under load: a client-mode peer in this process makes --ops concurrent stores, then gets
    (bench_dht.py's throughput load, --in-flight at once) through those daemons; the peak RSS of
    each daemon, sampled every 50 ms, and the operations per second;
  * whether any daemon mapped torch or numpy (read from /proc/<pid>/maps).

Both kinds run the checkout's code: today's from this interpreter's venv (.venv, editable, with
torch), the infrastructure node from a venv without torch (--infra-venv; made on first use with
`pip install -e <checkout>`, no extras, and kept).

With --install, it also measures the two installs from swarm's wheel into fresh venvs, as a
user would make them: `pip install swarm_peer-*.whl` against `pip install "swarm_peer-*.whl[torch]"`
(torch from this machine's local CPU wheel, the rest from the package index, pip's cache off):
seconds and the venv's size. That takes minutes (torch unpacks ~900 MB).

Usage: .venv/bin/python scripts/bench/bench_infra_node.py [--nodes 4] [--starts 5] [--ops 3000]
       [--in-flight 300] [--infra-venv DIR] [--install]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dht import throughput  # the DHT benchmark's load


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        text = f.read()
    return {name for name in ("torch", "numpy") if f"/{name}/" in text or f"/{name}." in text}


def start(python: str, initial: list[str]) -> tuple[subprocess.Popen, str, float]:
    """A daemon on loopback; its first address and the seconds from launch to that line."""
    args = [python, "-m", "swarm", "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "WARNING"]
    for addr in initial:
        args += ["--initial-peers", addr]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            cwd=tempfile.gettempdir())
    line = proc.stdout.readline().strip()
    took = time.perf_counter() - t0
    if not line.startswith("/ip4/"):
        proc.kill()
        raise RuntimeError(f"{python} -m swarm did not start (exit {proc.wait()})")
    return proc, line, took


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def infra_venv(path: Path) -> str:
    python = path / "bin" / "python"
    if not python.is_file():
        print(f"# making {path}: the checkout, editable, without torch", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        constraints = path / "constraints.txt"
        constraints.write_text("".join(f"{line}\n" for line in CONSTRAINTS.read_text().splitlines()
                                       if not line.startswith("torch")))
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(constraints), "-e", str(ROOT)],
                       check=True)
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
                           capture_output=True, text=True, check=True)
    if probe.stdout.strip() != "None":
        raise SystemExit(f"{path} holds torch: not an infrastructure install")
    return str(python)


def under_load(addrs: list[str], pids: list[int], ops: int, in_flight: int) -> tuple[list[float], float, float]:
    """Peak RSS of each daemon while a client-mode peer (a process of its own, as each kind gets a
    fresh one) stores, then gets, `ops` keys through them; and its stores/s and gets/s."""
    peaks = {pid: rss_mb(pid) for pid in pids}
    client = subprocess.Popen([sys.executable, __file__, "--client", str(ops), str(in_flight), *addrs],
                              stdout=subprocess.PIPE, text=True)
    while client.poll() is None:
        for pid in pids:
            peaks[pid] = max(peaks[pid], rss_mb(pid))
        time.sleep(0.05)  # a sampling period, not a wait for an event
    out = client.stdout.read().split() if client.stdout else []
    if client.returncode != 0 or len(out) != 2:
        raise RuntimeError(f"the load client failed ({client.returncode}): {out}")
    return [peaks[pid] for pid in pids], float(out[0]), float(out[1])


def load_client(ops: int, in_flight: int, addrs: list[str]) -> None:
    import swarm

    with swarm.Peer(initial_peers=addrs, listen="/ip4/127.0.0.1/tcp/0", client_mode=True) as client:
        stores, gets = client.run(throughput(client.dht, ops, in_flight), timeout=600)
    print(f"{stores:.1f} {gets:.1f}", flush=True)


def network(python: str, nodes: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addrs = [], []
    for _ in range(nodes):
        proc, addr, _ = start(python, addrs[:1])
        procs.append(proc)
        addrs.append(addr)
    return procs, addrs


def summary(values: list[float], unit: str) -> str:
    return f"median {statistics.median(values):.1f} {unit}, max {max(values):.1f} {unit} (n={len(values)})"


def measure_installs() -> None:
    with tempfile.TemporaryDirectory(prefix="swarm-install-") as tmp:
        dist = Path(tmp) / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
                       check=True)
        (wheel,) = dist.glob("*.whl")
        env = {**os.environ, "PIP_NO_CACHE_DIR": "1"}
        for label, spec in (("today (with torch)", f"{wheel}[torch]"), ("infrastructure (no torch)", str(wheel))):
            venv = Path(tmp) / label.split()[0]
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            t0 = time.perf_counter()
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), spec],
                           check=True, env=env)
            took = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20
            print(f"install {label}: {took:.0f} s, venv {size:.0f} MB", flush=True)
            shutil.rmtree(venv)


def main() -> None:
    if sys.argv[1:2] == ["--client"]:  # the load, in a process of its own
        load_client(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="daemons of each kind in its network")
    parser.add_argument("--starts", type=int, default=5, help="timed launches of each kind")
    parser.add_argument("--ops", type=int, default=3000, help="concurrent stores, then gets, for the load")
    parser.add_argument("--in-flight", type=int, default=300)
    parser.add_argument("--infra-venv", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swarm-bench-infra")
    parser.add_argument("--install", action="store_true", help="also time both installs into fresh venvs")
    args = parser.parse_args()
    kinds = {"today (DHT-only daemon, full install)": sys.executable,
             "infrastructure node (no torch)": infra_venv(args.infra_venv)}

    starts: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.starts):  # taking turns, so both meet the same load of the machine
        for label, python in kinds.items():
            proc, _, took = start(python, [])
            starts[label].append(took)
            stop([proc])
    for label in kinds:
        print(f"start to addresses, {label}: {summary(starts[label], 's')}", flush=True)

    for label, python in kinds.items():
        procs, addrs = network(python, args.nodes)
        try:
            pids = [p.pid for p in procs]
            idle = [rss_mb(pid) for pid in pids]
            peaks, stores, gets = under_load(addrs, pids, args.ops, args.in_flight)
            libraries = set().union(*(mapped(pid) for pid in pids))
        finally:
            stop(procs)
        print(f"RSS idle, {label}: {summary(idle, 'MB')}", flush=True)
        print(f"RSS under load (peak), {label}: {summary(peaks, 'MB')}; "
              f"{stores:.0f} stores/s, {gets:.0f} gets/s through {args.nodes} daemons", flush=True)
        print(f"mapped by the daemons, {label}: {', '.join(sorted(libraries)) or 'neither torch nor numpy'}",
              flush=True)
    if args.install:
        measure_installs()


if __name__ == "__main__":
    main()
