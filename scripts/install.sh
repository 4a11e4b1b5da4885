#!/usr/bin/env bash
# Create (or reuse) a Python 3.12 virtual environment with everything the suite needs.
#   scripts/install.sh [VENV_DIR]        default VENV_DIR=.venv
# Environment: BRIDGE_PIN (default 0.6.2), MCORE_PIN (default from requirements/base.txt), DSV4_LANE (default main;
# latest: requirements/latest.txt, the newest torch/transformers/PEFT the index serves).
# megatron-bridge is installed with --no-deps: its full dependency set pulls GPU-only packages
# (fast-hadamard-transform, flashinfer, nvidia-resiliency-ext) that cannot install on a CPU host;
# what it really imports is pinned in requirements/base.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
BRIDGE_PIN=${BRIDGE_PIN:-0.6.2}

PY=$(scripts/find_python312.sh)
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
# Byte-compiled at install (pip's default), never lazily: where PYTHONDONTWRITEBYTECODE is set (this host sets it) a
# lazily compiled module is compiled again by every interpreter, in each of the suite's hundreds of subprocesses and
# ranks (docs/performance.md, test harness).
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
REQUIREMENTS=requirements/base.txt
if [ "${DSV4_LANE:-main}" = latest ]; then
  REQUIREMENTS=requirements/latest.txt
  # A host may cap packages at the releases it keeps on disk (a pip constraints file); the latest lane exists to
  # run what a user installing today gets, so it installs without that cap.
  export PIP_CONSTRAINT=/dev/null
fi
"${PIP[@]}" -r "$REQUIREMENTS" ${MCORE_PIN:+"megatron-core==$MCORE_PIN"}
"${PIP[@]}" --no-deps "megatron-bridge==$BRIDGE_PIN"
if [ "$REQUIREMENTS" = requirements/base.txt ]; then "${PIP[@]}" -r requirements/dev.txt; fi
"${PIP[@]}" --no-deps -e .
echo "installed in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
