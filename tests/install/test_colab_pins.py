"""Installing swarm into a stock Colab runtime changes none of its packages, and the Colab notebook
runs there.

A venv gets Colab's packages at Colab's versions (tests/install/colab-2026-08-19.txt, from Colab's
published `pip freeze`; torch 2.13.0+cpu stands in for Colab's 2.11.0+cpu, the only torch this
project's machines may install). Then examples/colab_join.ipynb runs in a kernel of that venv,
against a local swarm, and its own install cell installs swarm's wheel the way a volunteer's
`pip install swarm-peer` would. Afterwards every package that was there before has the same
version, and `pip check` is clean. On this interpreter, and on Colab's Python (3.13) wherever a CPU
torch wheel for it is at hand without downloading a CUDA build (elsewhere that case skips and says so).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from examples.notebook_run import check_outputs, run_notebook
from install.venvs import TORCH, Venv, interpreter, normalize

PINS = Path(__file__).with_name("colab-2026-08-19.txt")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def colab_pins() -> dict[str, str]:
    lines = [line.strip() for line in PINS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return {normalize(name): version for name, _, version in (line.partition("==") for line in lines)}


HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"
COLAB = "3.13"
"""The Python of Colab's runtime (the freeze's): the notebook runs there too where a CPU torch wheel
for it is at hand; tests/install/test_pythons.py runs the parts without torch there anyway."""


def _python_with_a_torch_wheel(version: str) -> Path | str:
    """This interpreter, or `python<version>` where pip's find-links hold a CPU torch wheel for it."""
    if version == HERE:
        return sys.executable
    python = interpreter(version)
    if python is None:
        pytest.skip(f"Python {version} is not installed here (not under pyenv, not on PATH)")
    tag = "cp" + version.replace(".", "")
    links = [Path(d) for d in os.environ.get("PIP_FIND_LINKS", "").split()]
    if not any(d.is_dir() and any(d.glob(f"{TORCH.replace('==', '-')}*-{tag}-{tag}-*.whl")) for d in links):
        pytest.skip(f"no {TORCH} wheel for Python {version} in PIP_FIND_LINKS (the package index would give a "
                    "CUDA build); its parts without torch run in tests/install/test_pythons.py")
    return python


@pytest.mark.parametrize("version", sorted({HERE, COLAB}))
def test_swarm_installs_into_colab_pins_without_changing_them_and_the_notebook_runs(
        version: str, dists: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("nbclient", reason="nbclient runs the notebook (dev extra)")
    _, wheel = dists
    venv = Venv(tmp_path / "colab", python=_python_with_a_torch_wheel(version))
    venv.pip("install", "-q", TORCH, "-r", PINS)
    before = venv.versions()
    pins = colab_pins()
    assert {name: before.get(name) for name in pins} == pins, "the venv holds Colab's versions"
    assert "swarm-peer" not in before

    nb, events, log = run_notebook(tmp_path / "nb", str(venv.bin("python")), venv.env,
                                   install=f"pip install -q {wheel}")
    check_outputs(nb, events, log)

    after = venv.versions()
    assert after.get("swarm-peer"), "the notebook's install cell installed swarm"
    changed = {name: (version, after.get(name)) for name, version in before.items() if after.get(name) != version}
    assert not changed, f"installing swarm changed Colab's packages (before, after): {changed}"
    checked = venv.pip("check", timeout=120)
    assert "No broken requirements found" in checked.stdout, checked.stdout
    added = sorted(set(after) - set(before))
    print(f"installed next to Colab's packages: {added}")
