#!/usr/bin/env bash
# Runs swarm's test suite in the project-local .venv (created on first run), in two passes
# (tests/conftest.py says why): the tests not marked `alone` on two pytest-xdist workers, then those
# marked `alone` in one process. Extra arguments go to both passes (select with paths or -k: the
# passes set -m); a pass they select nothing from is skipped. The exit status is the first failing
# pass's.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
source "$ROOT/scripts/_sysdeps.sh"
cd "$ROOT"
status=0
python -m pytest -n "${SWARM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" -m "not alone" || status=$?
[ "$status" -eq 5 ] && status=0  # 5: nothing selected
second=0
python -m pytest -n 0 "$@" -m alone || second=$?
[ "$second" -eq 5 ] && second=0
[ "$status" -ne 0 ] && exit "$status"
exit "$second"
