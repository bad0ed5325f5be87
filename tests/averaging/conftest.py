"""Lets the averaging tests import their process harness (`avg_harness`) under --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
