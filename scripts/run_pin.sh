#!/usr/bin/env bash
# Run the CPU suite under one Megatron-Bridge pin, using the overlay from scripts/pin_overlay.sh.
#   scripts/run_pin.sh PIN [pytest args]      e.g. scripts/run_pin.sh 0.4.2 -k strict
#   scripts/run_pin.sh independent [args]     the pin-independent files once, with megatron made unimportable
# With no test paths among the args a pin runs the whole CPU suite except the files fixtures/runner/pins.py lists as
# pin-independent (they never import megatron; `independent` runs them with fixtures/no_megatron first on PYTHONPATH,
# so one that does import it fails). Known gaps come from xfails/bridgeXY.txt (X.Y = the pin's major.minor) via
# --xfails-file: each listed test must still fail with the exception the line names.
# Environment: MCORE_PIN, VENV, PINS_DIR (see pin_overlay.sh); DSV4_PIN_WORKERS (default 2); DSV4_PIN_HYPOTHESIS
# (default dev: 20 examples; a pin checks that the same code runs against another Bridge, the main run explores
# inputs with the ci profile's 50).
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=${1:?usage: scripts/run_pin.sh PIN|independent [pytest args]}
shift
VENV=${VENV:-.venv}
paths=()
for arg in "$@"; do [[ $arg == suites/* || $arg == *.py* ]] && paths+=("$arg"); done

xfails=()
pin_env=()
if [ "$PIN" = independent ]; then
  env_name=independent
  pp="$PWD/fixtures/no_megatron${PYTHONPATH:+:$PYTHONPATH}"
  marks="cpu and pin_independent"
  pin_env=(DSV4_NO_MEGATRON=1)  # the impl fixture then skips the megatron shims (fixtures/runner/impl_loader.py)
else
  pp=$(scripts/pin_overlay.sh "$PIN")
  IFS=. read -r major minor _ <<<"$PIN"
  env_name="bridge${major}${minor}"
  [ -f "xfails/$env_name.txt" ] && xfails=(--xfails-file "xfails/$env_name.txt")
  marks="cpu and not pin_independent"
  pin_env=("DSV4_BRIDGE_PIN=$PIN")
fi
if [ ${#paths[@]} -eq 0 ]; then
  set -- suites "$@"
else
  marks=cpu
fi
start=$(date +%s)
set +e
env "${pin_env[@]}" PYTHONPATH="$pp" "$VENV/bin/python" -m pytest -m "$marks" -n "${DSV4_PIN_WORKERS:-2}" \
  --dist loadgroup -q --hypothesis-profile="${DSV4_PIN_HYPOTHESIS:-dev}" "${xfails[@]}" "$@"
rc=$?
set -e
echo "run_pin: $PIN ($env_name) took $(( $(date +%s) - start ))s (pytest exit $rc)" >&2
exit "$rc"
