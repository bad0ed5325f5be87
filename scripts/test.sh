#!/usr/bin/env bash
# Runs swarm's test suite in the project-local .venv (created on first run), on two pytest-xdist
# workers (tests/conftest.py says why and how they share the work). Extra arguments go to pytest;
# `-n 0` after them runs everything in this one process.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
source "$ROOT/scripts/_sysdeps.sh"
cd "$ROOT"
exec python -m pytest -n "${SWARM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
