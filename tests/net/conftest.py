"""Fixtures of the network-layer tests (`make_peer` is in tests/conftest.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/net/proxy.py
