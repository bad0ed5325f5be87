"""Command-line entry points (`swarm-peer`)."""
