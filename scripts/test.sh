#!/usr/bin/env bash
# Runs swarm's test suite in the project-local .venv (created on first run).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
source "$ROOT/scripts/_sysdeps.sh"
cd "$ROOT"
exec python -m pytest "$@"
