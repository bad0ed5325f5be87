#!/usr/bin/env bash
# Regenerates swarm/proto/*_pb2.py(i) from proto/*.proto with the grpcio-tools pinned in
# scripts/constraints.txt. tests/test_proto_fresh.py fails when the committed code differs.
#
# The pin is old on purpose: the protoc inside grpcio-tools 1.64 writes protobuf 5.26 gencode,
# which imports on every protobuf runtime from 5.26 to 7.x (pyproject.toml: protobuf>=5.26.1,<8),
# so a stock Colab runtime (protobuf 5.29) keeps its own protobuf. Newer protoc adds a
# ValidateProtobufRuntimeVersion call that rejects runtimes older than itself. That grpcio-tools
# needs protobuf<6 itself, so it runs in its own small venv (.venv/protoc-<version>), not in .venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/swarm/proto}"
PIN="$(grep -E '^grpcio-tools==' "$ROOT/scripts/constraints.txt")" \
  || { echo "gen_proto: no grpcio-tools==VERSION line in scripts/constraints.txt" >&2; exit 1; }
GEN="${SWARM_PROTOC_VENV:-$ROOT/.venv/protoc-${PIN#grpcio-tools==}}"
if [ ! -x "$GEN/bin/python" ] || ! "$GEN/bin/python" -c "import grpc_tools" 2>/dev/null; then
  echo "gen_proto: installing $PIN into $GEN" >&2
  "${PYTHON:-python3}" -m venv "$GEN"
  "$GEN/bin/python" -m pip install -q --disable-pip-version-check "$PIN" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$GEN/bin/python" -c "import grpc_tools" || { echo "gen_proto: could not install $PIN" >&2; exit 1; }
fi
mkdir -p "$OUT"
cd "$ROOT/proto"
"$GEN/bin/python" -m grpc_tools.protoc -I . --python_out="$OUT" --pyi_out="$OUT" ./*.proto
