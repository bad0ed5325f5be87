"""The infrastructure roles never import torch (docs/architecture.md, "What may import torch").

`pip install swarm-peer` has no torch (nor numpy, which comes with the torch extra): a DHT/bootstrap
node, a relay and `swarm-peer status` run from it. Only the packages in `TORCH_PACKAGES` may import torch; every other module of swarm must
import, with everything it imports at module level, without it. A torch-free module may still
reach a torch package inside a function, where a user asked for a feature that needs torch (the
daemon's `--experts`); the torch packages then raise `MissingDependency` naming the install command.

Read from the source with `ast` (like tests/test_layers.py), then checked for real: a subprocess
in which torch cannot be imported (a meta-path finder refuses it) imports every torch-free module,
runs a DHT node and a relay with `swarm-peer`, stores and reads through them, and asks for names
that need torch. tests/install/test_torch_free_install.py does the same from a venv without torch.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch_free
from procs import PeerProcess

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "swarm"

TORCH_PACKAGES: tuple[str, ...] = (
    "swarm.averaging",
    "swarm.compression",
    "swarm.core.needs_torch",  # the guard those packages import first: without torch it raises
    "swarm.demo",
    "swarm.integrations",
    "swarm.moe",
    "swarm.net.streaming",
    "swarm.optim",
)
"""The packages (and modules) that may import torch. Everything else in swarm is torch-free."""

TORCH_FREE_INSIDE: tuple[str, ...] = (
    "swarm.moe",  # its names resolve lazily
    "swarm.moe.uids",  # expert names: `swarm-peer status` lists experts
    "swarm.moe.dht_declare",  # the experts' DHT records: read by `swarm-peer status`
    "swarm.moe.sources",
    "swarm.moe.server_role",  # every peer of a private swarm checks who may declare experts
    "swarm.moe.server",
    "swarm.moe.server.cli",  # `--experts` is checked before torch is needed
    "swarm.optim",  # its names resolve lazily (those that need torch say so)
    "swarm.optim.progress",  # training progress records: the dashboard reads them
    "swarm.optim.outcome",
)
"""Modules inside `TORCH_PACKAGES` that are torch-free all the same (infrastructure roles use them)."""

NEEDS_TORCH_FIRST = ("swarm.averaging", "swarm.compression", "swarm.demo", "swarm.moe.client")
"""The torch packages whose `__init__` imports `swarm.core.needs_torch` first (the actionable error)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def needs_torch(name: str) -> bool:
    if name in TORCH_FREE_INSIDE:
        return False
    return any(name == p or name.startswith(p + ".") for p in TORCH_PACKAGES)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _eager_imports(name: str, path: Path) -> tuple[set[str], set[str]]:
    """What `name` imports when it is imported: (swarm modules, other top-level packages).

    Module-level statements only, and the bodies of `if`/`try` there, but not `if TYPE_CHECKING:`
    and not function or class bodies (a class body runs on import, but swarm's do not import).
    A package import counts as its `__init__`, and `from a.b import c` also as `a.b.c` when that is a module.
    """
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    swarm_targets: set[str] = set()
    others: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    visit(block)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                add(base)
                for alias in node.names:
                    if f"{base}.{alias.name}" in MODULES:
                        add(f"{base}.{alias.name}")

    def add(target: str) -> None:
        if target.split(".")[0] != "swarm":
            others.add(target.split(".")[0])
            return
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c imports a and a.b first
            prefix = ".".join(parts[:i])
            if prefix in MODULES and prefix != name:
                swarm_targets.add(prefix)

    visit(ast.parse(path.read_text(), str(path)).body)
    return swarm_targets, others


EAGER = {name: _eager_imports(name, path) for name, path in MODULES.items()}
TORCH_FREE_MODULES = sorted(name for name in MODULES if not needs_torch(name) and not name.endswith("__main__"))


