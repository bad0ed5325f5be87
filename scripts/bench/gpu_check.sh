#!/usr/bin/env bash
# One command on a machine with NVIDIA GPUs, about 5 minutes at most: the GPU tests (pytest -m gpu),
# then the GPU benchmarks: CUDA tensors through averaging and a RemoteExpert fed from the GPU
# (bench_gpu.py), and a torchrun job whose ranks reduce over NCCL as one swarm peer against one
# peer per process (bench_multigpu.py --device cuda; 2 ranks on 2 or more GPUs, 1 on one GPU).
#
#   scripts/bench/gpu_check.sh          # the first of $PYTHON, .venv/bin/python, python3 whose torch sees CUDA
#
# It needs a CUDA build of torch and swarm's dependencies (pyproject.toml) in that Python; swarm
# itself is imported from this checkout (PYTHONPATH), so nothing needs installing but those. The
# project's .venv holds the CPU build of torch: on a GPU machine it falls through to python3. A
# machine that cannot reach PyPI takes the missing packages as wheels downloaded elsewhere
# (`pip download --only-binary=:all: cachetools cryptography base58 pydantic ...`, then
# `pip install --no-index` there). Without a CUDA device, or with a package missing, it stops at
# once with exit status 2 and says why; any failing step fails the script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$(date +%s)

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=""
for candidate in ${PYTHON:+"$PYTHON"} "$ROOT/.venv/bin/python" python3; do
  if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then
    PY="$candidate"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: FAILED: no CUDA device is visible to any of: ${PYTHON:+$PYTHON, }$ROOT/.venv/bin/python, python3" \
       "(this check needs a machine with an NVIDIA GPU and a CUDA build of torch)" >&2
  for candidate in ${PYTHON:+"$PYTHON"} "$ROOT/.venv/bin/python" python3; do
    "$candidate" -c 'import sys, torch; print(" ", sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)' \
      >&2 2>/dev/null || echo "  $candidate: no torch" >&2
  done
  exit 2
fi
if ! MISSING=$("$PY" - <<'PYEOF'
import importlib.util
needed = ["grpc", "google.protobuf", "msgpack", "cachetools", "cryptography", "base58", "pydantic",
          "prometheus_client", "pytest", "pytest_timeout"]
missing = [name for name in needed if importlib.util.find_spec(name) is None]
print(" ".join(missing))
raise SystemExit(1 if missing else 0)
PYEOF
); then
  echo "gpu_check: FAILED: $PY lacks the modules $MISSING (swarm's dependencies, pytest, pytest-timeout):" \
       "install them (as wheels, where PyPI cannot be reached)" >&2
  exit 2
fi
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
RANKS=$(( GPUS >= 2 ? 2 : 1 ))
echo "gpu_check: $PY, $GPUS CUDA device(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"

step() {  # step NAME SECONDS COMMAND...: runs one bounded step, failing the script loudly
  local name=$1 limit=$2
  shift 2
  echo "== gpu_check: $name (at most ${limit} s)"
  if ! timeout --kill-after=10 "$limit" "$@"; then
    echo "gpu_check: FAILED: $name" >&2
    exit 1
  fi
}

step "GPU tests" 150 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -m gpu -rs tests/gpu tests/optim/test_distributed.py
step "CUDA tensors through averaging, RemoteExpert on the GPU" 60 \
  "$PY" scripts/bench/bench_gpu.py --rounds 3 --mbytes 100 --repeats 10
step "a ${RANKS}-rank NCCL peer against ${RANKS} one-process peers" 90 \
  "$PY" scripts/bench/bench_multigpu.py --device cuda --ranks "$RANKS" --steps 150 --hidden-dim 256
echo "gpu_check: passed in $(( $(date +%s) - started )) s"
