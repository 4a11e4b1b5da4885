#!/usr/bin/env bash
# The latest lane: the newest torch, transformers, PEFT and safetensors the package index serves
# (requirements/latest.txt, installed by `DSV4_LANE=latest scripts/install.sh .venv-latest`).
#   scripts/run_latest.sh [pytest args]          the megatron-free files (fixtures/runner/pins.py) with megatron made
#                                                unimportable, then whether Megatron-Bridge imports under this
#                                                transformers (xfails/latest.txt)
#   scripts/run_latest.sh bridge [pytest args]   the rest of the files that use transformers or PEFT, as a pin
#                                                runs them (not slow but the qualify runs; dev hypothesis profile),
#                                                under the newest transformers Bridge imports under
#                                                (requirements/latest-bridge.txt; an overlay over .venv-latest where
#                                                it differs from the venv's; xfails/latest-bridge.txt)
#   scripts/run_latest.sh previous [pytest args] the first half's files that use transformers or PEFT and the
#                                                Bridge import again, under the previous transformers release
#                                                (requirements/latest-previous.txt, an overlay; xfails/latest-previous.txt)
# Environment: VENV (default .venv-latest), PINS_DIR (default .pins), DSV4_PIN_WORKERS, DSV4_PIN_HYPOTHESIS.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv-latest}
PINS_DIR=${PINS_DIR:-.pins}
[ -x "$VENV/bin/python" ] || { echo "run_latest: $VENV missing; run DSV4_LANE=latest scripts/install.sh $VENV" >&2; exit 1; }
status=0
note() { local rc=$?; [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc; return 0; }

# overlay REQUIREMENTS_FILE: prints a PYTHONPATH entry holding the file's transformers pin (a --target install under
# $PINS_DIR), or nothing where the venv already has it
overlay() {
  local spec dir
  spec=$(grep -E '^transformers==' "$1")
  if [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("transformers"))')" = "${spec#transformers==}" ]; then
    return 0
  fi
  dir="$PINS_DIR/transformers-${spec#transformers==}"
  mkdir -p "$PINS_DIR"
  [ -f "$PINS_DIR/.gitignore" ] || echo '*' >"$PINS_DIR/.gitignore"
  if [ ! -f "$dir/.overlay-spec" ] || [ "$(cat "$dir/.overlay-spec")" != "$spec" ]; then
    rm -rf "$dir"
    # the latest venv was installed without the host's version cap (scripts/install.sh); so is its overlay
    PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      --target "$dir" "$spec" >&2
    echo "$spec" >"$dir/.overlay-spec"
  fi
  echo "$PWD/$dir"
}

if [ "${1:-}" = previous ]; then
  shift
  pp=$(overlay requirements/latest-previous.txt)
  PYTHONPATH="$pp" scripts/run_pin.sh independent -m "cpu and pin_independent and not consumer_env and transformers" "$@" || note
  PYTHONPATH="$pp" "$VENV/bin/python" -m pytest -m cpu -n 0 -q --xfails-file xfails/latest-previous.txt \
    suites/reference/test_bridge_imports.py "$@" || note
  exit "$status"
fi
if [ "${1:-}" != bridge ]; then
  # the consumer environments' code is the same in every lane: their tests (consumer_env) run in the main lane only
  scripts/run_pin.sh independent -m "cpu and pin_independent and not consumer_env" "$@" || note
  "$VENV/bin/python" -m pytest -m cpu -n 0 -q --xfails-file xfails/latest.txt suites/reference/test_bridge_imports.py "$@" || note
  exit "$status"
fi
shift
pp=$(overlay requirements/latest-bridge.txt)
paths=()
for arg in "$@"; do [[ $arg == suites/* || $arg == *.py* ]] && paths+=("$arg"); done
# Of the rest, the files that use transformers or PEFT (marked transformers from their source), as a pin runs them
# (.ci/run's PIN_MARKS: the qualify runs included); the suite's own machinery (harness) runs in the main lane and,
# megatron-free, in the first half.
marks="cpu and not pin_independent and (not slow or bridge_path) and not harness and transformers"
if [ ${#paths[@]} -eq 0 ]; then set -- suites -m "$marks" "$@"; else set -- -m cpu "$@"; fi
start=$(date +%s)
PYTHONPATH="$pp" "$VENV/bin/python" -m pytest -n "${DSV4_PIN_WORKERS:-2}" --dist loadgroup -q \
  --hypothesis-profile="${DSV4_PIN_HYPOTHESIS:-dev}" --xfails-file xfails/latest-bridge.txt "$@" || note
echo "run_latest: bridge half took $(( $(date +%s) - start ))s" >&2
exit "$status"
