#!/usr/bin/env bash
# The main job: a local swarm on loopback (one expert server, three trainers) trains a small
# byte-level language model for two minutes and shows its loss falling. Any flags go to
# `python -m swarm.demo` (--duration SECONDS, --trainers N, --diloco-steps H, --out-dir DIR).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python -m swarm.demo "$@"
