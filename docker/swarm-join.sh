#!/bin/sh
# Starts swarm-peer joined through a bootstrap peer known only by host name and port, as in
# docker/compose.yaml, where the bootstrap's PeerID is created at its first start:
#
#   SWARM_BOOTSTRAP=/dns4/bootstrap/tcp/31337  swarm-join [swarm-peer options...]
#
# It asks the peer at SWARM_BOOTSTRAP for its PeerID (the handshake proves the peer holds that
# key; whoever answers first at that address is trusted), waiting up to SWARM_BOOTSTRAP_WAIT
# seconds (default 120) for it to start, and runs swarm-peer with SWARM_INITIAL_PEERS set to the
# full address. With SWARM_INITIAL_PEERS already set, or no SWARM_BOOTSTRAP, it is plain swarm-peer.
set -eu
if [ -n "${SWARM_BOOTSTRAP:-}" ] && [ -z "${SWARM_INITIAL_PEERS:-}" ]; then
  SWARM_INITIAL_PEERS="$(swarm-peer status --resolve "$SWARM_BOOTSTRAP" --wait "${SWARM_BOOTSTRAP_WAIT:-120}")"
  export SWARM_INITIAL_PEERS
  echo "swarm-join: bootstrap peer is $SWARM_INITIAL_PEERS" >&2
fi
exec swarm-peer "$@"
