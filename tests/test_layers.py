"""The package's imports point down its layers, with no cycles (docs/architecture.md, "Layers").

Every import counts: at module level, inside functions (lazy) and under ``TYPE_CHECKING``. A
module may import from its own layer's package or any layer below; a cycle between modules is
an error even inside one package. Read from the source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "swarm"

LAYERS: list[tuple[str, ...]] = [
    ("swarm.core",),
    ("swarm.metrics",),  # instrumentation: the network, averaging and experts count into it
    ("swarm.checkpoint",),  # a run's checkpoints on disk: pure, no torch, no network
    ("swarm.proto",),
    ("swarm.net",),
    ("swarm.dht",),
    ("swarm.compression",),
    ("swarm.averaging", "swarm.moe"),  # side by side: neither imports the other
    ("swarm.optim",),
    ("swarm.peer",),
    ("swarm.dashboard",),  # the swarm's live page, served by a daemon or its own client process
    ("swarm.cli", "swarm.demo", "swarm.integrations"),  # integrations: users' training loops on a Peer
    ("swarm.testing",),  # the network lab starts daemons and demo trainers as processes
    ("swarm", "swarm.__main__"),
]
"""Bottom to top; packages in one tuple are side by side."""

KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The swarm modules `name` imports anywhere in its source (a package import counts as its __init__)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            targets = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> tuple[int, str]:
    best = (-1, "")
    for index, group in enumerate(LAYERS):
        for prefix in group:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (index, prefix)
    return best


def test_every_module_has_a_layer() -> None:
    assert [name for name in MODULES if _layer(name)[0] < 0] == []


def test_imports_point_down_the_layers() -> None:
    upward = []
    for name, targets in GRAPH.items():
        layer, package = _layer(name)
        for target in targets:
            target_layer, target_package = _layer(target)
            if (name, target) in KNOWN_EXCEPTIONS:
                continue
            if target_layer > layer or (target_layer == layer and target_package != package):
                upward.append(f"{name} -> {target}")
    assert sorted(upward) == []


MOE_LAYERS: list[tuple[str, ...]] = [
    ("swarm.moe.uids", "swarm.moe.schema", "swarm.moe.rows", "swarm.moe.magnitudes"),  # names, schemas, row maps, norms
    ("swarm.moe.protocol", "swarm.moe.dht_declare", "swarm.moe.sources"),  # calls, DHT records, expert sources
    ("swarm.moe.group_calls",),  # several experts of one server on one stream, both sides
    ("swarm.moe.client", "swarm.moe.server"),  # side by side: neither imports the other
    ("swarm.moe",),
]
"""Inside `swarm.moe`, bottom to top: what client and server share, then each of them."""


def _moe_layer(name: str) -> tuple[int, str]:
    best = (-1, "")
    for index, group in enumerate(MOE_LAYERS):
        for prefix in group:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (index, prefix)
    return best


def test_every_moe_module_has_an_inner_layer() -> None:
    assert [name for name in MODULES if name.startswith("swarm.moe") and _moe_layer(name)[0] < 0] == []


def test_moe_imports_point_down_its_inner_layers() -> None:
    upward = []
    for name, targets in GRAPH.items():
        if not name.startswith("swarm.moe"):
            continue
        layer, package = _moe_layer(name)
        for target in targets:
            if not target.startswith("swarm.moe"):
                continue
            target_layer, target_package = _moe_layer(target)
            if target_layer > layer or (target_layer == layer and target_package != package):
                upward.append(f"{name} -> {target}")
    assert sorted(upward) == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {n: {t for t in ts if (n, t) not in KNOWN_EXCEPTIONS} for n, ts in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("source", ["from swarm.peer import Peer\n", "import swarm.moe.server.expert_server\n"])
def test_the_checker_sees_an_upward_import(source: str, tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source)
    MODULES["swarm.net.fake"] = path
    try:
        targets = _imports("swarm.net.fake", path)
    finally:
        del MODULES["swarm.net.fake"]
    assert targets and all(_layer(t)[0] > _layer("swarm.net.fake")[0] for t in targets)
