#!/usr/bin/env bash
# Run the conversion suites under one Megatron-Bridge pin, using the overlay from scripts/pin_overlay.sh.
#   scripts/run_pin.sh PIN [pytest args]      e.g. scripts/run_pin.sh 0.4.2 -k strict
# With no test paths among the args it runs the pin selection below. Known gaps come from
# xfails/bridgeXY.txt (X.Y = the pin's major.minor) via --xfails-file; each listed test must still fail.
# Environment: MCORE_PIN, VENV, PINS_DIR (see pin_overlay.sh); DSV4_PIN_WORKERS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=${1:?usage: scripts/run_pin.sh PIN [pytest args]}
shift
VENV=${VENV:-.venv}
SELECTION=(
  suites/test_bridge_pins.py
  suites/test_bridge_registration.py
  suites/test_mapping_table.py
  suites/test_strict_load.py
  suites/test_coverage.py
  suites/test_quantized_base.py
  suites/test_upstream_layout.py
  suites/test_run_config_layout.py
  suites/test_fused_kernel_gate_pins.py
  suites/test_provider_dispatch.py
  suites/test_detection.py
)
paths=()
for arg in "$@"; do [[ $arg == suites/* || $arg == *.py* ]] && paths+=("$arg"); done
[ ${#paths[@]} -gt 0 ] || set -- "${SELECTION[@]}" "$@"

pp=$(scripts/pin_overlay.sh "$PIN")
IFS=. read -r major minor _ <<<"$PIN"
env_name="bridge${major}${minor}"
xfails=()
[ -f "xfails/$env_name.txt" ] && xfails=(--xfails-file "xfails/$env_name.txt")
start=$(date +%s)
set +e
DSV4_BRIDGE_PIN=$PIN PYTHONPATH="$pp" "$VENV/bin/python" -m pytest -m cpu -n "${DSV4_PIN_WORKERS:-2}" \
  --dist loadgroup -q --hypothesis-profile=ci "${xfails[@]}" "$@"
rc=$?
set -e
echo "run_pin: megatron-bridge $PIN ($env_name) took $(( $(date +%s) - start ))s (pytest exit $rc)" >&2
exit "$rc"