def _reaches_torch(name: str) -> list[str]:
    """A chain of module-level imports from `name` to torch or a torch package, or [] if none."""
    seen: set[str] = set()
    stack: list[tuple[str, list[str]]] = [(name, [name])]
    while stack:
        current, chain = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        targets, others = EAGER[current]
        for package in sorted(others & {"torch", "numpy"}):  # numpy comes with the torch extra too
            return [*chain, package]
        for target in sorted(targets):
            if needs_torch(target):
                return [*chain, target]
            stack.append((target, [*chain, target]))
    return []


def test_the_rule_names_packages_that_exist() -> None:
    missing = [p for p in TORCH_PACKAGES + TORCH_FREE_INSIDE
               if p not in MODULES and p != "swarm.integrations"]  # integrations: optional, may come later
    assert missing == []


def test_torch_free_modules_import_nothing_that_needs_torch() -> None:
    chains = {name: " -> ".join(chain) for name in TORCH_FREE_MODULES if (chain := _reaches_torch(name))}
    assert chains == {}, "a torch-free module imports torch at module level (docs/architecture.md)"


def test_no_torch_free_module_imports_torch_even_lazily() -> None:
    """Inside a function it must go through a torch package, whose guard names the install command."""
    direct = []
    for name in TORCH_FREE_MODULES:
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "torch" for n in names):
                direct.append(name)
    assert direct == []


def test_each_torch_package_checks_for_torch_before_anything_else() -> None:
    for name in NEEDS_TORCH_FIRST:
        tree = ast.parse(MODULES[name].read_text())
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                   and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        assert imports and isinstance(imports[0], ast.Import), name
        assert imports[0].names[0].name == "swarm.core.needs_torch", name


def test_the_checker_sees_torch_behind_a_module_level_import(tmp_path: Path) -> None:
    path = tmp_path / "fake.py"
    path.write_text("from __future__ import annotations\nif True:\n    from swarm.optim.optimizer import Optimizer\n")
    MODULES["swarm.cli.fake"] = path
    try:
        EAGER["swarm.cli.fake"] = _eager_imports("swarm.cli.fake", path)
        assert _reaches_torch("swarm.cli.fake")[-1] in ("swarm.optim", "swarm.optim.optimizer")
        path.write_text("def f():\n    from swarm.optim.optimizer import Optimizer\n")
        EAGER["swarm.cli.fake"] = _eager_imports("swarm.cli.fake", path)
        assert _reaches_torch("swarm.cli.fake") == []
    finally:
        del MODULES["swarm.cli.fake"], EAGER["swarm.cli.fake"]


BLOCK_TORCH = textwrap.dedent('''
    import sys

    class _NoTorch:
        """Makes torch and numpy unimportable, as if they were not installed (the torch extra brings both)."""

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("torch", "numpy"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
''')


