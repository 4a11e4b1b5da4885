#!/usr/bin/env bash
# Rehearse the GPU check on this CPU host as the lent machine would run it: the image's Python set
# (requirements/device-image.txt: torch, transformers, peft as that image has them, and no megatron) in an
# environment of its own, the bundle of scripts/device_bundle.sh, and `DEVICE_CHECK_DRY=1 scripts/device_check.sh`
# inside a network namespace that has only loopback (gloo's ranks meet there), so nothing can be fetched.
#   scripts/device_rehearsal.sh [VENV]            default VENV=.venv-device (ignored by git)
#   scripts/device_rehearsal.sh --prepare [VENV]  only build the environment and the bundle (.ci/run does this in
#                                                 the background while the main suite runs: it is mostly download)
# Environment: DEVICE_CHECK_BUDGET_S (the dry check's budget, default the check's own).
set -euo pipefail
cd "$(dirname "$0")/.."
PREPARE_ONLY=0
if [ "${1:-}" = --prepare ]; then PREPARE_ONLY=1; shift; fi
VENV=${1:-.venv-device}
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$(scripts/find_python312.sh)" -m venv "$VENV"
fi
# This stands for the image: its packages come from the index here; there they are already installed.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements/device-image.txt
if "$VENV/bin/python" -c 'import megatron' 2>/dev/null; then
  echo "device_rehearsal: $VENV has megatron, which the GPU image lacks; remove $VENV and re-run" >&2
  exit 1
fi
scripts/device_bundle.sh .device-bundle
echo "device_rehearsal: image environment and bundle ready in $(($(date +%s) - start))s"
[ "$PREPARE_ONLY" = 1 ] && exit 0

# DSV4_BENCH_REPEATS=1 DSV4_BENCH_EP=64: on a CPU host the load bench proves it runs (one repeat over a smaller
# share); its figures are the GPU machine's to give
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # the install target is the rehearsal's alone
site=$work/site  # a fresh install target, as on a bare machine
# shellcheck disable=SC2016
unshare --net -- bash -c '
  ip link set lo up
  "$1" -c "
import socket, sys
s = socket.socket()
s.settimeout(3)
rc = s.connect_ex((\"1.1.1.1\", 443))
print(f\"device_rehearsal: network unreachable (connect to 1.1.1.1:443 -> errno {rc}), as on the GPU machine\")
sys.exit(rc == 0)
" || { echo "device_rehearsal: the namespace reaches the network" >&2; exit 1; }
  PYTHON="$1" DEVICE_CHECK_DRY=1 DEVICE_BUNDLE=.device-bundle DEVICE_SITE="$2" PIP_NO_INDEX=1 DSV4_BENCH_REPEATS=1 DSV4_BENCH_EP=64 \
    exec scripts/device_check.sh
' rehearsal "$VENV/bin/python" "$site"
