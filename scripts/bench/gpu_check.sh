#!/usr/bin/env bash
# One command on a machine with NVIDIA GPUs, about 5 minutes at most: the GPU tests (pytest -m gpu),
# then the GPU benchmarks: CUDA tensors through averaging and a RemoteExpert fed from the GPU
# (bench_gpu.py), and a torchrun job whose ranks reduce over NCCL as one swarm peer against one
# peer per process (bench_multigpu.py --device cuda; 2 ranks on 2 or more GPUs, 1 on one GPU).
#
#   scripts/bench/gpu_check.sh                 # uses .venv/bin/python, or $PYTHON
#
# It needs a CUDA build of torch (the project's .venv installs the CPU build: on a GPU machine
# install torch 2.13.0 for its CUDA version into the environment $PYTHON names). Without a CUDA
# device it stops at once with exit status 2 and says why; any failing step fails the script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
started=$(date +%s)

if ! command -v "$PY" >/dev/null 2>&1 && [ ! -x "$PY" ]; then
  echo "gpu_check: FAILED: no Python at $PY (set PYTHON, or create .venv with scripts/test.sh)" >&2
  exit 2
fi
if ! GPUS=$("$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: FAILED: no CUDA device is visible to {sys.executable} (torch {torch.__version__}, "
             f"built for CUDA {torch.version.cuda or 'none: a CPU-only build'}); this check needs a machine with "
             f"an NVIDIA GPU and a CUDA build of torch")
print(torch.cuda.device_count())
PYEOF
); then
  exit 2
fi
RANKS=$(( GPUS >= 2 ? 2 : 1 ))
echo "gpu_check: $GPUS CUDA device(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"

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
  "$PY" scripts/bench/bench_multigpu.py --device cuda --ranks "$RANKS" --seconds 15 --hidden-dim 256
echo "gpu_check: passed in $(( $(date +%s) - started )) s"