def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes (and their children) cannot import torch."""
    site = tmp_path / "notorch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_TORCH)
    path = os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


IMPORT_ALL = textwrap.dedent('''
    import importlib, json, sys
    import swarm
    names = json.loads(sys.argv[1])
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    errors = {}
    for name in ("Optimizer", "Averager", "ExpertServer", "RemoteMixtureOfExperts", "CompressionType"):
        try:
            getattr(swarm, name)
            errors[name] = "no error"
        except swarm.MissingDependency as e:
            errors[name] = str(e)
    try:
        import swarm.averaging
        errors["import swarm.averaging"] = "no error"
    except ImportError as e:
        errors["import swarm.averaging"] = f"{type(e).__name__}: {e}"
    print(json.dumps({"failed": failed, "errors": errors, "torch": "torch" in sys.modules or "numpy" in sys.modules,
                      "peer": swarm.Peer.__name__, "dht": swarm.DHT.__name__}))
''')


def test_every_torch_free_module_imports_without_torch(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(TORCH_FREE_MODULES)], capture_output=True,
                         text=True, timeout=120, env=no_torch_env(tmp_path), cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["failed"] == {} and result["torch"] is False
    assert (result["peer"], result["dht"]) == ("Peer", "DHT")
    for name, message in result["errors"].items():  # each names what needs torch and the install command
        assert 'pip install "swarm-peer[torch]"' in message, (name, message)
    assert "swarm.Optimizer needs torch" in result["errors"]["Optimizer"]
    assert result["errors"]["import swarm.averaging"].startswith("MissingDependency")


CLIENT = textwrap.dedent('''
    import json, sys, time
    import swarm
    from swarm.cli.status import main as status_main
    with swarm.Peer(initial_peers=[sys.argv[1]], listen="/ip4/127.0.0.1/tcp/0") as a:
        assert a.dht.store("infra-key", b"through the node", time.time() + 60)
    with swarm.Peer(initial_peers=[sys.argv[1]], listen="/ip4/127.0.0.1/tcp/0", client_mode=True) as b:
        found = b.dht.get("infra-key", latest=True)
        print(json.dumps({"value": found.value.decode() if found else None,
                          "torch": "torch" in sys.modules or "numpy" in sys.modules}))
''')


@pytest.mark.timeout(120)
def test_a_dht_and_relay_node_serves_without_torch(tmp_path: Path) -> None:
    env = no_torch_env(tmp_path)
    args = ["--listen", "/ip4/127.0.0.1/tcp/0", "--relay", "on", "--reachability", "public", "--log-level", "WARNING"]
    with PeerProcess(*args, "--identity", str(tmp_path / "node.key"), env=env, cwd=str(tmp_path)) as node:
        addr = node.addrs[0]
        out = subprocess.run([sys.executable, "-c", CLIENT, addr], capture_output=True, text=True, timeout=60,
                             env=env, cwd=tmp_path, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.splitlines()[-1]) == {"value": "through the node", "torch": False}
        status = subprocess.run([sys.executable, "-m", "swarm.cli.peer", "status", "--initial-peers", addr,
                                 "--json"], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
                                check=False)
        assert status.returncode == 0, status.stderr[-3000:]
        assert json.loads(status.stdout), status.stdout
        assert node.stop() == 0
    experts = subprocess.run([sys.executable, "-m", "swarm", *args, "--experts", "ffn.[0:2]"], capture_output=True,
                             text=True, timeout=60, env=env, cwd=tmp_path, check=False)
    assert experts.returncode == 2, experts.stderr[-3000:]
    assert 'swarm-peer --experts needs torch' in experts.stderr and 'pip install "swarm-peer[torch]"' in experts.stderr


def test_torch_without_numpy_names_numpy_and_the_install_command(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch installed, to leave only numpy out")
    site = tmp_path / "nonumpy"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_TORCH.replace('("torch", "numpy")', '("numpy",)'))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT)]))}
    code = "import swarm\ntry:\n    swarm.RemoteExpert\nexcept swarm.MissingDependency as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("swarm.RemoteExpert needs numpy,") and 'swarm-peer[torch]"' in out.stdout, out.stdout


def _only_in_extras() -> set[str]:
    """The import names of what the extras bring and a venv of `swarm-peer[test]` lacks (torch,
    numpy, safetensors, matplotlib, ...): tests/install/test_pythons.py runs the torch-free part there."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}

    extras = project["optional-dependencies"]
    kept = names(project["dependencies"]) | names(extras["test"])
    return set().union(*(names(r) for name, r in extras.items() if name != "test")) - kept


@pytest.mark.timeout(180)
def test_the_torch_free_part_of_the_suite_collects_where_the_extras_cannot_be_imported(tmp_path: Path) -> None:
    """On 3.11, where torch is installed, a test file of the torch-free part that imports torch (or
    another package only an extra brings) at module level fails here, not first on 3.12 or 3.13."""
    blocked = _only_in_extras()
    assert {"torch", "numpy", "safetensors"} <= blocked
    env = no_torch_env(tmp_path)
    (tmp_path / "notorch" / "sitecustomize.py").write_text(BLOCK_TORCH.replace('("torch", "numpy")',
                                                                               repr(tuple(sorted(blocked)))))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:randomly", *torch_free.pytest_args()], capture_output=True, text=True,
                         timeout=150, env=env, cwd=ROOT, check=False)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and re.fullmatch(r"\d+(/\d+)? tests? collected.*", summary), \
        out.stdout[-4000:] + out.stderr[-2000:]
