#!/usr/bin/env bash
# Regenerates swarm/proto/*_pb2.py(i) from proto/*.proto with the pinned grpcio-tools.
# tests/test_proto_fresh.py fails when the committed code differs from what this produces.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/swarm/proto}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p "$OUT"
cd "$ROOT/proto"
"$PY" -m grpc_tools.protoc -I . --python_out="$OUT" --pyi_out="$OUT" ./*.proto
