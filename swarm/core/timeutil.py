"""Clocks. DHT expirations are wall-clock seconds (peers compare them); timeouts use monotonic time."""

from __future__ import annotations

import time


def get_dht_time() -> float:
    """Wall-clock time used for DHT expiration times, shared by all peers."""
    return time.time()
