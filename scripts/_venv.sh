# Sourced by the set-up scripts: creates or reuses the project-local .venv and installs swarm into it
# (editable, with the dev extra for the tests and the demo extra, matplotlib, for the demo's loss plot).
# Re-installs only when pyproject.toml or the constraints changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "swarm: creating $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
STAMP="$VENV/.swarm-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "swarm: installing dependencies into $VENV (first run takes a minute or two)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  # --no-compile: byte-compiling all of torch costs ~45 s of CPU; Python compiles what is imported
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile \
      -c "$ROOT/scripts/constraints.txt" -e "$ROOT[dev,demo]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -c "import swarm, torch, grpc" || { echo "swarm: install failed" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# The suite and the demo start hundreds of Python processes. Where the environment turns bytecode
# caching off (PYTHONDONTWRITEBYTECODE, as some CI images and sandboxes do), every one of them
# compiles torch's and swarm's modules again (about 1.5 s of CPU each); with it on, the first
# process to import a module caches it for the rest.
unset PYTHONDONTWRITEBYTECODE
