#!/usr/bin/env bash
# Create (or reuse) a Python 3.12 virtual environment with everything the suite needs.
#   scripts/install.sh [VENV_DIR]        default VENV_DIR=.venv
# Environment: BRIDGE_PIN (default 0.6.2), MCORE_PIN (default from requirements/base.txt).
# megatron-bridge is installed with --no-deps: its full dependency set pulls GPU-only packages
# (fast-hadamard-transform, flashinfer, nvidia-resiliency-ext) that cannot install on a CPU host;
# what it really imports is pinned in requirements/base.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
BRIDGE_PIN=${BRIDGE_PIN:-0.6.2}

find_python() {
  for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv: any installed 3.12.x
  for cand in "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  echo "error: Python 3.12 not found (megatron-core>=0.17 and megatron-bridge>=0.5 require it); install it, e.g. 'pyenv install 3.12'" >&2
  return 1
}

PY=$(find_python)
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" -r requirements/base.txt ${MCORE_PIN:+"megatron-core==$MCORE_PIN"}
"${PIP[@]}" --no-deps "megatron-bridge==$BRIDGE_PIN"
"${PIP[@]}" -r requirements/dev.txt
"${PIP[@]}" --no-deps -e .
echo "installed in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
