#!/bin/sh
# Starts a swarm process joined through a bootstrap peer known only by host name and port, as in
# docker/compose.yaml, where the bootstrap's PeerID is created at its first start:
#
#   SWARM_BOOTSTRAP=/dns4/expert/tcp/31337  swarm-join [swarm-peer options...]   # a peer
#   SWARM_BOOTSTRAP=/dns4/expert/tcp/31337  swarm-join status [options...]        # swarm-peer status
#   SWARM_BOOTSTRAP=/dns4/expert/tcp/31337  swarm-join train [trainer options...] # a demo trainer
#
# It asks the peer at SWARM_BOOTSTRAP for its PeerID (the handshake proves the peer holds that
# key; whoever answers first at that address is trusted), waiting up to SWARM_BOOTSTRAP_WAIT
# seconds (default 120) for it to start, and sets SWARM_INITIAL_PEERS to the full address.
# With SWARM_INITIAL_PEERS already set, or no SWARM_BOOTSTRAP, it is plain swarm-peer.
# `train` runs `python -m swarm.demo.trainer --initial-peers $SWARM_INITIAL_PEERS` with the options.
set -eu
if [ -n "${SWARM_BOOTSTRAP:-}" ] && [ -z "${SWARM_INITIAL_PEERS:-}" ]; then
  SWARM_INITIAL_PEERS="$(swarm-peer status --resolve "$SWARM_BOOTSTRAP" --wait "${SWARM_BOOTSTRAP_WAIT:-120}")"
  export SWARM_INITIAL_PEERS
  echo "swarm-join: bootstrap peer is $SWARM_INITIAL_PEERS" >&2
fi
if [ "${1:-}" = train ]; then
  shift
  [ -n "${SWARM_INITIAL_PEERS:-}" ] || { echo "swarm-join train: set SWARM_BOOTSTRAP or SWARM_INITIAL_PEERS" >&2; exit 2; }
  # shellcheck disable=SC2046 # one argument per address (space- or comma-separated)
  exec python -m swarm.demo.trainer --initial-peers $(echo "$SWARM_INITIAL_PEERS" | tr ',' ' ') "$@"
fi
exec swarm-peer "$@"
