"""Fixtures of the attack tests: the attacker and the honest client are in-process peers
(`make_peer`, tests/conftest.py); the honest side runs as real `swarm-peer` processes (`tests/procs.py`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # attacks.py
