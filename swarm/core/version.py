"""The version of swarm (the one in pyproject.toml), reported by every peer's ``Info`` RPC."""

__version__ = "0.2.0"
