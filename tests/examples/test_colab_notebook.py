"""`examples/colab_join.ipynb` against a local swarm, in a kernel that imports this checkout with the
newest versions of everything (.venv); tests/install/test_colab_pins.py runs it with Colab's.

How it runs and what it checks: tests/examples/notebook_run.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from examples.notebook_run import ROOT, check_outputs, run_notebook


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_colab_notebook_joins_trains_and_leaves(tmp_path: Path) -> None:
    pytest.importorskip("ipykernel", reason="ipykernel is not installed: no Jupyter kernel can start")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    nb, events, log = run_notebook(tmp_path, sys.executable, env, install="")
    check_outputs(nb, events, log)
