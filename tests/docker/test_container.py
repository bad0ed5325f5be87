"""The `swarm-peer` image, built from docker/Dockerfile and run with rootful podman.

Containers on one podman network find each other the way docker/compose.yaml has them do: a
bootstrap peer announced by name, an expert server joining through `swarm-join`, a one-shot
`swarm-peer status` container asking them (through the DHT, once there is one); plus the health
probe, metrics inside the container, graceful stop with checkpoints saved, and the identity
surviving a restart on its volume; and docker/compose.yaml itself, brought up with podman-compose,
training for real: an expert server, two demo trainers averaging with each other, and the status
container reading the swarm through its DHT, with its bootstrap node from docker/Dockerfile.infra
(no torch), which a short test of its own also starts as a bootstrap and relay.

On by default wherever they can run: Linux, root, podman and podman-compose installed or apt-get
to install them (scripts/test.sh installs scripts/system-packages.txt as root; CI does). Elsewhere
they skip and say why; ``SWARM_CONTAINER_TESTS=0`` skips them on purpose. The image is built by
../shared/tools/container-smoke.sh (a debootstrap stand-in for python:3.11-slim, then `podman
build`): a few minutes cold, seconds warm. A CPU torch wheel in SWARM_WHEELS_DIR (default
/opt/wheels) is handed to the build through docker/wheels/.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import pytest
from procs import read_stdout_lines

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
SMOKE = Path(os.environ.get("SWARM_CONTAINER_SMOKE", REPO.parent / "shared" / "tools" / "container-smoke.sh"))
TAG = "localhost/swarm:test"
INFRA_TAG = "localhost/swarm-infra:test"
WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "swarm-container-smoke"
WHEELS = Path(os.environ.get("SWARM_WHEELS_DIR", "/opt/wheels"))
BUILD_TIMEOUT = 1500


def _why_not() -> str | None:
    if os.environ.get("SWARM_CONTAINER_TESTS") == "0":
        return "SWARM_CONTAINER_TESTS=0 turns the container tests off"
    if not sys.platform.startswith("linux"):
        return "podman containers need Linux"
    if os.geteuid() != 0:
        return "needs root: the image is built and run with rootful podman"
    if not SMOKE.is_file():
        return f"{SMOKE} not found (CI keeps shared/ beside the clone)"
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        return "podman is not installed and apt-get is not available to install it"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(BUILD_TIMEOUT + 300),
    pytest.mark.skipif(_why_not() is not None, reason=_why_not() or ""),
]


def podman_env() -> dict[str, str]:
    # the smoke script's containers.conf: runc (crun refuses hybrid cgroups) and explicit ulimits
    return {**os.environ, "CONTAINERS_CONF": str(WORK / "containers.conf")}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env(),
                            check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def _context(tmp: Path) -> Path:
    """A copy of the repository as build context, with a local torch wheel in docker/wheels/."""
    context = tmp / "context"
    shutil.copytree(REPO, context, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "demo-out", "*.whl"))
    for wheel in sorted(WHEELS.glob("torch-*-cp311-cp311-*x86_64.whl")):
        target = context / "docker" / "wheels" / wheel.name
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
    return context


def _build(tmp_path_factory: pytest.TempPathFactory, tag: str, dockerfile: str) -> str:
    """Builds `dockerfile` as `tag` with the smoke script (which also runs the image's `--help`)."""
    context = _context(tmp_path_factory.mktemp("image"))
    env = {**os.environ, "WORK": str(WORK), "TAG": tag, "CONTEXT": str(context),
           "DOCKERFILE": str(context / "docker" / dockerfile),
           "BUILDAH_FORMAT": "docker"}  # keeps HEALTHCHECK (the OCI format has none)
    started = time.monotonic()
    result = subprocess.run(["bash", str(SMOKE), "--help"], capture_output=True, text=True, env=env,
                            timeout=BUILD_TIMEOUT, check=False)
    took = time.monotonic() - started
    print(f"\nimage {tag}: built and smoke-run in {took:.0f} s", file=sys.stderr)
    if result.returncode != 0:
        if shutil.which("podman") is None:
            pytest.skip(f"podman could not be installed: {result.stderr[-500:]}")
        info = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=60, env=podman_env(),
                              check=False)
        if info.returncode != 0:
            pytest.skip(f"podman cannot run here: {info.stderr[-500:]}")
        raise AssertionError(f"image build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    assert "--initial-peers" in result.stdout, result.stdout[-2000:]
    return tag


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _build(tmp_path_factory, TAG, "Dockerfile")


@pytest.fixture(scope="module")
def infra_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """docker/Dockerfile.infra: swarm-peer without torch, the compose swarm's bootstrap node and relay."""
    return _build(tmp_path_factory, INFRA_TAG, "Dockerfile.infra")


@pytest.fixture
def network(image: str) -> Iterator[str]:
    name = f"swarm-test-{uuid.uuid4().hex[:8]}"
    podman("network", "create", name)  # user networks resolve container names and aliases
    yield name
    podman("network", "rm", "-f", name, check=False)


@pytest.fixture
def volumes() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for volume in made:
        podman("volume", "rm", "-f", volume, check=False)


class Container:
    """`podman run` attached: stdout lines are the peer's printed addresses; stop() is SIGTERM."""

    def __init__(self, image: str, *args: str, network: str, alias: str | None = None,
                 volume: str | None = None, env: dict[str, str] | None = None, entrypoint: str | None = None,
                 expect_lines: int = 1, timeout: float = 60) -> None:
        self.name = f"swarm-test-{alias or 'peer'}-{uuid.uuid4().hex[:6]}"
        cmd = ["podman", "run", "--rm", "--name", self.name, "--network", network]
        if alias:
            cmd += ["--network-alias", alias]
        if volume:
            cmd += ["-v", f"{volume}:/data"]
        for key, value in (env or {}).items():
            cmd += ["-e", f"{key}={value}"]
        if entrypoint:
            cmd += ["--entrypoint", entrypoint]
        self.proc = subprocess.Popen([*cmd, image, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=podman_env())
        self.lines = self.read_lines(expect_lines, timeout)

    def read_lines(self, count: int, timeout: float) -> list[str]:
        return read_stdout_lines(self.proc, count, timeout, self.name, self.kill, self.stderr)

    def exec(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *args, timeout=timeout, check=False)

    def stop(self, grace: int = 20) -> int:
        podman("stop", "-t", str(grace), self.name, check=False, timeout=grace + 30)
        return self.proc.wait(grace + 30)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read() if self.proc.stderr else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            podman("rm", "-f", "-t", "0", self.name, check=False)
            self.proc.wait(30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


def run_once(image: str, network: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess:
    extra = ["--entrypoint", entrypoint] if entrypoint else []
    return podman("run", "--rm", "--network", network, *extra, image, *args, check=False)


def peer_id(addr: str) -> str:
    return addr.rsplit("/", 1)[1]


def test_image_is_small_unprivileged_and_probes_itself(image: str):
    inspect = json.loads(podman("image", "inspect", image).stdout)[0]
    config = inspect["Config"]
    assert config["User"] == "swarm" and config["Entrypoint"] == ["swarm-peer"]
    assert "/data" in config["Volumes"]
    assert {"SWARM_IDENTITY=/data/identity.key", "SWARM_CHECKPOINT_DIR=/data/checkpoints"} <= set(config["Env"])
    healthcheck = inspect.get("Healthcheck") or config.get("Healthcheck")  # podman / docker
    assert healthcheck["Test"][-5:] == ["swarm-peer", "status", "--self", "--timeout", "3"]
    uid = podman("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip()
    assert uid != "0"
    print(f"\nimage size: {inspect['Size'] / 2**20:.0f} MiB", file=sys.stderr)
    # the probe fails where no peer serves
    result = podman("run", "--rm", "--entrypoint", "swarm-peer", image, "status", "--self", "--timeout", "2",
                    check=False)
    assert result.returncode == 1 and "unhealthy" in result.stderr, result.stderr


def test_containers_find_each_other_by_name(image: str, network: str, volumes: list[str]):
    volume, expert_volume = f"swarm-test-{uuid.uuid4().hex[:8]}", f"swarm-test-{uuid.uuid4().hex[:8]}"
    volumes += [volume, expert_volume]
    boot_env = {"SWARM_ANNOUNCE": "/dns4/bootstrap/tcp/31337", "SWARM_METRICS_PORT": "9477"}
    with Container(image, network=network, alias="bootstrap", volume=volume, env=boot_env) as boot:
        boot_addr = boot.lines[0]
        assert boot_addr.startswith("/dns4/bootstrap/tcp/31337/p2p/12D3KooW"), boot.lines
        health = podman("healthcheck", "run", boot.name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr

        join_env = {"SWARM_BOOTSTRAP": "/dns4/bootstrap/tcp/31337", "SWARM_ANNOUNCE": "/dns4/expert/tcp/31337",
                    "SWARM_EXPERTS": "ffn.[0:2].[0:2]", "SWARM_EXPERT_CLS": "ffn", "SWARM_HIDDEN_DIM": "64"}
        with Container(image, network=network, alias="expert", env=join_env, entrypoint="swarm-join",
                       volume=expert_volume, timeout=120) as second:
            second_addr = second.lines[0]
            assert second_addr.startswith("/dns4/expert/tcp/31337/p2p/12D3KooW"), second.lines

            # the second container calls the first's Info
            asked = second.exec("swarm-peer", "status", "--initial-peers", boot_addr, "--json")
            assert asked.returncode == 0, asked.stderr
            assert json.loads(asked.stdout)["peers"][0]["peer_id"] == peer_id(boot_addr)

            # a third, one-shot container sees both; with a DHT, naming the bootstrap is enough
            result = run_once(image, network, "status", "--initial-peers", boot_addr, "--prefix", "ffn.", "--json")
            assert result.returncode == 0, result.stderr
            view = json.loads(result.stdout)
            if not view["dht"]:
                result = run_once(image, network, "status", "--initial-peers", boot_addr, second_addr, "--json")
                assert result.returncode == 0, result.stderr
                view = json.loads(result.stdout)
            else:
                assert sorted(view["dht_experts"]["ffn."]) == ["ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1"], view
                assert set(view["dht_experts"]["ffn."].values()) == {second_addr}
            assert {p["peer_id"] for p in view["peers"]} == {peer_id(boot_addr), peer_id(second_addr)}, view
            print(f"\nstatus from a third container:\n{json.dumps(view, indent=1)}", file=sys.stderr)

            scrape = boot.exec("python", "-c", "import urllib.request as u; "
                               "print(u.urlopen('http://127.0.0.1:9477/metrics', timeout=5).read().decode())")
            assert scrape.returncode == 0, scrape.stderr
            assert 'swarm_rpc_server_calls_total{method="/swarm.Peer/Info",outcome="ok"}' in scrape.stdout

            assert second.stop() == 0  # SIGTERM: clean exit
            assert f"bootstrap peer is {boot_addr}" in second.stderr()
        saved = podman("run", "--rm", "-v", f"{expert_volume}:/data", "--entrypoint", "ls", image, "/data/checkpoints")
        assert saved.stdout.split(), "the expert server saved no checkpoint at shutdown"
        assert boot.stop() == 0
        assert "Traceback" not in boot.stderr()

    # the identity lives on the volume: same PeerID after a restart
    with Container(image, network=network, alias="bootstrap", volume=volume, env=boot_env) as again:
        assert again.lines == [boot_addr]
        assert again.stop() == 0


PROGRESS = re.compile(r"^(trainer-\d)\s+loss\s+([\d.]+) \| +[\d.]+ samples/s \| (\d+) peers \| epoch +(\d+)",
                      re.MULTILINE)


def compose_logs(project: str, service: str) -> str:
    return podman("logs", f"{project}_{service}_1", check=False).stdout


def follow_progress(project: str, services: tuple[str, ...], timeout: float) -> dict[str, tuple[float, int, int]]:
    """Reads the trainers' logs as they come (`podman logs -f`) until each has trained with the others
    (>= 2 peers) past a collective step (epoch >= 1), or `timeout`; returns their last progress."""
    seen: dict[str, tuple[float, int, int]] = {}
    procs = [subprocess.Popen(["podman", "logs", "-f", f"{project}_{s}_1"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=podman_env()) for s in services]
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as sel:
            for proc in procs:
                sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline and sel.get_map():
                for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                    line = key.fileobj.readline()
                    if not line:
                        sel.unregister(key.fileobj)
                        continue
                    for name, loss, peers, epoch in PROGRESS.findall(line):
                        seen[name] = (float(loss), int(peers), int(epoch))
                if len(seen) == len(services) and all(p >= 2 and e >= 1 for _, p, e in seen.values()):
                    break
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
    return seen


@pytest.fixture
def infra_network(infra_image: str) -> Iterator[str]:
    name = f"swarm-test-{uuid.uuid4().hex[:8]}"
    podman("network", "create", name)
    yield name
    podman("network", "rm", "-f", name, check=False)


def test_the_infra_image_has_no_torch_and_serves_as_bootstrap_and_relay(infra_image: str, infra_network: str,
                                                                        volumes: list[str]) -> None:
    network = infra_network
    inspect = json.loads(podman("image", "inspect", infra_image).stdout)[0]
    assert inspect["Config"]["User"] == "swarm" and inspect["Config"]["Entrypoint"] == ["swarm-peer"]
    print(f"\ninfra image size: {inspect['Size'] / 1e6:.1f} MB", file=sys.stderr)
    assert inspect["Size"] <= 150e6, f"the infrastructure image holds {inspect['Size'] / 1e6:.1f} MB (goal: 150)"
    missing = podman("run", "--rm", "--entrypoint", "python", infra_image, "-c",
                     "import importlib.util as u; print([n for n in ('torch', 'numpy') if u.find_spec(n)])")
    assert missing.stdout.strip() == "[]", missing.stdout
    volume = f"swarm-test-{uuid.uuid4().hex[:8]}"
    volumes.append(volume)
    env = {"SWARM_ANNOUNCE": "/dns4/bootstrap/tcp/31337", "SWARM_REACHABILITY": "public", "SWARM_RELAY": "on"}
    with Container(infra_image, network=network, alias="bootstrap", volume=volume, env=env) as boot:
        addr = boot.lines[0]
        assert addr.startswith("/dns4/bootstrap/tcp/31337/p2p/12D3KooW"), boot.lines
        health = podman("healthcheck", "run", boot.name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr
        # another container of the same image joins through it and sees it (a DHT of two)
        result = run_once(infra_image, network, "status", "--initial-peers", addr, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["peers"][0]["peer_id"] == peer_id(addr)
        assert boot.stop() == 0
        assert "Traceback" not in boot.stderr()


def test_compose_swarm_trains_and_the_status_container_reads_it(image: str, infra_image: str) -> None:
    if shutil.which("podman-compose") is None:
        pytest.skip("podman-compose is not installed (Debian package; scripts/test.sh installs it as root)")
    project = f"swarmtest{uuid.uuid4().hex[:8]}"
    # the image built above; ports published on loopback only, on ports the kernel picks
    env = {**podman_env(), "SWARM_IMAGE": image, "SWARM_INFRA_IMAGE": infra_image, "SWARM_TRAIN_SECONDS": "600",
           "SWARM_PUBLISH_PORT": "127.0.0.1:", "SWARM_EXPERT_PUBLISH_PORT": "127.0.0.1:",
           "SWARM_METRICS_PUBLISH_PORT": "", "SWARM_LOG_LEVEL": "WARNING"}

    def compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["podman-compose", "-p", project, "-f", str(COMPOSE), *args], env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    try:
        up = compose("up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        # both trainers train with each other: 2 peers in the run, and a collective step (averaged)
        seen = follow_progress(project, ("trainer-1", "trainer-2"), timeout=300)
        logs = {s: compose_logs(project, s)[-2000:] for s in ("bootstrap", "expert", "trainer-1", "trainer-2")}
        assert len(seen) == 2 and all(p >= 2 and e >= 1 for _, p, e in seen.values()), f"{seen}\n{logs}"
        assert all(0 < loss < 6.0 for loss, _, _ in seen.values()), seen  # ln 256 = 5.5 untrained

        # the status service reads the swarm through its DHT: the experts and both trainers' progress
        status = compose("run", "--rm", "--no-deps", "status", "--prefix", "ffn.", "--key", "swarm-demo.progress",
                         "--json", timeout=180)
        assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-3000:]
        view, _ = json.JSONDecoder().raw_decode(status.stdout[status.stdout.index("{"):])  # podman-compose adds a line
        assert view["dht"] and sorted(view["dht_experts"]["ffn."]) == ["ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1"]
        progress = json.dumps(view["records"]["swarm-demo.progress"])
        assert len(set(re.findall(r"12D3KooW\w+", progress))) >= 2, progress  # one record per trainer (subkey: PeerID)
        print(f"\ncompose swarm: {seen}\nstatus: {json.dumps(view, indent=1)[:2000]}", file=sys.stderr)
    finally:
        # the containers with their anonymous /data volumes (`down` keeps those), then what `down` removes
        names = podman("ps", "-a", "-q", "--filter", f"label=io.podman.compose.project={project}", check=False)
        for container in names.stdout.split():
            podman("rm", "-f", "-v", "-t", "10", container, check=False, timeout=60)
        compose("down", "-v", "-t", "10", timeout=180)
        podman("network", "rm", "-f", f"{project}_default", check=False)
        for volume in podman("volume", "ls", "-q", "--filter", f"label=io.podman.compose.project={project}",
                             check=False).stdout.split():
            podman("volume", "rm", "-f", volume, check=False)
